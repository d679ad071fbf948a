"""How heads and sequence positions are split across the ranks of a mesh.

Heads (:func:`head_layout`): the partition follows kv groups, so every query head lands on a
rank that holds the kv head it reads, and each rank's local heads form a standard GQA block.

- ``Hkv >= U``: kv heads are split as evenly as possible into contiguous ranges (the first
  ``Hkv % U`` ranks get one more) and each rank takes the query heads of its kv heads.
- ``Hkv < U``: ``U`` must be a multiple of ``Hkv``; each kv head is replicated to ``U // Hkv``
  consecutive ranks, which split its query heads as evenly as possible.

Sequence (:func:`shard_sequence` / :func:`gather_sequence`): the sequence dim is cut into
``sp = ring x ulysses`` contiguous pieces in sp-rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.mesh import axis_group, axis_rank, axis_size, check_mesh


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


def _sp_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """(sp size, this rank's sp index) of ``mesh``; ring > 1 is the hybrid issue's zigzag."""
    check_mesh(mesh)
    if axis_size(mesh, "ring") > 1:
        raise NotImplementedError("sequence sharding with ring_degree > 1 (zigzag order) is not "
                                  "implemented yet; use ring_degree=1")
    return axis_size(mesh, "ulysses"), axis_rank(mesh, "ulysses")


def padded_len(seq_len: int, mesh: DeviceMesh) -> int:
    """The smallest length >= ``seq_len`` that the mesh's sp ranks split evenly."""
    sp, _ = _sp_coords(mesh)
    return -(-seq_len // sp) * sp


def shard_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1, *, pad: bool = False,
                   pad_value: float = 0) -> Tensor:
    """This rank's contiguous piece of ``x`` along ``dim``; no communication.

    Args:
        x: the full tensor, identical on every rank of the sp group (e.g. ``[B, S, ...]``).
        mesh: from :meth:`SequenceParallelDims.build_mesh`; pieces follow the sp rank.
        dim: the sequence dim.
        pad: if the length does not divide by sp, pad the end with ``pad_value`` up to
            :func:`padded_len` instead of raising. Causal attention never lets a real token see
            the padded tail; for non-causal attention pass ``unpadded_len`` to
            ``ulysses_attention``. Give labels a pad value your loss ignores (e.g. -100).

    Returns:
        ``x.narrow(dim, rank * n, n)`` (a view) with ``n = padded length / sp``.
    """
    sp, rank = _sp_coords(mesh)
    seq_len = x.shape[dim]
    if seq_len % sp != 0:
        if not pad:
            raise ValueError(f"sequence length {seq_len} (dim {dim}) is not divisible by the "
                             f"sequence-parallel size {sp}; pad it to {padded_len(seq_len, mesh)} "
                             f"or pass pad=True")
        widths = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, padded_len(seq_len, mesh) - seq_len]
        x = torch.nn.functional.pad(x, widths, value=pad_value)
    n = x.shape[dim] // sp
    return x.narrow(dim, rank * n, n)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, rank):
        ctx.args = (dim, rank, x.shape[dim])
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        dim, rank, n = ctx.args
        # Every rank holds the same gathered tensor, so each keeps the gradient of its piece.
        return grad.narrow(dim, rank * n, n).contiguous(), None, None, None


def gather_sequence(x: Tensor, mesh: DeviceMesh, dim: int = 1, *,
                    unpadded_len: int | None = None) -> Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the pieces over the sp group.

    Args:
        x: this rank's piece; every rank's must have the same shape.
        unpadded_len: trim the result to this length (the original length before
            ``shard_sequence(..., pad=True)``).

    Returns:
        The full tensor on every rank. Autograd treats it as replicated: the backward hands
        each rank the gradient of its own piece.
    """
    sp, rank = _sp_coords(mesh)
    if unpadded_len is not None and unpadded_len > x.shape[dim] * sp:
        raise ValueError(f"unpadded_len ({unpadded_len}) exceeds the gathered length "
                         f"({x.shape[dim] * sp})")
    full = x if sp == 1 else _GatherSequence.apply(x, axis_group(mesh, "ulysses"), dim, rank)
    if unpadded_len is not None:
        full = full.narrow(dim, 0, unpadded_len)
    return full
