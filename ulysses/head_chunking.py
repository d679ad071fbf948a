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
from ulysses.kernels import attention_backward, attention_forward
from ulysses.sharding import HeadLayout

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

    With overlap, two steps' inputs are live: q, out, dout (c heads each) and k, v (ck), and
    one step's outputs: dq (c), dk, dv (ck), the dk/dv sums (ck) and the send buffers.
    """
    ck = max(1, -(-c // min(_groups(layout))))
    units = 2 * (3 * c + 2 * ck) + 2 * c + 6 * ck
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
    causal: bool
    scale: float
    backend: str
    kv_len: int | None
    """Attend to the first kv_len keys only (padding); None = all."""
    overlap: bool


def _kv_view(t: Tensor, cfg: ChunkConfig) -> Tensor:
    return t if cfg.kv_len is None else t[:, :cfg.kv_len]


def _forward(q, k, v, cfg: ChunkConfig, pool: BufferPool):
    """Returns ``out_BsHD`` and ``lse_BhS`` (fp32, this rank's h query heads)."""
    U, me = len(cfg.layout.q_sizes), cfg.rank
    B, s, _, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, cfg.layout.q_sizes[me], s * U, dtype=torch.float32, device=q.device)

    def launch(j):
        st = cfg.schedule[j]
        pq = _to_heads(q, st.q, st.q[me][1], cfg.group, pool)
        if not any(st.kv_new):
            return pq, None, None
        ranges = [kv if new else (kv[0], 0) for kv, new in zip(st.kv, st.kv_new)]
        mine = ranges[me][1]
        return (pq, _to_heads(k, ranges, mine, cfg.group, pool),
                _to_heads(v, ranges, mine, cfg.group, pool))

    kv_cur, pend_out, nxt = None, None, launch(0)
    for j, st in enumerate(cfg.schedule):
        pq, pk, pv = nxt
        nxt = launch(j + 1) if cfg.overlap and j + 1 < len(cfg.schedule) else None
        q_j = _as_BSnD(pq, (s, B, st.q[me][1], D), U)
        if pk is not None:
            if st.kv_new[me]:
                for p in kv_cur or ():
                    p.release()
                kv_cur = (pk, pv)
                kv_shape = (s, B, st.kv[me][1], D)
                k_j, v_j = _as_BSnD(pk, kv_shape, U), _as_BSnD(pv, kv_shape, U)
            else:
                pk.wait(), pv.wait(), pk.release(), pv.release()
        o_j = None
        if st.q[me][1]:
            o_j, lse_j = attention_forward(q_j, _kv_view(k_j, cfg), _kv_view(v_j, cfg),
                                           causal=cfg.causal, softmax_scale=cfg.scale,
                                           backend=cfg.backend)
            lse[:, j * st.q[me][1]:(j + 1) * st.q[me][1]] = lse_j
        pq.release()
        # The next step's exchanges ran during this compute: finishing them now returns
        # their send buffers to the pool before this step's output exchange takes new ones.
        for p in nxt or ():
            if p is not None:
                p.wait()
        if pend_out is not None:
            _scatter_into(pend_out, out, pend_out_ranges, add=False)
        if o_j is None:
            o_j = q.new_empty(B, s * U, 0, D)
        pend_out, pend_out_ranges = _to_seq(o_j, st.q, cfg.group, pool), st.q
        if not cfg.overlap:
            _scatter_into(pend_out, out, st.q, add=False)
            pend_out = None
            if j + 1 < len(cfg.schedule):
                nxt = launch(j + 1)
    if pend_out is not None:
        _scatter_into(pend_out, out, pend_out_ranges, add=False)
    for p in kv_cur or ():
        p.release()
    return out, lse


