"""Packed documents in a few kernel calls, not one per document.

A causal convolution or a recurrence run on one document alone must not see the others. A
loop of one call per document does that, at one kernel launch (and, for transformers' torch
fallbacks, one Python pass) per document: a row of a few hundred short documents becomes
hundreds of calls. Causality gives the same result in one call per *length group*: the
documents stacked as rows, each zero-padded on the right to the group's longest. Padding
after a document's end cannot reach its positions, and its outputs there are dropped.

Groups hold lengths within a factor of two of each other (the padding at most doubles the
work), so a row costs at most ``log2`` of its longest document in calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

Span = tuple[int, int, int]
"""``(row, start, end)``: positions ``[start, end)`` of one row."""


def length_groups(spans: Sequence[Span]) -> list[list[int]]:
    """Indices of ``spans`` grouped by length, each group's longest at most twice its
    shortest, shortest first."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][2] - spans[i][1])
    groups: list[list[int]] = []
    for i in order:
        n = spans[i][2] - spans[i][1]
        if groups and n <= 2 * (spans[groups[-1][0]][2] - spans[groups[-1][0]][1]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _stacked(t: Tensor, spans: Sequence[Span], dim: int, length: int) -> Tensor:
    parts = []
    for row, a, e in spans:
        part = t[row:row + 1].narrow(dim, a, e - a)
        if e - a < length:
            shape = list(part.shape)
            shape[dim] = length - (e - a)
            part = torch.cat([part, part.new_zeros(shape)], dim=dim)
        parts.append(part)
    return torch.cat(parts, dim=0)


def batched(fn: Callable[..., Tensor], inputs: Mapping[str, Tensor], spans: Sequence[Span],
            dim: int = 1, whole: Mapping[str, object] | None = None) -> list[Tensor]:
    """``fn(**stacked, **whole)`` on every span of ``inputs`` (tensors ``[B, ..., S, ...]``
    whose sequence dim is ``dim``), one call per :func:`length_groups` group; per span, in
    span order, its output ``[1, ..., e - start, ...]`` (``fn`` keeps the sequence in ``dim``
    and the rows in dim 0)."""
    outs: list[Tensor | None] = [None] * len(spans)
    for group in length_groups(spans):
        chosen = [spans[i] for i in group]
        length = max(e - a for _, a, e in chosen)
        stacked = {n: _stacked(t, chosen, dim, length) for n, t in inputs.items()}
        result = fn(**stacked, **(whole or {}))
        for k, (i, (_, a, e)) in enumerate(zip(group, chosen)):
            outs[i] = result[k:k + 1].narrow(dim, 0, e - a)
    return outs


__all__ = ["Span", "batched", "length_groups"]
