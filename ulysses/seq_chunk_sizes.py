"""Sizes, settings and geometry of the sequence-chunked loop (:mod:`ulysses.seq_chunk`): the
checks of ``seq_chunk``, how a piece is cut into blocks, the ``"auto"`` block count, the mask
of the attention the blocks run, where each block's rows sit in the sequence (over a ring
too) and the kernel calls between blocks. Arithmetic on shapes (no process group), identical
on every rank.

Shape legend: B batch, s this rank's piece, U Ulysses ranks, N blocks per piece, c / ck query
/ kv heads of a chunk, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses import trace_shortcuts
from ulysses.band import (Piece, WindowAttention, acc_dtype, document_pieces, mask_pieces,
                          runs_within)
from ulysses.chunk_schedule import DEFAULT_CHUNK_BUDGET_BYTES
from ulysses.host_blocks import HostBlocks
from ulysses.kernels import LocalAttention
from ulysses.ring import RingAttention
from ulysses.segments import SegmentedAttention
from ulysses.sharding import HeadLayout, ring_runs, rows_of

__all__ = ["Blocks", "SeqChunking", "block_bounds", "block_buffer_bytes", "check_seq_chunk",
           "resolve_seq_chunk", "seq_chunking"]


def check_seq_chunk(seq_chunk, *, head_chunk_size, local_len: int | None,
                    chunk_overlap: bool | None = None) -> None:
    """``ValueError`` unless ``seq_chunk`` is None, ``"auto"`` or an int in ``[1, local_len]``
    (``local_len`` None: not known yet) used with head chunking, without
    ``chunk_overlap=True``; and unless ``chunk_overlap`` is None or a bool."""
    if chunk_overlap is not None and not isinstance(chunk_overlap, bool):
        raise ValueError(f"chunk_overlap must be None, True or False, got {chunk_overlap!r}")
    if seq_chunk is None:
        return
    if chunk_overlap:
        raise ValueError("chunk_overlap=True with seq_chunk: the sequence-chunked loop does "
                         "not overlap its block exchanges with compute yet; leave "
                         "chunk_overlap unset (None) or False")
    if seq_chunk != "auto" and (isinstance(seq_chunk, bool) or not isinstance(seq_chunk, int)
                                or seq_chunk < 1):
        raise ValueError(f"seq_chunk must be None, a positive int (blocks per rank's piece) or "
                         f"'auto', got {seq_chunk!r}")
    if head_chunk_size is None:
        raise ValueError("seq_chunk needs head_chunk_size (an int or 'auto'): sequence blocks "
                         "are cut inside a head chunk")
    if seq_chunk != "auto" and local_len is not None and seq_chunk > local_len:
        raise ValueError(f"seq_chunk={seq_chunk} is more blocks than this rank's {local_len} "
                         f"rows; use at most {local_len}")


def block_bounds(local_len: int, num_blocks: int) -> tuple[tuple[int, int], ...]:
    """``(first row, rows)`` of each block of a piece, as ``torch.tensor_split`` cuts it."""
    size, extra = divmod(local_len, num_blocks)
    bounds, start = [], 0
    for t in range(num_blocks):
        n = size + (t < extra)
        bounds.append((start, n))
        start += n
    return tuple(bounds)


def block_buffer_bytes(layout: HeadLayout, c: int, num_blocks: int, batch: int, local_len: int,
                       head_dim: int, dtype: torch.dtype) -> int:
    """Estimated device bytes of the block buffers alive at the backward peak.

    Per row of the largest exchange block: q, out, dout and their send buffers, dq's
    exchange (about 5c heads in the input dtype), k and v with the next block's in flight and
    the kernels' dk, dv (6ck); the dq sum and dk/dv sums with the next block's (c + 4ck, in
    float32 for half inputs)."""
    groups = min(h // k for h, k in zip(layout.q_sizes, layout.kv_sizes))
    ck = max(1, -(-c // groups))
    rows = len(layout.q_sizes) * -(-local_len // num_blocks)
    wide = torch.empty((), dtype=acc_dtype(dtype)).element_size()
    per_head = torch.empty((), dtype=dtype).element_size()
    return batch * rows * head_dim * ((5 * c + 6 * ck) * per_head + (c + 4 * ck) * wide)


def resolve_seq_chunk(seq_chunk, layout: HeadLayout, c: int, batch: int, local_len: int,
                      head_dim: int, dtype: torch.dtype,
                      budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int | None:
    """The number of blocks: ``seq_chunk`` itself (checked by :func:`check_seq_chunk`), or
    for ``"auto"`` the fewest whose :func:`block_buffer_bytes` fit ``budget_bytes`` (one row
    per block if none does). Pure arithmetic on shapes: every rank gets the same answer."""
    if seq_chunk != "auto":
        return seq_chunk
    one_row = block_buffer_bytes(layout, c, local_len, batch, local_len, head_dim, dtype)
    rows = budget_bytes // one_row  # rows per block that fit
    return local_len if rows < 1 else min(local_len, -(-local_len // rows))


@dataclass(frozen=True, slots=True)
class SeqChunking:
    """What the sequence-chunked loop needs besides a :class:`ChunkConfig`: blocks per piece,
    and the mask of the attention between the exchanges."""

    num_blocks: int
    causal: bool
    scale: float
    backend: str
    kv_len: int | None = None
    """Keys at global positions from ``kv_len`` on are padding (non-causal only)."""
    window: int | None = None
    """A sliding window (:mod:`ulysses.band`; symmetric when not causal), or None."""
    ring: RingAttention | None = None
    """The ring (hybrid Ulysses x Ring) whose ranks' kv blocks this rank also attends to:
    its group, this rank's index, its size, the row layout (zigzag or contiguous) and the
    dtype its hops carry; None: no ring."""
    softcap: float = 0.0
    """Logit softcapping inside the softmax; 0: none."""
    starts: tuple[tuple[int, ...], ...] | None = None
    """Packed documents: per batch row, each document's first position in the full
    sequence; None: one document per row."""


def seq_chunking(attn, num_blocks: int) -> SeqChunking:
    """The :class:`SeqChunking` of ``num_blocks`` blocks for the inner attention ``attn`` of
    :func:`ulysses.attention.between_exchanges`."""
    if isinstance(attn, SegmentedAttention):
        return SeqChunking(num_blocks, attn.causal, attn.scale, attn.backend, None,
                           attn.window, softcap=attn.softcap, starts=attn.starts)
    if isinstance(attn, WindowAttention):
        return SeqChunking(num_blocks, attn.causal, attn.scale, attn.backend, attn.kv_len,
                           attn.window, softcap=attn.softcap)
    if isinstance(attn, LocalAttention):
        return SeqChunking(num_blocks, attn.causal, attn.scale, attn.backend, attn.kv_len,
                           softcap=attn.softcap)
    if isinstance(attn, RingAttention):
        return SeqChunking(num_blocks, attn.causal, attn.scale, attn.backend, attn.kv_len,
                           attn.window, ring=attn, softcap=attn.softcap, starts=attn.starts)
    raise ValueError(f"seq_chunk cannot cut the attention {type(attn).__name__}")


# --- block geometry -------------------------------------------------------------------------

def _kept(sigs: list, x: Tensor) -> list[int]:
    """Indices of a loop's iterations that run: all; in a memory trace, those that do not
    repeat the two before them, and the last (:func:`ulysses.trace_shortcuts.kept`)."""
    return [i for i in range(len(sigs)) if trace_shortcuts.kept(
        i, len(sigs), i >= 2 and sigs[i] == sigs[i - 1] == sigs[i - 2], x)]


def _largest_of_each_per_row(work: list) -> list:
    """:func:`_largest_of_each` of each batch row's pieces."""
    return [(rows, _largest_of_each(pieces)) for rows, pieces in work]