def _backward(dout, q, k, v, out, lse, cfg: ChunkConfig, pool: BufferPool):
    """Per chunk: redo the exchanges of q, k, v, out and dout, run the kernel backward with the
    saved lse, and send dq (and, once per kv chunk, the summed dk/dv) back into place."""
    U, me = len(cfg.layout.q_sizes), cfg.rank
    B, s, _, D = q.shape
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def launch(j):
        st = cfg.schedule[j]
        mine = st.q[me][1]
        pend = [_to_heads(t, st.q, mine, cfg.group, pool) for t in (q, out, dout)]
        if any(st.kv_new):
            ranges = [kv if new else (kv[0], 0) for kv, new in zip(st.kv, st.kv_new)]
            pend += [_to_heads(t, ranges, ranges[me][1], cfg.group, pool) for t in (k, v)]
        return pend

    def launch_grads(j, dq_j, dk_sum, dv_sum):
        st = cfg.schedule[j]
        sent = [(_to_seq(dq_j, st.q, cfg.group, pool), dq, st.q, False)]
        if any(st.kv_done):
            ranges = [kv if done else (kv[0], 0) for kv, done in zip(st.kv, st.kv_done)]
            sent += [(_to_seq(d, ranges, cfg.group, pool), dest, ranges, True)
                     for d, dest in ((dk_sum, dk), (dv_sum, dv))]
        return sent

    def finish(sent):
        for pending, dest, ranges, add in sent:
            _scatter_into(pending, dest, ranges, add)

    kv_cur, dkv_sum, sent, nxt = None, None, None, launch(0)
    for j, st in enumerate(cfg.schedule):
        pend = nxt
        nxt = launch(j + 1) if cfg.overlap and j + 1 < len(cfg.schedule) else None
        n = st.q[me][1]
        q_j, out_j, dout_j = (_as_BSnD(p, (s, B, n, D), U) for p in pend[:3])
        if len(pend) > 3:
            if st.kv_new[me]:
                for p in kv_cur or ():
                    p.release()
                kv_cur = tuple(pend[3:])
                kv_shape = (s, B, st.kv[me][1], D)
                k_j, v_j = (_as_BSnD(p, kv_shape, U) for p in kv_cur)
            else:
                for p in pend[3:]:
                    p.wait(), p.release()
        dq_j = q.new_empty(B, s * U, 0, D)
        if n:
            dq_j, dk_j, dv_j = attention_backward(
                dout_j, q_j, _kv_view(k_j, cfg), _kv_view(v_j, cfg), out_j,
                lse[:, j * n:(j + 1) * n].contiguous(), causal=cfg.causal,
                softmax_scale=cfg.scale, backend=cfg.backend)
            if cfg.kv_len is not None:  # keys past kv_len were not attended: zero gradient
                dk_j, dv_j = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, s * U - cfg.kv_len))
                              for t in (dk_j, dv_j))
            # Sum dk/dv over the q chunks that share this kv chunk; send once, when done.
            dkv_sum = (dk_j, dv_j) if st.kv_new[me] else (dkv_sum[0] + dk_j, dkv_sum[1] + dv_j)
        for p in pend[:3]:
            p.release()
        for p in nxt or ():  # as in _forward: free the next step's send buffers now
            p.wait()
        if sent is not None:
            finish(sent)
        empty_kv = q.new_empty(B, s * U, 0, D)
        dk_send, dv_send = dkv_sum if st.kv_done[me] else (empty_kv, empty_kv)
        sent = launch_grads(j, dq_j, dk_send, dv_send)
        if not cfg.overlap:
            finish(sent)
            sent = None
            if j + 1 < len(cfg.schedule):
                nxt = launch(j + 1)
    if sent is not None:
        finish(sent)
    for p in kv_cur or ():
        p.release()
    return dq, dk, dv


class _HeadChunkedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, pool):
        out, lse = _forward(q, k, v, cfg, pool)
        # Only seq-local tensors and the small fp32 lse are kept for backward.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.pool = cfg, pool
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg, ctx.pool)
        return dq, dk, dv, None, None


def head_chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, group, rank: int,
                           layout: HeadLayout, head_chunk_size: int, causal: bool, scale: float,
                           backend: str, kv_len: int | None = None,
                           pool: BufferPool | None = None, overlap: bool = True) -> Tensor:
    """Head-chunked Ulysses on already-validated inputs; see ``ulysses_attention``.

    Args:
        q: ``q_BsHD``; k, v: ``k_BsKD``, ``v_BsKD`` (not replicated: chunks pick kv heads).
        group, rank: the Ulysses process group and this rank's index in it.
        layout: :func:`ulysses.sharding.head_layout` of the head counts.
        head_chunk_size: local query heads per step, from :func:`valid_chunk_sizes`.
        pool: reused chunk buffers; a fresh one (this call only) when ``None``.
        overlap: exchange step j+1 while step j computes.

    Returns:
        ``out_BsHD``.
    """
    cfg = ChunkConfig(group=group, rank=rank, layout=layout,
                      schedule=tuple(build_schedule(layout, head_chunk_size)), causal=causal,
                      scale=scale, backend=backend, kv_len=kv_len, overlap=overlap)
    return _HeadChunkedFn.apply(q, k, v, cfg, pool if pool is not None else BufferPool())
