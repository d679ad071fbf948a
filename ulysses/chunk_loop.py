"""The head-chunk pipeline: one forward loop and one backward loop for every chunk source.

Per step of the schedule (:mod:`ulysses.chunk_schedule`) the forward sends the chunk's q (and,
where a rank needs a new kv chunk, k and v) seq -> head, attends, and sends the output back
head -> seq. The backward redoes the q, k, v, out exchanges, sends ``dout`` along, runs the
kernel backward with the saved lse, and sends dq (and, once per kv chunk, the summed dk/dv)
back. Nothing full-sequence is saved between forward and backward.

Callers differ only in where a chunk's tensors come from and where its gradients go, which is
a :class:`ChunkSource` (the ``op=`` of torch's ``_templated_ring_attention`` plays this part
there):

- :mod:`ulysses.head_chunking` slices the all-heads, seq-local q/k/v/dout and copies (adds,
  for dk/dv) the gradients into place;
- :mod:`ulysses.fused_attention` projects each chunk's heads from the hidden states right
  before it is sent, and runs the projection's backward when their gradient arrives.

With ``overlap`` the exchange of step j+1 is in flight while step j computes (async gloo/NCCL
work handles; NCCL runs them on its own stream). Chunk buffers come from a
:class:`ulysses.buffer_pool.BufferPool`.

Shape legend: B batch, S full sequence, s = S / U this rank's piece, H all query heads,
n the heads of one chunk on one rank, X any head count, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from ulysses import trace_shortcuts
from ulysses.all_to_all import BlockViews, PendingExchange, exchange_blocks_async
from ulysses.buffer_pool import BufferPool
from ulysses.chunk_schedule import Step
from ulysses.sharding import HeadLayout
from ulysses.sinks import apply_sinks, sinks_grad

Ranges = Sequence[tuple[int, int]]
"""Per rank of the Ulysses group, ``(first head, count)``."""


class ChunkSource(Protocol):
    """Where one head-chunked call gets each step's tensors and puts their gradients."""

    def send(self, kind: str, j: int, step: Step) -> tuple[Tensor, Ranges]:
        """What step ``j`` sends seq -> head for ``kind`` (``"q"``, ``"k"``, ``"v"`` or
        ``"dout"``): a seq-local ``[B, s, X, D]`` tensor and, per rank, ``(offset, count)``
        of the heads it gets from it. Counts are the step's: ``step.q`` for q and dout,
        ``step.kv_sent()`` for k and v."""

    def take(self, kind: str, j: int, step: Step, blocks: list[Tensor]) -> None:
        """The gradient of what step ``j`` sent for ``kind`` (``"q"``, ``"k"``, ``"v"``) is
        back: per rank r, ``blocks[r]`` is ``[B, s, n_r, D]`` for the heads ``step.q[r]``
        (q) or ``step.kv_returned()[r]`` (k, v) of this rank's piece. The buffers are reused
        once this returns."""

    def take_rows(self, kind: str, j: int, step: Step, blocks: list[Tensor],
                  rows: slice) -> None:
        """:meth:`take` for rows ``rows`` of the piece only (``blocks[r]`` is
        ``[B, len(rows), n_r, D]``), as the sequence-chunked loop (:mod:`ulysses.seq_chunk`)
        returns gradients, one block at a time."""


@dataclass(frozen=True, slots=True)
class ChunkConfig:
    group: object
    rank: int
    layout: HeadLayout
    schedule: tuple[Step, ...]
    attn: object
    """The inner attention of one chunk: ``LocalAttention`` or ``RingAttention`` (hybrid)."""
    overlap: bool
    comm_dtype: torch.dtype | None = None
    """The dtype every exchange carries (cast in, and back after receiving); None: the
    tensors' own. dk/dv sums over q chunks are kept in the wider of it and the input dtype."""


# --- exchanges ------------------------------------------------------------------------------

