"""Head-chunked Ulysses attention ("Untied Ulysses"): c local heads at a time.

Plain Ulysses holds full-sequence q, k, v and out for all h = H/U local heads of a rank. Here
each step moves only the c heads of one chunk: all-to-all in, attend, all-to-all out. Nothing
full-sequence is saved for backward; the backward redoes the exchanges per chunk. The chunk
buffers come from a :class:`BufferPool`, and with ``overlap`` the exchange of step j+1 is in
flight while step j computes (async gloo/NCCL work handles; NCCL runs them on its own stream).

Shape legend: B batch, S full sequence, s = S / U this rank's piece, H / K all query / kv heads,
c query heads of one chunk, ck kv heads of one chunk, D head dim.

The schedule: rank r holds ``h_r`` query heads and a kv range of ``k_r`` heads (group
``g_r = h_r / k_r``), from :func:`ulysses.sharding.head_layout`. Step j gives rank r its local
query heads ``[j c, (j+1) c)`` and the kv heads those read. A kv chunk is sent once, at the
first step that needs it, and reused by the following q chunks of its group; its dk/dv are
summed over those steps and sent back once, added into the owner's slice. This also holds
replicated kv (``K < U``). Ranks with fewer heads idle in the last steps but still exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses.all_to_all import PendingExchange, exchange_blocks_async
from ulysses.buffer_pool import BufferPool
from ulysses.sharding import HeadLayout
from ulysses.sinks import apply_sinks, sinks_grad

DEFAULT_CHUNK_BUDGET_BYTES = 1 << 30
"""Byte budget that ``head_chunk_size="auto"`` fits the chunk buffers into (1 GiB)."""


@dataclass(frozen=True, slots=True)
class Step:
    q: tuple[tuple[int, int], ...]
    """Per rank: (first global q head, count) attended at this step; count 0 = idle."""
    kv: tuple[tuple[int, int], ...]
    """Per rank: (first global kv head, count) of its kv chunk at this step."""
    kv_new: tuple[bool, ...]
    """Per rank: its kv chunk must be (re)sent before this step."""
    kv_done: tuple[bool, ...]
    """Per rank: this is the last step using its kv chunk; dk/dv go back after it."""


def _groups(layout: HeadLayout) -> list[int]:
    return [h // k for h, k in zip(layout.q_sizes, layout.kv_sizes)]


def valid_chunk_sizes(layout: HeadLayout) -> list[int]:
    """Chunk sizes that divide every rank's query heads and fit its GQA groups."""
    groups = _groups(layout)
    return [c for c in range(1, max(layout.q_sizes) + 1)
            if all(h % c == 0 and (g % c == 0 or c % g == 0)
                   for h, g in zip(layout.q_sizes, groups))]