def _largest_of_each(pieces: list[Piece]) -> list[Piece]:
    """A memory trace's pieces of one block pair: the first, and of each kind and key
    length the one with the most query rows. Each piece's kernel output and merge
    temporaries are freed before the next piece runs, and it adds into the block's
    accumulators in place, so a piece allocates and frees at most what the largest of its
    kind and key length does (with U runs per block a pair has up to 2U pieces, of U query
    lengths)."""
    best: dict = {}
    for i, p in enumerate(pieces):
        best.setdefault((p.k1 - p.k0, p.kind), []).append((p.q1 - p.q0, -i))
    keep = {0} | {-max(group)[1] for group in best.values()}  # of equals, the first
    return [p for i, p in enumerate(pieces) if i in keep]


class Blocks:
    """The blocks of one call: bounds, where their rows sit in the sequence, the pieces
    between a query block of this rank and a key block of any ring rank, and which loop
    iterations run (all of them, except in a memory trace)."""

    def __init__(self, seq: SeqChunking, U: int, s: int, x: Tensor) -> None:
        self.seq, self.U, self.s = seq, U, s
        ring = seq.ring
        self.R, self.me = (1, 0) if ring is None else (ring.size, ring.rank)
        self.zigzag = ring is not None and ring.zigzag
        self.bounds = block_bounds(s, seq.num_blocks)
        N = seq.num_blocks
        cut = _largest_of_each_per_row if trace_shortcuts.skip(x) else list
        pairs = [(rho, u) for rho in self.ring_order() for u in range(N)]
        self._work = {(t, k): cut(self._cut(t, *k)) for t in range(N) for k in pairs}
        sizes = [b for _, b in self.bounds]
        self.staged = _kept(sizes, x)
        """Key blocks a loop over all of them runs; a left-out one has the shapes of the
        last kept one before it (:meth:`fill`)."""
        self.keys, sigs = {}, []
        for t in range(N):
            seen = [k for k in pairs if self._work[t, k]]
            shapes = [(sizes[k[1]], tuple((rows.start, p.q1 - p.q0, p.k1 - p.k0, p.kind)
                                          for rows, pieces in self._work[t, k]
                                          for p in pieces)) for k in seen]
            self.keys[t] = [seen[i] for i in _kept(shapes, x)]
            """``(ring rank, key block)`` pairs that query block t sees."""
            sigs.append((sizes[t], tuple(shapes[seen.index(k)] for k in self.keys[t])))
        self.queries = _kept(sigs, x)
        """Query blocks the loop runs."""

    def ring_order(self) -> list[int]:
        """This rank first, then the ring ranks in the order their blocks arrive."""
        return [(self.me - h) % self.R for h in range(self.R)]

    def rows(self, t: int) -> slice:
        a, b = self.bounds[t]
        return slice(a, a + b)

    def _position(self, rho: int, i: int) -> int:
        """The sequence position of row ``i`` of ring rank ``rho``'s ``U s`` rows (the
        mesh's whole-row layout: zigzag chunks rho and 2R-1-rho, or block rho)."""
        L = self.U * self.s
        if self.R == 1:
            return i
        if not self.zigzag:
            return rho * L + i
        c = L // 2
        return rho * c + i if i < c else (2 * self.R - 1 - rho) * c + i - c

    def segments(self, rho: int, t: int, b: int = 0) -> list[tuple[int, int, int]]:
        """Exchange block t of ring rank ``rho`` (batch row ``b``) as ``(position, length,
        row)`` runs: U runs of ``b_t`` rows, each split where a zigzag chunk ends, or, in
        the per-document layout, where a run of the row's layout ends."""
        a, b_t = self.bounds[t]
        layout = None if self.seq.ring is None else self.seq.ring.layout
        if layout is not None:
            own = ring_runs(self.R * self.U * self.s, self.R, rho, layout[b])
            return [(g, n, row + r * b_t) for r in range(self.U)
                    for g, n, row in rows_of(own, r * self.s + a, r * self.s + a + b_t)]
        c = self.U * self.s // 2
        out = []
        for r in range(self.U):
            start, row = r * self.s + a, r * b_t
            cuts = [start, start + b_t]
            if self.zigzag and start < c < start + b_t:
                cuts.insert(1, c)
            for lo, hi in zip(cuts, cuts[1:]):
                out.append((self._position(rho, lo), hi - lo, row + lo - start))
        return out

    def _cut(self, t: int, rho: int, u: int) -> list[tuple[slice, list[Piece]]]:
        """The kernel calls between query block t and key block u of ring rank ``rho``, as
        ``(batch rows, pieces)``: all rows alike, or with packed documents each row its own
        (a row whose documents do not meet there has none)."""
        seq = self.seq
        if seq.starts is not None:
            total = self.R * self.U * self.s
            work = [(slice(b, b + 1), document_pieces(self.segments(self.me, t, b),
                                                      self.segments(rho, u, b), row, total,
                                                      causal=seq.causal, window=seq.window))
                    for b, row in enumerate(seq.starts)]
            return [(rows, pieces) for rows, pieces in work if pieces]
        keys = self.segments(rho, u)
        if not seq.causal and seq.window is None:
            # padding is the sequence's tail: a suffix of each block's rows
            n = sum(length if seq.kv_len is None else min(length, max(0, seq.kv_len - pos))
                    for pos, length, _ in keys)
            return [(slice(None), [Piece(0, self.U * self.bounds[t][1], 0, n, "full")])] \
                if n else []
        if seq.kv_len is not None and not seq.causal:
            keys = runs_within(keys, 0, seq.kv_len)
        pieces = mask_pieces(self.segments(self.me, t), keys, causal=seq.causal,
                             window=seq.window)
        return [(slice(None), pieces)] if pieces else []

    def work(self, t: int, key: tuple[int, int]) -> list[tuple[slice, list[Piece]]]:
        """``(batch rows, pieces)`` of query block t against ``key`` (ring rank, block)."""
        return self._work[t, key]

    def fill(self, kept: dict, host: HostBlocks) -> list:
        """Per block, its host tensors in ``kept`` (indexed by :attr:`staged`); a block a
        memory trace left out gets new ones shaped like the block's before it, so the trace
        holds the host memory a run does."""
        out = []
        for u in range(len(self.bounds)):
            out.append(kept[u] if u in kept else [host.empty(h) for h in out[u - 1]])
        return out