def to_heads(x_BsXD: Tensor, ranges: Ranges, mine: int, group, pool,
             dtype: torch.dtype | None = None) -> PendingExchange:
    """seq -> head for one chunk: rank r gets heads ``ranges[r]`` of every rank's piece.

    Blocks travel seq-first ([s, B, n, D]), so the received flat buffer is already
    ``x_SBnD`` for this rank's ``mine`` heads: the kernel reads it as a strided view.
    """
    B, s, _, D = x_BsXD.shape

    def block(r: int) -> Tensor:
        start, n = ranges[r]
        return x_BsXD[:, :, start:start + n].permute(1, 0, 2, 3)

    send = BlockViews(block, [s * B * n * D for _, n in ranges])
    return exchange_blocks_async(send, [(s, B, mine, D)] * len(ranges), group, pool=pool,
                                 dtype=dtype)


def as_BSnD(pending: PendingExchange, block_shape, num_ranks: int) -> Tensor:
    """The received U blocks of ``[s, B, n, D]`` as one ``[B, S, n, D]`` view, no copy."""
    s, B, n, D = block_shape
    return pending.wait_flat().view(num_ranks * s, B, n, D).transpose(0, 1)


def to_seq(y_BSnD: Tensor, ranges: Ranges, group, pool,
           dtype: torch.dtype | None = None) -> PendingExchange:
    """head -> seq for one chunk: send each rank its piece of ``y``; receive every rank's
    heads ``ranges[r]`` of this rank's piece."""
    B, S, _, D = y_BSnD.shape
    U = len(ranges)
    s = S // U
    send = BlockViews(lambda r: y_BSnD[:, r * s:(r + 1) * s], [B * s * y_BSnD.shape[2] * D] * U)
    return exchange_blocks_async(send, [(B, s, n, D) for _, n in ranges], group, pool=pool,
                                 dtype=dtype)


def place_blocks(dest_BsXD: Tensor, ranges: Ranges, blocks: list[Tensor], add: bool) -> None:
    """Copy (or add) rank r's received block into heads ``ranges[r]`` of ``dest``."""
    if trace_shortcuts.skip(dest_BsXD):  # in place: a memory trace sees nothing here
        return
    # a work trace places one block of each head count, weighed
    heads = {r: n for r, (_, n) in enumerate(ranges) if n}
    for r, times in trace_shortcuts.alike(heads, dest_BsXD):
        start, n = ranges[r]
        dst = dest_BsXD[:, :, start:start + n]
        with trace_shortcuts.weighted(times):
            dst.add_(blocks[r]) if add else dst.copy_(blocks[r])


def _send(src: ChunkSource, kind: str, j: int, step: Step, mine: int, cfg: ChunkConfig,
          pool) -> PendingExchange:
    """Start the seq -> head exchange of ``kind`` at step j; ``mine``: heads this rank gets.
    The source's tensor is dropped as soon as it is packed into the send buffer."""
    x_BsXD, ranges = src.send(kind, j, step)
    return to_heads(x_BsXD, ranges, mine, cfg.group, pool, cfg.comm_dtype)


def _exchange_kv(src: ChunkSource, j: int, st: Step, cfg: ChunkConfig, pool, shape, dtype):
    """Step ``st``'s kv exchange (synchronous), if any rank needs a new kv chunk.

    Returns ``(pending, (k_BSkD, v_BSkD))`` for this rank's new chunk, or None if it keeps its
    current one (or there was no exchange). The chunk comes in ``dtype``, the kernel's."""
    if st.kv_sent() is None:
        return None
    me, U, (s, B, D) = cfg.rank, len(cfg.layout.q_sizes), shape
    mine = st.kv[me][1] if st.kv_new[me] else 0
    pend = [_send(src, kind, j, st, mine, cfg, pool) for kind in ("k", "v")]
    if not st.kv_new[me]:
        for p in pend:
            p.arrive(), p.release()
        return None
    return pend, tuple(as_BSnD(p, (s, B, mine, D), U).to(dtype) for p in pend)


def _release(kv) -> None:
    for p in kv[0] if kv else ():
        p.release()


