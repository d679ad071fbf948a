"""Ring attention over a process group (the mesh's ``"ring"`` axis), with zigzag balancing.

Each of the R ring ranks holds L query rows and the L keys/values at the same positions. At
step t rank r attends its queries to the kv block of rank ``(r - t) mod R`` while the next
block is already travelling (``batch_isend_irecv``, one hop along the ring). Partial results
are folded in with the log-sum-exp update, in float32. Only kv heads travel, so GQA moves
``K / H`` of what a query ring would.

The backward rotates the kv blocks again and sends a float32 dk/dv accumulator along with
them: each holder adds its contribution and passes the sum on, and after R hops it arrives
back at the block's owner. Every kernel backward uses the final (merged) ``out`` and ``lse``.

Layouts (positions of the ring-global sequence of length ``R * L``):

- contiguous: rank r holds ``[r L, (r + 1) L)``. Causal attention skips the blocks of later
  ranks, so rank R-1 does R - 1/2 blocks of work and rank 0 only 1/2.
- zigzag (causal load balancing): the sequence is cut into 2R chunks of ``c = L / 2`` and
  rank r holds chunks r and 2R-1-r. Off the diagonal, a block from an earlier rank is seen
  by all local queries through its first chunk only, and a block from a later rank is seen
  by the second local chunk only: c x 2c of work at every step, on every rank.
  :func:`ulysses.sharding.shard_sequence` produces this order.

Packed documents (``starts``): per batch row, the ring-global first position of each
document. A document may cross ring blocks and zigzag halves; at each step every document's
queries here attend its keys in the block in hand (causal, windowed or full pieces of
:mod:`ulysses.band`), row by row of the batch, and a block pair whose documents do not meet
costs no kernel call.

Per-document layout (``layout``, a mesh built with ``per_document``): each row's rows are
the runs :func:`ulysses.sharding.ring_runs` gives its documents, chunks r and 2R-1-r of every
document; the steps then go through the document path above, with those runs as the rows'
positions.

Shape legend: B batch, L this rank's rows, h / k local query / kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses import trace_shortcuts
from ulysses.all_to_all import check_comm_dtype
from ulysses.band import (Piece, acc_dtype, check_window, document_pieces, mask_pieces,
                          merge_into, piece_backward, piece_forward, runs_within)
from ulysses.kernels import (attention_with_lse, check_qkv, common_head_dim, default_scale,
                             select_backend)
from ulysses.segments import check_segments
from ulysses.self_check import verify_call
from ulysses.sharding import ring_runs, rows_of
from ulysses.softcap import check_softcap


@dataclass(frozen=True, slots=True)
class RingAttention:
    """The ring as an inner attention (same ``forward``/``backward`` as ``LocalAttention``)."""

    group: Any
    rank: int
    """This rank's index in ``group``."""
    size: int
    """R, the ring size."""
    causal: bool
    scale: float
    backend: str
    zigzag: bool = True
    """Rows are in zigzag order (chunks r and 2R-1-r); False: one contiguous block."""
    kv_len: int | None = None
    """Non-causal only: keys at ring-global positions >= kv_len are padding, never attended."""
    window: int | None = None
    """A sliding window over ring-global positions (:mod:`ulysses.band`; symmetric, ``|q - k|
    < window``, when not causal); blocks wholly outside it are skipped."""
    comm_dtype: torch.dtype | None = None
    """The dtype the hops carry (kv blocks, and the dk/dv accumulators in backward); None: the
    blocks' own (the accumulators travel in float32 for half inputs)."""
    softcap: float = 0.0
    """Logit softcapping inside the softmax; 0: none."""
    starts: tuple[tuple[int, ...], ...] | None = None
    """Packed documents: per batch row, the ring-global first position of each document
    (0 first); no query sees a key of another document. None: one document per row."""
    layout: tuple[tuple[int, ...], ...] | None = None
    """The per-document layout: per batch row, the documents its rows were cut by
    (:func:`ulysses.sharding.ring_runs`; needs ``starts``, which may cut them further).
    None: the whole-row layout ``zigzag`` says."""

    def __post_init__(self) -> None:
        if self.layout is not None and (self.starts is None or not self.zigzag):
            raise ValueError("a per-document ring layout needs the documents (starts) and the "
                             "zigzag layout")

    def forward(self, q_BLhD: Tensor, k_BLkD: Tensor, v_BLkD: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(out_BLhD, lse_BhL)`` over the whole ring-global sequence."""
        return _forward(q_BLhD, k_BLkD, v_BLkD, self)

    def backward(self, dout_BLhD: Tensor, q_BLhD: Tensor, k_BLkD: Tensor, v_BLkD: Tensor,
                 out_BLhD: Tensor, lse_BhL: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(dq, dk, dv)`` shaped like ``q, k, v``."""
        return _backward(dout_BLhD, q_BLhD, k_BLkD, v_BLkD, out_BLhD, lse_BhL, self)


def _valid_keys(cfg: RingAttention, owner: int, L: int) -> int:
    """How many keys of ``owner``'s block are real (not padding). The padding is the tail of
    the global sequence, so the real keys are always a prefix of the block, in both layouts:
    under zigzag the second chunk holds real keys only if the first is entirely real."""
    if cfg.kv_len is None or cfg.causal:
        return L
    if not cfg.zigzag:
        return min(max(cfg.kv_len - owner * L, 0), L)
    c, R = L // 2, cfg.size
    first = min(max(cfg.kv_len - owner * c, 0), c)
    second = min(max(cfg.kv_len - (2 * R - 1 - owner) * c, 0), c)
    return first + second


def _block(cfg: RingAttention, t: int, L: int) -> tuple[int, int, bool] | None:
    """Step ``t``'s kernel call as ``(first query row, number of keys, causal)``, or None when
    every (query, key) pair of the step is masked."""
    owner = (cfg.rank - t) % cfg.size
    if not cfg.causal:
        n = _valid_keys(cfg, owner, L)
        return (0, n, False) if n else None
    if t == 0:  # the diagonal block; plain causal also holds for the zigzag chunk pair
        return 0, L, True
    if cfg.zigzag:
        # Earlier owner: everything here sees its first chunk only. Later owner: only the
        # second local chunk (positions past both of its chunks) sees it, whole.
        return (0, L // 2, False) if owner < cfg.rank else (L // 2, L, False)
    return (0, L, False) if owner < cfg.rank else None


def _segments(cfg: RingAttention, owner: int, L: int, b: int = 0):
    """``owner``'s rows (of batch row ``b``) as ``(first ring-global position, length, first
    row)`` runs."""
    if cfg.layout is not None:
        return rows_of(ring_runs(cfg.size * L, cfg.size, owner, cfg.layout[b]), 0, L)
    if cfg.zigzag:
        c = L // 2
        return [(owner * c, c, 0), ((2 * cfg.size - 1 - owner) * c, c, c)]
    return [(owner * L, L, 0)]


def _pieces(cfg: RingAttention, t: int, L: int) -> list[Piece]:
    """Step ``t``'s kernel calls: one (or none) as :func:`_block` says, or, under a window,
    the pieces of the band between this rank's rows and the block owner's (none when the
    block is wholly outside the window)."""
    if cfg.window is not None:
        owner = (cfg.rank - t) % cfg.size
        keys = _segments(cfg, owner, L)
        if cfg.kv_len is not None and not cfg.causal:  # padding: the sequence's tail
            keys = runs_within(keys, 0, cfg.kv_len)
        return mask_pieces(_segments(cfg, cfg.rank, L), keys, causal=cfg.causal,
                           window=cfg.window)
    blk = _block(cfg, t, L)
    if blk is None:
        return []
    q0, nk, causal = blk
    return [Piece(q0, L, 0, nk, "causal" if causal else "full")]


def _document_pieces(cfg: RingAttention, t: int, L: int, b: int) -> list[Piece]:
    """Step ``t``'s kernel calls for batch row ``b`` of packed documents: per document, its
    queries here against its keys in the block in hand. A document may cross ring blocks and
    zigzag halves; documents that do not meet in this block pair give no call."""
    owner = (cfg.rank - t) % cfg.size
    return document_pieces(_segments(cfg, cfg.rank, L, b), _segments(cfg, owner, L, b),
                           cfg.starts[b], cfg.size * L, causal=cfg.causal, window=cfg.window)


def _work(cfg: RingAttention, t: int, L: int) -> list[tuple[slice, list[Piece]]]:
    """Step ``t``'s kernel calls as ``(batch rows, pieces)``: all rows alike, or, with packed
    documents, each row its own."""
    if cfg.starts is None:
        return [(slice(None), _pieces(cfg, t, L))]
    found = [(slice(b, b + 1), _document_pieces(cfg, t, L, b)) for b in range(len(cfg.starts))]
    return [(rows, pieces) for rows, pieces in found if pieces]


class Hop:
    """One ring hop in flight: tensors sent to the next rank, buffers filled by the previous."""

    def __init__(self, tensors: tuple[Tensor, ...], recv: tuple[Tensor, ...] | None,
                 cfg: RingAttention, dtype: torch.dtype) -> None:
        # gloo and NCCL need contiguous buffers; the send copies stay referenced until wait().
        # ``dtype`` travels: the sent tensors are cast to it, received ones arrive in it.
        self._sent = tuple(t.to(dtype).contiguous() for t in tensors)
        self.recv = recv or tuple(torch.empty(t.shape, dtype=dtype, device=t.device)
                                  for t in tensors)
        nxt = dist.get_global_rank(cfg.group, (cfg.rank + 1) % cfg.size)
        prv = dist.get_global_rank(cfg.group, (cfg.rank - 1) % cfg.size)
        ops = [dist.P2POp(dist.isend, t, nxt, cfg.group) for t in self._sent]
        ops += [dist.P2POp(dist.irecv, r, prv, cfg.group) for r in self.recv]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[Tensor, ...]:
        for w in self._works:
            w.wait()
        self._sent = self._works = ()  # a finished work may still hold its tensors
        return self.recv


def _hops_run(cfg: RingAttention, L: int, x: Tensor) -> list[tuple[int, int]]:
    """``(step, times)`` of the ring steps a loop runs: all, once; in a memory or work trace
    (:func:`ulysses.trace_shortcuts.repeats` of ``x``), a step whose kernel calls have the
    shapes of the two before it is left out unless it is the last, as it allocates and frees
    what they did, and the step run before it counts its work. Hops 0 to 3 always run: the
    first hops allocate the receive buffers that later hops reuse."""
    if not trace_shortcuts.skip_repeats(x):
        return [(t, 1) for t in range(cfg.size)]
    shapes = [tuple((rows.start, p.q1 - p.q0, p.k1 - p.k0, p.kind)
                    for rows, pieces in _work(cfg, t, L) for p in pieces)
              for t in range(cfg.size)]
    return trace_shortcuts.repeats(
        cfg.size, lambda t: t >= 4 and shapes[t] == shapes[t - 1] == shapes[t - 2], x)


def _forward(q, k, v, cfg: RingAttention) -> tuple[Tensor, Tensor]:
    B, L, h, D = q.shape
    # The running result: float32 for half inputs; lse -inf until a row has seen a key.
    out = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    lse = torch.full((B, h, L), float("-inf"), dtype=torch.float32, device=q.device)
    comm = k.dtype if cfg.comm_dtype is None else cfg.comm_dtype
    cur, spare = (k, v), None
    for t, times in _hops_run(cfg, L, q):
        with trace_shortcuts.weighted(times):  # left-out repeats' work, in a trace
            hop = Hop(cur, spare, cfg, comm) if t + 1 < cfg.size else None
            for rows, pieces in _work(cfg, t, L):
                for p in pieces:
                    out_b, lse_b = piece_forward(q[rows], cur[0][rows], cur[1][rows], p,
                                                 scale=cfg.scale, backend=cfg.backend,
                                                 softcap=cfg.softcap)
                    merge_into(out[rows, p.q0:p.q1], lse[rows, :, p.q0:p.q1], out_b, lse_b)
                    del out_b, lse_b
            if hop is not None:
                # The block just used becomes the next receive buffer (never the caller's k, v);
                # with a comm dtype other than k's, blocks in hand are cast copies instead.
                spare = cur if t > 0 and comm == k.dtype else None
                cur = tuple(b.to(k.dtype) for b in hop.wait())
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, cfg: RingAttention) -> tuple[Tensor, Tensor, Tensor]:
    L = q.shape[1]
    acc = acc_dtype(q.dtype)
    comm, comm_acc = ((k.dtype, acc) if cfg.comm_dtype is None else
                      (cfg.comm_dtype, cfg.comm_dtype))
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur, spare, dkv_hop = (k, v), None, None
    for t, times in _hops_run(cfg, L, q):
        with trace_shortcuts.weighted(times):  # left-out repeats' work, in a trace
            hop = Hop(cur, spare, cfg, comm) if t + 1 < cfg.size else None
            # The partial dk/dv of the block in hand: fresh at step 0, else what the previous
            # holder passed on (it travelled one hop behind the block itself).
            if dkv_hop is None:
                dkv = tuple(torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
            else:
                dkv = tuple(d.to(acc) for d in dkv_hop.wait())
            for rows, pieces in _work(cfg, t, L):
                for p in pieces:
                    dq_b, dk_b, dv_b = piece_backward(dout[rows], q[rows], cur[0][rows],
                                                      cur[1][rows], out[rows], lse[rows], p,
                                                      scale=cfg.scale, backend=cfg.backend,
                                                      softcap=cfg.softcap)
                    dq[rows, p.q0:p.q1] += dq_b
                    dkv[0][rows, p.k0:p.k1] += dk_b
                    dkv[1][rows, p.k0:p.k1] += dv_b
                    del dq_b, dk_b, dv_b
            dkv_hop = Hop(dkv, None, cfg, comm_acc)  # after the last step: at the block's owner
            del dkv
            if hop is not None:
                spare = cur if t > 0 and comm == k.dtype else None
                cur = tuple(b.to(k.dtype) for b in hop.wait())
    # The blocks in hand are dropped, and each fp32 sum as soon as it is cast, so the casts
    # never hold all three sums and their copies at once.
    del cur, spare, hop
    dq_out = dq.to(q.dtype)
    del dq
    dk, dv = dkv_hop.wait()
    del dkv_hop
    dk_out = dk.to(k.dtype)
    del dk
    return dq_out, dk_out, dv.to(v.dtype)


def check_ring_rows(rows: int, size: int, zigzag: bool) -> None:
    """Raise ``ValueError`` unless ``rows`` per ring rank fit the layout."""
    if zigzag and size > 1 and rows % 2 != 0:
        raise ValueError(f"zigzag ring attention needs an even number of rows per ring rank "
                         f"(two chunks), got {rows}; shard with shard_sequence(..., pad=True) "
                         f"so the sequence divides by 2 * ring_degree * ulysses_degree")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, causal: bool,
                   softmax_scale: float | None = None, zigzag: bool = True,
                   backend: str | None = None, window: int | None = None,
                   comm_dtype: torch.dtype | None = None,
                   softcap: float | None = None, segments=None,
                   per_document: bool = False, self_check: bool = True) -> Tensor:
    """Ring attention over ``group``, shaped like ``flash_attn_func``.

    Args:
        q: ``q_BLHD``, this rank's rows of the sequence; with ``zigzag`` they are chunks r and
            2R-1-r of 2R (as ``shard_sequence`` cuts them on a mesh with ``ulysses=1``),
            otherwise block r of R.
        k, v: ``k_BLKD``, ``v_BLKD`` at the same positions; ``H % K == 0``.
        group: the ring's process group (e.g. the mesh's ``"ring"`` axis).
        causal: causal mask over the ring-global sequence.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        zigzag: the row layout, which must match how the sequence was sharded.
        backend: attention kernel name (see :mod:`ulysses.kernels`), or ``None``.
        window: a sliding window over the ring-global sequence: causal, the keys a query
            sees, itself included; non-causal, ``|q - k| < window``. Blocks wholly outside
            it are skipped.
        comm_dtype: the dtype the hops carry: kv blocks, and the dk/dv partial sums (summed in
            float32 for half inputs, rounded to it for each hop); None: the inputs' dtype for
            kv, float32 partial sums for half inputs.
        softcap: attention logit softcapping inside the softmax (None or 0: none).
        segments: packed documents: per batch row, the start offsets of its documents in the
            ring-global sequence (beginning with 0); no token attends across a boundary.
            Documents may cross ring blocks and zigzag halves.
        per_document: the rows were cut document by document (``shard_sequence(...,
            segments=)`` on a mesh built with ``per_document=True``): chunks r and 2R-1-r of
            every document of ``segments``. Needs ``segments`` and ``zigzag``.
        self_check: check the kernel against the float64 reference at its first use with
            this device, dtype and mask (:mod:`ulysses.self_check`).

    Returns:
        ``out_BLHD``, sharded like ``q``.
    """
    check_qkv(q, k, v, causal=causal)
    softcap = check_softcap(softcap)
    window = check_window(window, causal)
    check_comm_dtype(comm_dtype)
    size = dist.get_world_size(group)
    check_ring_rows(q.shape[1], size, zigzag)
    starts = None if segments is None else check_segments(segments, q.shape[0],
                                                          size * q.shape[1])
    if per_document and (starts is None or not zigzag):
        raise ValueError("per_document=True needs segments (the documents the rows were cut "
                         "by) and zigzag=True")
    scale = default_scale(q.shape[-1], softmax_scale)
    q, k, v, value_dim = common_head_dim(q, k, v)  # MLA's v head dim: padded, sliced off
    attn = RingAttention(group=group, rank=dist.get_rank(group), size=size, causal=causal,
                         scale=scale,
                         backend=select_backend(q.device, q.dtype, q.shape[-1], backend),
                         zigzag=zigzag, window=window, comm_dtype=comm_dtype, softcap=softcap,
                         starts=starts, layout=starts if per_document and size > 1 else None)
    if self_check:
        verify_call(attn.backend, q, causal=causal, window=window, sinks=False, ring=size > 1,
                    softcap=softcap)
    out, _ = attention_with_lse(q, k, v, attn)
    return out[..., :value_dim]
