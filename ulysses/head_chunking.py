"""Head-chunked Ulysses attention ("Untied Ulysses"): c local heads at a time.

Plain Ulysses holds full-sequence q, k, v and out for all h = H/U local heads of a rank. Here
each step moves only the c heads of one chunk: all-to-all in, attend, all-to-all out. Nothing
full-sequence is saved for backward; the backward redoes the exchanges per chunk. The schedule
is :mod:`ulysses.chunk_schedule`, the loop (buffers, overlap) :mod:`ulysses.chunk_loop`; this
module is the chunk source that slices the all-heads, seq-local q, k, v the attention module
computed, and the autograd Function around it.

Shape legend: B batch, s = S / U this rank's piece, H / K all query / kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses.buffer_pool import BufferPool
from ulysses.chunk_loop import ChunkConfig, place_blocks, run_backward, run_forward
from ulysses.chunk_schedule import (DEFAULT_CHUNK_BUDGET_BYTES, Step, build_schedule,
                                    chunk_buffer_bytes, resolve_chunk_size, valid_chunk_sizes)
from ulysses.keep import kept_or_computed
from ulysses.seq_chunk import SeqChunking, seq_chunking
from ulysses.seq_chunk import run_backward as run_seq_backward
from ulysses.seq_chunk import run_forward as run_seq_forward
from ulysses.sharding import HeadLayout

__all__ = ["DEFAULT_CHUNK_BUDGET_BYTES", "build_schedule", "chunk_buffer_bytes",
           "head_chunked_attention", "resolve_chunk_size", "valid_chunk_sizes"]


@dataclass(slots=True)
class _SlicedChunks:
    """A :class:`ulysses.chunk_loop.ChunkSource` over all-heads, seq-local tensors: a step
    sends heads sliced from ``q_BsHD``/``k_BsKD``/``v_BsKD``/``dout_BsHD`` (by global head
    index), and its gradients are copied into ``dq`` and added into ``dk``/``dv`` (a kv head
    sent to several ranks, replicated kv, sums their dk/dv)."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor | None = None
    dq: Tensor | None = None
    dk: Tensor | None = None
    dv: Tensor | None = None

    def send(self, kind: str, j: int, step: Step):
        if kind in ("q", "dout"):
            return (self.q if kind == "q" else self.dout), step.q
        return (self.k if kind == "k" else self.v), step.kv_sent()

    def take(self, kind: str, j: int, step: Step, blocks: list[Tensor]) -> None:
        self.take_rows(kind, j, step, blocks, slice(None))

    def take_rows(self, kind: str, j: int, step: Step, blocks: list[Tensor],
                  rows: slice) -> None:
        """:meth:`take` for rows ``rows`` of the piece only (``blocks[r]`` is
        ``[B, len(rows), n_r, D]``): the sequence-chunked loop returns gradients block by
        block (:mod:`ulysses.seq_chunk`)."""
        if kind == "q":
            place_blocks(self.dq[:, rows], step.q, blocks, add=False)
        else:
            place_blocks((self.dk if kind == "k" else self.dv)[:, rows], step.kv_returned(),
                         blocks, add=True)


class _HeadChunkedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, pool, sinks, seq):
        def compute():
            out = torch.empty_like(q)
            if seq is None:
                lse = run_forward(_SlicedChunks(q, k, v), out, cfg, pool, sinks)
            else:
                lse = run_seq_forward(_SlicedChunks(q, k, v), out, cfg, pool, seq, sinks)
            pool.end_call()
            return out, lse

        # In a checkpointed layer's recompute with kept attention: the forward's result.
        out, lse = kept_or_computed(("head_chunked", tuple(q.shape), tuple(k.shape), q.dtype),
                                    compute)
        # Only seq-local tensors and the small fp32 lse are kept for backward.
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cfg, ctx.pool, ctx.seq = cfg, pool, seq
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        # dk/dv sum the blocks of every rank that got a kv head (replicated kv): in the wider
        # of the exchange's dtype and k's, rounded once at the end.
        comm = ctx.cfg.comm_dtype
        acc = k.dtype if comm is None else torch.promote_types(k.dtype, comm)
        src = _SlicedChunks(q, k, v, dout.contiguous(), torch.empty_like(q),
                            torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        if ctx.seq is None:
            dsinks = run_backward(src, out, lse, ctx.cfg, ctx.pool, sinks)
        else:
            dsinks = run_seq_backward(src, out, lse, ctx.cfg, ctx.pool, ctx.seq, sinks)
        dq, dk, dv = src.dq, src.dk.to(k.dtype), src.dv.to(v.dtype)
        ctx.pool.end_call()
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, None, None, dsinks, None


def head_chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, group, rank: int,
                           layout: HeadLayout, head_chunk_size: int, attn,
                           pool: BufferPool | None = None, overlap: bool = True,
                           sinks: Tensor | None = None,
                           comm_dtype: torch.dtype | None = None,
                           seq_chunk: int | None = None) -> Tensor:
    """Head-chunked Ulysses on already-validated inputs; see ``ulysses_attention``.

    Args:
        q: ``q_BsHD``; k, v: ``k_BsKD``, ``v_BsKD`` (not replicated: chunks pick kv heads).
        group, rank: the Ulysses process group and this rank's index in it.
        layout: :func:`ulysses.sharding.head_layout` of the head counts.
        head_chunk_size: local query heads per step, from :func:`valid_chunk_sizes`.
        attn: what attends one chunk's full-sequence heads: a
            :class:`ulysses.kernels.LocalAttention`, or a :class:`ulysses.ring.RingAttention`
            across the ring axis (hybrid Ulysses x Ring).
        pool: reused chunk buffers; when ``None``, a fresh one whose buffers are freed at the
            end of the forward and of the backward (nothing held in between).
        overlap: exchange step j+1 while step j computes.
        sinks: ``[h]`` attention-sink logits of this rank's query heads (:mod:`ulysses.sinks`).
        comm_dtype: the dtype the exchanges carry (None: the inputs').
        seq_chunk: blocks per rank's piece for the sequence-chunked loop
            (:mod:`ulysses.seq_chunk`: every exchange one block, device buffers O(block));
            None: the head-chunk loop. Not with documents.

    Returns:
        ``out_BsHD``.
    """
    cfg = ChunkConfig(group=group, rank=rank, layout=layout,
                      schedule=tuple(build_schedule(layout, head_chunk_size)), attn=attn,
                      overlap=overlap, comm_dtype=comm_dtype)
    seq: SeqChunking | None = None
    if seq_chunk is not None:
        seq = seq_chunking(attn, seq_chunk)
    if pool is None:
        pool = BufferPool(keep_between_calls=False)
    return _HeadChunkedFn.apply(q, k, v, cfg, pool, sinks, seq)
