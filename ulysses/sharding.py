"""How heads and sequence positions are split across the ranks of a mesh.

Heads (:func:`head_layout`): the partition follows kv groups, so every query head lands on a
rank that holds the kv head it reads, and each rank's local heads form a standard GQA block.

- ``Hkv >= U``: kv heads are split as evenly as possible into contiguous ranges (the first
  ``Hkv % U`` ranks get one more) and each rank takes the query heads of its kv heads.
- ``Hkv < U``: ``U`` must be a multiple of ``Hkv``; each kv head is replicated to ``U // Hkv``
  consecutive ranks, which split its query heads as evenly as possible.

Sequence (:func:`shard_sequence` / :func:`gather_sequence`): the sequence dim is cut into
``sp = ring x ulysses`` pieces in sp-rank order (``ring_rank * ulysses + ulysses_rank``).
Without a ring they are contiguous. With ring R > 1 the mesh's layout
(:attr:`SequenceParallelDims.zigzag`, default on) is zigzag: 2R chunks, ring rank r owning
chunks r and 2R-1-r, so that causal attention costs every ring rank the same.
A Ulysses group's all-to-all then reassembles exactly its ring rank's chunk pair.

With packed documents the whole-row zigzag balances the work of the documents only on
average (a long document in one rank's chunks costs that rank the most). A mesh built with
:attr:`SequenceParallelDims.per_document` cuts each *document* into 2R chunks instead, ring
rank r taking chunks r and 2R-1-r of every document (:func:`ring_runs`), so every document
costs every ring rank the same. The cut then depends on the documents: ``shard_sequence``,
``gather_sequence`` and the attention take them (``segments=``). A row that is one document
is cut exactly as by the whole-row zigzag.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.mesh import axis_group, axis_rank, axis_size, mesh_dims
from ulysses.segments import check_segments


def _split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous pieces; the first ``n % parts`` get one more."""
    return [n // parts + (i < n % parts) for i in range(parts)]


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """Which query and kv heads each rank of a Ulysses group attends over."""

    q_sizes: tuple[int, ...]
    """Query heads per rank; rank r holds the contiguous range after ``sum(q_sizes[:r])``."""
    kv_ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` of the kv heads rank r needs; ranges overlap when kv is replicated."""
    num_kv_heads: int

    @property
    def kv_sizes(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.kv_ranges)

    @property
    def replicated(self) -> bool:
        return sum(self.kv_sizes) != self.num_kv_heads

    def kv_index(self) -> list[int]:
        """kv head ids in send order: rank 0's range, then rank 1's, ... (with repeats)."""
        return [h for start, end in self.kv_ranges for h in range(start, end)]


def valid_degrees(num_q_heads: int, num_kv_heads: int) -> list[int]:
    """The Ulysses degrees that :func:`head_layout` accepts for these head counts."""
    return [d for d in range(1, num_q_heads + 1) if d <= num_kv_heads or d % num_kv_heads == 0]


def head_layout(num_q_heads: int, num_kv_heads: int, degree: int) -> HeadLayout:
    """Split ``num_q_heads``/``num_kv_heads`` over ``degree`` Ulysses ranks; see module doc.

    Raises ``ValueError`` (naming the numbers and what would work) when no rank-local GQA
    block exists: kv heads that do not divide query heads, fewer query heads than ranks, or
    fewer kv heads than ranks without ``degree % num_kv_heads == 0``.
    """
    H, K, U = num_q_heads, num_kv_heads, degree
    if K < 1 or H % K != 0:
        raise ValueError(f"num_q_heads ({H}) must be a positive multiple of num_kv_heads ({K})")
    if H < U:
        raise ValueError(f"num_q_heads ({H}) is smaller than ulysses_degree ({U}), so some rank "
                         f"would get no head; use ulysses_degree <= {H} (add ring_degree for "
                         f"more sequence parallelism)")
    group = H // K
    if K >= U:
        kv_sizes = _split_evenly(K, U)
        q_sizes = [n * group for n in kv_sizes]
        starts = [sum(kv_sizes[:r]) for r in range(U)]
        kv_ranges = [(s, s + n) for s, n in zip(starts, kv_sizes)]
    else:
        if U % K != 0:
            raise ValueError(f"num_kv_heads ({K}) is smaller than ulysses_degree ({U}) and does "
                             f"not divide it, so kv heads cannot be replicated evenly; use a "
                             f"ulysses_degree from {valid_degrees(H, K)}")
        per_kv = U // K  # ranks sharing one kv head
        q_sizes = _split_evenly(group, per_kv) * K
        kv_ranges = [(r // per_kv, r // per_kv + 1) for r in range(U)]
    return HeadLayout(q_sizes=tuple(q_sizes), kv_ranges=tuple(kv_ranges), num_kv_heads=K)


@functools.lru_cache(maxsize=1024)
def ring_runs(total: int, ring: int, rank: int, documents: tuple[int, ...]
              ) -> tuple[tuple[int, int], ...]:
    """The per-document zigzag layout: ring rank ``rank``'s rows as ``(first position,
    length)`` runs of the sequence, in row order.

    Each document ``[a, e)`` of ``documents`` (first positions, 0 first; the last ends at
    ``total``) is cut into 2R chunks of ``(e - a) // 2R`` positions, and ring rank r takes
    chunks r and 2R-1-r of every document, documents in order. The ``(e - a) % 2R`` positions
    left over lengthen chunks by one, given to the ring ranks in turn (a counter that runs
    on across the documents of the row: rank ``counter % R``, its first chunk of the
    document, then its second), so with ``total`` a multiple of 2R every ring rank holds
    ``total / R`` rows. Runs that touch are merged. One document (``(0,)``) is the whole-row
    zigzag: chunks r and 2R-1-r of ``total / 2R``."""
    runs: list[tuple[int, int]] = []
    turn = 0
    for a, e in zip(documents, documents[1:] + (total,)):
        base, extra = divmod(e - a, 2 * ring)
        sizes, given = [base] * (2 * ring), [0] * ring
        for _ in range(extra):
            r = turn % ring
            turn += 1
            sizes[r if given[r] == 0 else 2 * ring - 1 - r] += 1
            given[r] += 1
        for m in (rank, 2 * ring - 1 - rank):
            start, n = a + sum(sizes[:m]), sizes[m]
            if n == 0:
                continue
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((start, n))
    return tuple(runs)


def rows_of(runs, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Rows ``[lo, hi)`` of a rank whose rows are ``runs`` (``(first position, length)`` in
    row order), as ``(first position, length, row - lo)`` runs."""
    out, row = [], 0
    for g, n in runs:
        a, b = max(lo, row), min(hi, row + n)
        if a < b:
            out.append((g + a - row, b - a, a - lo))
        row += n
    return out


def _with_padding(row: tuple[int, ...], seq_len: int, total: int) -> tuple[int, ...]:
    """A row's documents over the padded length ``total``: the padded tail ``[seq_len,
    total)`` is a document of its own."""
    return row + (seq_len,) if seq_len < total else row


@dataclass(frozen=True, slots=True)
class _SeqSplit:
    """How a mesh cuts the sequence: ``sp = ring * ulysses`` pieces; sp index
    ``ring_rank * ulysses + ulysses_rank``."""

    ring: int
    ulysses: int
    zigzag: bool
    per_document: bool = False

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    def runs(self, seq_len: int, sp_rank: int,
             documents: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """The ``(start, length)`` runs of global positions that sp rank ``sp_rank`` holds,
        in order. Zigzag: ring rank r owns chunks r and 2R-1-r of 2R (concatenated), and its
        Ulysses ranks split that pair evenly, so a piece spans at most both chunks. Per
        document (``documents``: one row's first positions): ring rank r owns
        :func:`ring_runs`, split evenly among its Ulysses ranks."""
        n = seq_len // self.sp
        if self.per_document and documents is not None and self.ring > 1:
            r, u = divmod(sp_rank, self.ulysses)
            own = ring_runs(seq_len, self.ring, r, tuple(documents))
            return [(g, k) for g, k, _ in rows_of(own, u * n, (u + 1) * n)]
        if not self.zigzag:
            return [(sp_rank * n, n)]
        c, R = seq_len // (2 * self.ring), self.ring
        r, lo = divmod(sp_rank * n, 2 * c)  # ring rank, offset into its chunk pair
        chunk_starts = (r * c, (2 * R - 1 - r) * c)
        runs = []
        for i, start in enumerate(chunk_starts):
            a, b = max(lo, i * c), min(lo + n, (i + 1) * c)
            if a < b:
                runs.append((start + a - i * c, b - a))
        return runs

    def chunk_offsets(self, seq_len: int) -> list[int]:
        """Zigzag only: where each of the 2R global chunks sits in the sp-ordered gather."""
        c, R = seq_len // (2 * self.ring), self.ring
        return [(m if m < R else 2 * R - 1 - m) * 2 * c + (0 if m < R else c)
                for m in range(2 * R)]


def seq_split(mesh: DeviceMesh) -> _SeqSplit:
    dims = mesh_dims(mesh)
    return _SeqSplit(ring=dims.ring_degree, ulysses=dims.ulysses_degree, zigzag=dims.zigzag_ring,
                     per_document=dims.per_document_ring)


def _documents(segments, x: Tensor, dim: int, mesh: DeviceMesh, seq_len: int,
               total: int) -> tuple[tuple[int, ...], ...] | None:
    """Checked ``segments`` of ``shard_sequence``/``gather_sequence`` over the padded length
    ``total`` (None when not given), or ``ValueError`` before any collective."""
    if segments is None:
        return None
    if not mesh_dims(mesh).per_document:
        raise ValueError("segments= cuts a sequence by its documents, which only a mesh built "
                         "with SequenceParallelDims(..., per_document=True) does; drop it or "
                         "build the mesh so")
    if x.dim() < 2 or dim % x.dim() != 1:
        raise ValueError(f"segments= needs the batch in dim 0 and the sequence in dim 1, got "
                         f"dim {dim} of a {x.dim()}-D tensor")
    rows = check_segments(segments, x.shape[0], seq_len)
    return tuple(_with_padding(row, seq_len, total) for row in rows)


def held_positions(split: _SeqSplit, total: int, sp_rank: int, documents) -> Tensor:
    """``[B, total / sp]``: per row, the positions sp rank ``sp_rank`` holds, in row order."""
    return torch.stack([torch.cat([torch.arange(g, g + n) for g, n in
                                   split.runs(total, sp_rank, row)]) for row in documents])


def _take(x: Tensor, index_Bn: Tensor) -> Tensor:
    """``x[b, index[b, j], ...]`` for every row b (dim 1 of ``x``)."""
    index = index_Bn.to(x.device).reshape(index_Bn.shape + (1,) * (x.dim() - 2))
    return x.gather(1, index.expand(index_Bn.shape + x.shape[2:]))


def sp_rank_of(mesh: DeviceMesh) -> int:
    return axis_rank(mesh, "ring") * axis_size(mesh, "ulysses") + axis_rank(mesh, "ulysses")


def padded_len(seq_len: int, mesh: DeviceMesh) -> int:
    """The smallest length >= ``seq_len`` that the mesh's sp ranks split evenly: a multiple of
    its :attr:`SequenceParallelDims.seq_len_divisor`."""
    m = mesh_dims(mesh).seq_len_divisor
    return -(-seq_len // m) * m


def shard_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1, *, pad: bool = False,
                   pad_value: float = 0, segments=None) -> Tensor:
    """This rank's piece of ``x`` along ``dim``; no communication.

    Args:
        x: the full tensor, identical on every rank of the sp group: ``[B, S, ...]`` inputs,
            labels and ``position_ids`` alike (they must be sharded the same way).
        mesh: from :meth:`SequenceParallelDims.build_mesh`; pieces follow the sp index
            ``ring_rank * ulysses + ulysses_rank``, in the mesh's sequence layout (with a
            ring, zigzag unless built with ``zigzag=False``: ring rank r gets chunks r and
            2R-1-r of 2R, split among its Ulysses ranks).
        dim: the sequence dim.
        pad: if the length does not split evenly, pad the end with ``pad_value`` up to
            :func:`padded_len` instead of raising. Causal attention never lets a real token see
            the padded tail; for non-causal attention pass ``unpadded_len`` to
            ``ulysses_attention``. Give labels a pad value your loss ignores (e.g. -100).
        segments: a mesh built with ``per_document=True`` only: per batch row (dim 0), the
            first positions of its packed documents (0 first), which the cut follows
            (:func:`ring_runs`); the padded tail is a document of its own. Pass the same to
            the attention and to :func:`gather_sequence`. Needs ``dim=1``.

    Returns:
        ``[..., S / sp, ...]``: a view when the piece is one run of positions (always without
        zigzag), else the concatenation of its two runs.
    """
    split = seq_split(mesh)
    multiple = mesh_dims(mesh).seq_len_divisor
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D tensor of shape "
                         f"{tuple(x.shape)}")
    seq_len = x.shape[dim]
    if seq_len % multiple != 0:
        if not pad:
            layout = "2 * ring * ulysses" if split.zigzag else "ring * ulysses"
            raise ValueError(f"sequence length {seq_len} (dim {dim}) is not divisible by "
                             f"{layout} = {multiple}; pad it to "
                             f"{padded_len(seq_len, mesh)} or pass pad=True")
        widths = [0, 0] * (x.dim() - dim % x.dim() - 1)
        widths += [0, padded_len(seq_len, mesh) - seq_len]
        x = torch.nn.functional.pad(x, widths, value=pad_value)
    documents = _documents(segments, x, dim, mesh, seq_len, x.shape[dim])
    if documents is not None:
        return _take(x, held_positions(split, x.shape[1], sp_rank_of(mesh), documents))
    pieces = [x.narrow(dim, start, n) for start, n in split.runs(x.shape[dim], sp_rank_of(mesh))]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, rank):
        ctx.args = (group, dim, rank, x.shape[dim])
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim, rank, n = ctx.args
        # Every rank's piece is in every rank's result, and each rank may use its copy
        # differently: a piece's gradient is the sum of all the copies' (torch.distributed.nn's
        # all_gather does the same). All-reduced whole, then cut: gloo has no reduce-scatter.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad.narrow(dim, rank * n, n).contiguous(), None, None, None


def gather_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1, *,
                    unpadded_len: int | None = None, segments=None) -> Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the pieces over the sp group and undo the
    zigzag order.

    Args:
        x: this rank's piece; every rank's must have the same shape.
        unpadded_len: trim the result to this length (the original length before
            ``shard_sequence(..., pad=True)``).
        segments: the documents the pieces were cut by (``shard_sequence(..., segments=)``,
            a ``per_document`` mesh only), over the unpadded length when ``unpadded_len`` is
            given.

    Returns:
        The full tensor, in natural order, on every rank. Its backward is the all-gather's
        (a collective: every rank of the sp group must backpropagate through it): each rank's
        piece gets the sum over the ranks of the gradients of their copies, as
        ``torch.distributed.nn.functional.all_gather`` gives. A loss that every rank computes
        alike on the gathered tensor thus gets sp times its gradient on each piece, which a
        reduction that averages over the sp ranks (DDP, FSDP2) divides back out.
    """
    split = seq_split(mesh)
    multiple = mesh_dims(mesh).seq_len_divisor
    total = x.shape[dim] * split.sp
    if unpadded_len is not None and unpadded_len > total:
        raise ValueError(f"unpadded_len ({unpadded_len}) exceeds the gathered length ({total})")
    if split.zigzag and total % multiple != 0:
        raise ValueError(f"piece length {x.shape[dim]} cannot come from a zigzag shard_sequence "
                         f"(the gathered length {total} must divide by {multiple})")
    documents = _documents(segments, x, dim, mesh, unpadded_len or total, total)
    full = x
    if split.sp > 1:
        full = _GatherSequence.apply(x, axis_group(mesh, "sp"), dim, sp_rank_of(mesh))
    if documents is not None:
        # sp order is ring rank 0's rows, then ring rank 1's, ...: put each row's positions
        # back in order.
        held = torch.cat([held_positions(split, total, r, documents) for r in range(split.sp)], 1)
        full = _take(full, held.argsort(dim=1))
    elif split.zigzag:
        # sp order holds ring rank r's chunk pair (r, 2R-1-r) at [2rc, 2(r+1)c); put the 2R
        # chunks back in position order.
        c = total // (2 * split.ring)
        full = torch.cat([full.narrow(dim, off, c) for off in split.chunk_offsets(total)], dim)
    if unpadded_len is not None:
        full = full.narrow(dim, 0, unpadded_len)
    return full