def chunk_buffer_bytes(layout: HeadLayout, c: int, batch: int, seq_len: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Estimated bytes of full-sequence chunk buffers alive at the backward peak.

    While a step's kernel runs: its inputs q, out, dout (c heads each) and k, v (ck), the next
    step's q and dout in flight (receive + send, ~3c), and the kernel's dq (c), dk, dv (ck each)
    plus the dk/dv sums (ck each): about 7c + 6ck heads of ``[B, S, D]`` (measured: 13.8 at
    c=ck=1 and 66 at c=8, ck=2 for 64 predicted).
    """
    ck = max(1, -(-c // min(_groups(layout))))
    units = 7 * c + 6 * ck
    return units * batch * seq_len * head_dim * torch.empty((), dtype=dtype).element_size()


def resolve_chunk_size(head_chunk_size, layout: HeadLayout, batch: int, seq_len: int,
                       head_dim: int, dtype: torch.dtype,
                       budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """An int chunk size from ``head_chunk_size`` (an int or ``"auto"``); ValueError if invalid.

    ``"auto"`` takes the largest valid size whose :func:`chunk_buffer_bytes` fits
    ``budget_bytes``, and the smallest valid size if none does.
    """
    valid = valid_chunk_sizes(layout)
    if head_chunk_size == "auto":
        fits = [c for c in valid
                if chunk_buffer_bytes(layout, c, batch, seq_len, head_dim, dtype) <= budget_bytes]
        return max(fits) if fits else min(valid)
    if isinstance(head_chunk_size, bool) or not isinstance(head_chunk_size, int):
        raise ValueError(f"head_chunk_size must be None, an int or 'auto', got "
                         f"{head_chunk_size!r}")
    if head_chunk_size not in valid:
        raise ValueError(f"head_chunk_size={head_chunk_size} does not divide the local query heads "
                         f"{list(layout.q_sizes)} into GQA-aligned chunks; valid values: {valid}")
    return head_chunk_size


def build_schedule(layout: HeadLayout, c: int) -> list[Step]:
    """The per-step head assignment of every rank (identical on all ranks)."""
    q_starts = [sum(layout.q_sizes[:r]) for r in range(len(layout.q_sizes))]
    groups = _groups(layout)
    num_steps = max(h // c for h in layout.q_sizes)

    def kv_at(r: int, j: int) -> tuple[int, int] | None:
        if j >= layout.q_sizes[r] // c:
            return None
        first, last = j * c // groups[r], ((j + 1) * c - 1) // groups[r]
        return layout.kv_ranges[r][0] + first, last - first + 1

    steps = []
    for j in range(num_steps):
        q, kv, new, done = [], [], [], []
        for r, h in enumerate(layout.q_sizes):
            active = j < h // c
            q.append((q_starts[r] + min(j * c, h), c if active else 0))
            cur = kv_at(r, j)
            kv.append(cur if cur is not None else (layout.kv_ranges[r][0], 0))
            new.append(cur is not None and (j == 0 or kv_at(r, j - 1) != cur))
            done.append(cur is not None and kv_at(r, j + 1) != cur)
        steps.append(Step(tuple(q), tuple(kv), tuple(new), tuple(done)))
    return steps


# --- exchanges ------------------------------------------------------------------------------

def _to_heads(x_BsHD: Tensor, ranges, mine: int, group, pool) -> PendingExchange:
    """seq -> head for one chunk: rank r gets heads ``ranges[r]`` of every rank's piece.

    Blocks travel seq-first ([s, B, n, D]), so the received flat buffer is already
    ``x_SBnD`` for this rank's ``mine`` heads: the kernel reads it as a strided view.
    """
    B, s, _, D = x_BsHD.shape
    send = [x_BsHD[:, :, start:start + n].permute(1, 0, 2, 3) for start, n in ranges]
    return exchange_blocks_async(send, [(s, B, mine, D)] * len(ranges), group, pool=pool)


def _as_BSnD(pending: PendingExchange, block_shape, num_ranks: int) -> Tensor:
    """The received U blocks of ``[s, B, n, D]`` as one ``[B, S, n, D]`` view, no copy."""
    s, B, n, D = block_shape
    return pending.wait_flat().view(num_ranks * s, B, n, D).transpose(0, 1)


def _to_seq(y_BSnD: Tensor, ranges, group, pool) -> PendingExchange:
    """head -> seq for one chunk: send each rank its piece of ``y``; receive every rank's
    heads ``ranges[r]`` of this rank's piece (the caller writes or adds them into place)."""
    B, S, _, D = y_BSnD.shape
    U = len(ranges)
    s = S // U
    send = [y_BSnD[:, r * s:(r + 1) * s] for r in range(U)]
    return exchange_blocks_async(send, [(B, s, n, D) for _, n in ranges], group, pool=pool)


def _scatter_into(pending: PendingExchange, dest_BsXD: Tensor, ranges, add: bool) -> None:
    """Finish a ``_to_seq`` exchange: copy (or add) rank r's block into heads ``ranges[r]``."""
    for (start, n), block in zip(ranges, pending.wait()):
        if n:
            dst = dest_BsXD[:, :, start:start + n]
            dst.add_(block) if add else dst.copy_(block)
    pending.release()


# --- forward / backward ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChunkConfig:
    group: object
    rank: int
    layout: HeadLayout
    schedule: tuple[Step, ...]
    attn: object
    """The inner attention of one chunk: ``LocalAttention`` or ``RingAttention`` (hybrid)."""
    overlap: bool


def _new_kv(st: Step) -> list[tuple[int, int]] | None:
    """Per rank, the kv range to send at this step (count 0 where it keeps its chunk)."""
    if not any(st.kv_new):
        return None
    return [kv if new else (kv[0], 0) for kv, new in zip(st.kv, st.kv_new)]


def _exchange_kv(k, v, st: Step, me: int, U: int, cfg, pool):
    """Step ``st``'s kv exchange (synchronous), if any rank needs a new kv chunk.

    Returns ``(pending, (k_BSkD, v_BSkD))`` for this rank's new chunk, or None if it keeps its
    current one (or there was no exchange)."""
    ranges = _new_kv(st)
    if ranges is None:
        return None
    B, s, _, D = k.shape
    pend = [_to_heads(t, ranges, ranges[me][1], cfg.group, pool) for t in (k, v)]
    if not st.kv_new[me]:
        for p in pend:
            p.wait(), p.release()
        return None
    return pend, tuple(_as_BSnD(p, (s, B, ranges[me][1], D), U) for p in pend)


def _release(kv) -> None:
    for p in kv[0] if kv else ():
        p.release()


# Buffer lifetimes (why the loops are ordered as they are). The pool keeps its high-water
# set of buffers, so what matters is what is alive at once:
# - while step j computes: its inputs, the kernel's outputs, and the next step's q (and, in
#   backward, dout) exchange, which is the part overlapped with compute;
# - kv chunks are exchanged at the step that needs them (every g / c steps), after the
#   previous chunk was released at its last use; backward fetches `out` at the step too;
# - the previous step's output/gradient exchange finishes at the top of the next step, before
#   anything new is acquired, and kernel outputs are dropped as soon as they are packed.

def _forward(q, k, v, cfg: ChunkConfig, pool: BufferPool, sinks=None):
    """Returns ``out_BsHD`` and ``lse_BhS`` (fp32, this rank's h query heads); ``sinks``
    (``[h]``, this rank's heads) are applied per chunk."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, cfg.layout.q_sizes[me], s * U, dtype=torch.float32, device=q.device)
    launch = lambda j: _to_heads(q, steps[j].q, steps[j].q[me][1], cfg.group, pool)  # noqa: E731

    kv, pend_out, nxt = None, None, launch(0)
    for j, st in enumerate(steps):
        if pend_out is not None:
            _scatter_into(*pend_out, add=False)
        kv = _exchange_kv(k, v, st, me, U, cfg, pool) or kv
        pq, n = nxt, st.q[me][1]
        q_j = _as_BSnD(pq, (s, B, n, D), U)  # waits before the next launch
        nxt = launch(j + 1) if cfg.overlap and j + 1 < len(steps) else None
        o_j = q.new_empty(B, s * U, 0, D)
        if n:
            k_j, v_j = kv[1]
            o_j, lse_j = cfg.attn.forward(q_j, k_j, v_j)
            if sinks is not None:
                o_j, lse_j = apply_sinks(o_j, lse_j, sinks[j * n:(j + 1) * n])
            lse[:, j * n:(j + 1) * n] = lse_j
            del lse_j
        del q_j
        pq.release()
        if st.kv_done[me]:
            _release(kv)
            kv = None
        if nxt is not None:
            nxt.wait()  # ran during the kernel; frees its send buffer
        pend_out = (_to_seq(o_j, st.q, cfg.group, pool), out, st.q)
        del o_j
        if not cfg.overlap:
            _scatter_into(*pend_out, add=False)
            pend_out = None
            nxt = launch(j + 1) if j + 1 < len(steps) else None
    if pend_out is not None:
        _scatter_into(*pend_out, add=False)
    _release(kv)
    return out, lse


def _backward(dout, q, k, v, out, lse, cfg: ChunkConfig, pool: BufferPool, sinks=None):
    """Per chunk: redo the exchanges of q, k, v, out and dout, run the kernel backward with the
    saved lse, and send dq (and, once per kv chunk, the summed dk/dv) back into place.
    Returns ``(dq, dk, dv, dsinks)``; ``dsinks`` (float32 ``[h]``) only when ``sinks``."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = q.shape
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32,
                                                    device=sinks.device)

    def launch(j):
        st = steps[j]
        return [_to_heads(t, st.q, st.q[me][1], cfg.group, pool) for t in (q, dout)]

    def finish(sent):
        for pending, dest, ranges, add in sent:
            _scatter_into(pending, dest, ranges, add)

    kv, dkv_sum, sent, nxt = None, None, [], launch(0)
    for j, st in enumerate(steps):
        finish(sent)
        kv = _exchange_kv(k, v, st, me, U, cfg, pool) or kv
        n = st.q[me][1]
        p_out = _to_heads(out, st.q, n, cfg.group, pool)
        out_j = _as_BSnD(p_out, (s, B, n, D), U)  # waits: frees its send buffer
        pqs = nxt + [p_out]
        q_j, dout_j = (_as_BSnD(p, (s, B, n, D), U) for p in pqs[:2])  # waits before next
        nxt = launch(j + 1) if cfg.overlap and j + 1 < len(steps) else None
        dq_j = q.new_empty(B, s * U, 0, D)
        if n:
            k_j, v_j = kv[1]
            lse_j = lse[:, j * n:(j + 1) * n].contiguous()
            dq_j, dk_j, dv_j = cfg.attn.backward(dout_j, q_j, k_j, v_j, out_j, lse_j)
            if sinks is not None:
                dsinks[j * n:(j + 1) * n] = sinks_grad(dout_j, out_j, lse_j,
                                                       sinks[j * n:(j + 1) * n])
            del lse_j
            # Sum dk/dv over the q chunks sharing this kv chunk (in place); send once, when done.
            if st.kv_new[me]:
                dkv_sum = (dk_j, dv_j)
            else:
                dkv_sum[0].add_(dk_j), dkv_sum[1].add_(dv_j)
            del dk_j, dv_j
        del q_j, out_j, dout_j
        for p in pqs:
            p.release()
        if st.kv_done[me]:
            _release(kv)
            kv = None
        for p in nxt or ():
            p.wait()
        sent = [(_to_seq(dq_j, st.q, cfg.group, pool), dq, st.q, False)]
        del dq_j
        if any(st.kv_done):
            ranges = [kv_r if done else (kv_r[0], 0) for kv_r, done in zip(st.kv, st.kv_done)]
            empty = q.new_empty(B, s * U, 0, D)
            sends = dkv_sum if st.kv_done[me] else (empty, empty)
            sent += [(_to_seq(d, ranges, cfg.group, pool), dest, ranges, True)
                     for d, dest in zip(sends, (dk, dv))]
            if st.kv_done[me]:
                dkv_sum = None
            del sends
        if not cfg.overlap:
            finish(sent)
            sent = []
            nxt = launch(j + 1) if j + 1 < len(steps) else None
    finish(sent)
    _release(kv)
    return dq, dk, dv, dsinks


class _HeadChunkedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, pool, sinks):
        out, lse = _forward(q, k, v, cfg, pool, sinks)
        pool.end_call()
        # Only seq-local tensors and the small fp32 lse are kept for backward.
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cfg, ctx.pool = cfg, pool
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg, ctx.pool,
                                       sinks)
        ctx.pool.end_call()
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, None, None, dsinks


def head_chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, group, rank: int,
                           layout: HeadLayout, head_chunk_size: int, attn,
                           pool: BufferPool | None = None, overlap: bool = True,
                           sinks: Tensor | None = None) -> Tensor:
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

    Returns:
        ``out_BsHD``.
    """
    cfg = ChunkConfig(group=group, rank=rank, layout=layout,
                      schedule=tuple(build_schedule(layout, head_chunk_size)), attn=attn,
                      overlap=overlap)
    if pool is None:
        pool = BufferPool(keep_between_calls=False)
    return _HeadChunkedFn.apply(q, k, v, cfg, pool, sinks)