def _finish(src: ChunkSource, sent) -> None:
    """Hand every arrived head -> seq gradient exchange to the source, then free its buffers."""
    for pending, kind, j, st in sent:
        src.take(kind, j, st, pending.wait())
        pending.release()


# Buffer lifetimes (why the loops are ordered as they are). The pool keeps its high-water
# set of buffers, so what matters is what is alive at once:
# - while step j computes: its inputs, the kernel's outputs, and the next step's q (and, in
#   backward, dout) exchange, which is the part overlapped with compute;
# - kv chunks are exchanged at the step that needs them (every g / c steps), after the
#   previous chunk was released at its last use; backward fetches `out` at the step too;
# - the previous step's output/gradient exchange finishes at the top of the next step, before
#   anything new is acquired, and kernel outputs are dropped as soon as they are packed;
# - a source's tensors (a projected chunk, say) live only until they are packed.

def steps_run(steps: Sequence[Step], x: Tensor, *,
              weighed: bool = True) -> list[tuple[int, int]]:
    """``(index, times)`` of the steps a loop runs: all of them, once; in a memory or work
    trace (:func:`ulysses.trace_shortcuts.skip_repeats` of ``x``), the schedule less its
    middle periods.

    Steps differ only in which heads they take when their shapes (every rank's q and kv head
    counts, and which ranks send or return kv) repeat with a period p; the first two periods
    and the last then allocate and free all that the whole schedule does (the second shows
    a period following another), and the periods between are left out. In a work trace the
    second period's steps count for them (``times``: 1 + the periods left out): each loop
    iteration finishes the step before it and starts the next one's exchange, so a run of
    whole periods in phase does the work of as many periods, whichever step it starts at.
    ``weighed=False``: a loop that does not weigh its steps, shortened in memory traces only
    (:func:`ulysses.trace_shortcuts.skip`)."""
    n = len(steps)
    shortened = trace_shortcuts.skip_repeats(x) if weighed else trace_shortcuts.skip(x)
    if n < 4 or not shortened:
        return [(j, 1) for j in range(n)]
    shape = [(tuple(c for _, c in st.q), tuple(c for _, c in st.kv), st.kv_new, st.kv_done)
             for st in steps]
    for p in range(1, n // 3 + 1):
        if all(shape[j] == shape[j - p] for j in range(p, n)):
            tail = max(2 * p, (n - p) // p * p)  # a period's start: the run goes on in phase
            times = 1 + (tail - 2 * p) // p
            return ([(j, 1) for j in range(p)] + [(j, times) for j in range(p, 2 * p)] +
                    [(j, 1) for j in range(tail, n)])
    return [(j, 1) for j in range(n)]


def run_forward(src: ChunkSource, out: Tensor, cfg: ChunkConfig, pool: BufferPool,
                sinks: Tensor | None = None) -> Tensor:
    """Fill ``out_BsHD`` (all heads, this rank's piece) with every chunk's attention output;
    returns ``lse_BhS`` (fp32, this rank's h query heads). ``sinks`` (``[h]``, this rank's
    heads) are applied per chunk."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = out.shape
    lse = torch.empty(B, cfg.layout.q_sizes[me], s * U, dtype=torch.float32, device=out.device)

    def launch(j):
        return _send(src, "q", j, steps[j], steps[j].q[me][1], cfg, pool)

    run = steps_run(steps, out)
    order = [j for j, _ in run]
    kv, pend_out, nxt = None, None, launch(order[0])
    for i, (j, times) in enumerate(run):
        with trace_shortcuts.weighted(times):  # left-out periods' work, in a trace
            st = steps[j]
            if pend_out is not None:
                _finish_out(pend_out, out)
            kv = _exchange_kv(src, j, st, cfg, pool, (s, B, D), out.dtype) or kv
            pq, n = nxt, st.q[me][1]
            q_j = as_BSnD(pq, (s, B, n, D), U).to(out.dtype)  # waits before the next launch
            nxt = launch(order[i + 1]) if cfg.overlap and i + 1 < len(order) else None
            o_j = out.new_empty(B, s * U, 0, D)
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
                nxt.arrive()  # ran during the kernel; frees its send buffer
            pend_out = (to_seq(o_j, st.q, cfg.group, pool, cfg.comm_dtype), st.q)
            del o_j
            if not cfg.overlap:
                _finish_out(pend_out, out)
                pend_out = None
                nxt = launch(order[i + 1]) if i + 1 < len(order) else None
    if pend_out is not None:
        _finish_out(pend_out, out)
    _release(kv)
    return lse


def _finish_out(pend_out, out: Tensor) -> None:
    pending, ranges = pend_out
    place_blocks(out, ranges, pending.wait(), add=False)
    pending.release()


def run_backward(src: ChunkSource, out: Tensor, lse: Tensor, cfg: ChunkConfig,
                 pool: BufferPool, sinks: Tensor | None = None) -> Tensor | None:
    """Per chunk: redo the exchanges of q, k, v, out and dout, run the kernel backward with the
    saved lse, and hand dq (and, once per kv chunk, the summed dk/dv) back to the source.
    Returns ``dsinks`` (float32 ``[h]``) when ``sinks`` is given, else None."""
    U, me, steps = len(cfg.layout.q_sizes), cfg.rank, cfg.schedule
    B, s, _, D = out.shape
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32,
                                                    device=sinks.device)
    acc = out.dtype if cfg.comm_dtype is None else torch.promote_types(out.dtype, cfg.comm_dtype)

    def launch(j):
        st = steps[j]
        return [_send(src, kind, j, st, st.q[me][1], cfg, pool) for kind in ("q", "dout")]

    run = steps_run(steps, out)
    order = [j for j, _ in run]
    kv, dkv_sum, sent, nxt = None, None, [], launch(order[0])
    for i, (j, times) in enumerate(run):
        with trace_shortcuts.weighted(times):  # left-out periods' work, in a trace
            st = steps[j]
            _finish(src, sent)
            kv = _exchange_kv(src, j, st, cfg, pool, (s, B, D), out.dtype) or kv
            n = st.q[me][1]
            p_out = to_heads(out, st.q, n, cfg.group, pool, cfg.comm_dtype)
            out_j = as_BSnD(p_out, (s, B, n, D), U).to(out.dtype)  # waits: frees its send buffer
            pqs = nxt + [p_out]
            # waits before the next launch
            q_j, dout_j = (as_BSnD(p, (s, B, n, D), U).to(out.dtype) for p in pqs[:2])
            nxt = launch(order[i + 1]) if cfg.overlap and i + 1 < len(order) else None
            dq_j = out.new_empty(B, s * U, 0, D)
            if n:
                k_j, v_j = kv[1]
                lse_j = lse[:, j * n:(j + 1) * n].contiguous()
                dq_j, dk_j, dv_j = cfg.attn.backward(dout_j, q_j, k_j, v_j, out_j, lse_j)
                if sinks is not None:
                    dsinks[j * n:(j + 1) * n] = sinks_grad(dout_j, out_j, lse_j,
                                                           sinks[j * n:(j + 1) * n])
                del lse_j
                # Sum dk/dv over the q chunks sharing this kv chunk (in place); send once,
                # when done.
                if st.kv_new[me]:
                    dkv_sum = (dk_j.to(acc), dv_j.to(acc))
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
                p.arrive()
            sent = [(to_seq(dq_j, st.q, cfg.group, pool, cfg.comm_dtype), "q", j, st)]
            del dq_j
            ranges = st.kv_returned()
            if ranges is not None:
                empty = out.new_empty(B, s * U, 0, D)
                sends = dkv_sum if st.kv_done[me] else (empty, empty)
                sent += [(to_seq(d, ranges, cfg.group, pool, cfg.comm_dtype), kind, j, st)
                         for d, kind in zip(sends, ("k", "v"))]
                if st.kv_done[me]:
                    dkv_sum = None
                del sends
            if not cfg.overlap:
                _finish(src, sent)
                sent = []
                nxt = launch(order[i + 1]) if i + 1 < len(order) else None
    _finish(src, sent)
    _release(kv)
    return dsinks
