"""A block's input norm inside the fused attention: ``norm(x)`` for the rows asked, never
whole.

A decoder layer runs ``attn(norm1(x))``. With the projections fused
(:mod:`ulysses.fused_attention`), the fused block still saved its input ``norm1(x)`` for the
backward: one hidden-sized tensor beside the layer input ``x``, which the layer keeps anyway
(the checkpointed input, the residual's). At the backward's peak of a long sequence that is
one ``[s, E]`` tensor of the few the step holds (Qwen3.5-9B at 1.31M tokens per rank: 10 GiB
of about 75). Given the norm (:class:`InputNorm`), the fused block takes ``x`` itself and
norms the rows each projection reads, a tile at a time (:class:`NormedRows`): the norm is a
row-wise function, so every tile equals the same rows of ``norm1(x)`` computed whole. Its
backward (:func:`norm_backward`) turns the gradient of ``norm1(x)`` into that of ``x``, tile
by tile, in place, and the norm's parameters get theirs through autograd (into ``.grad``, as
the tiled layer tail's do).

The cost: the norm runs once per projection that reads a tile (each exchange step's heads),
an elementwise pass over ``x`` beside a GEMM over it.

Shape legend: N = B s rows (batch rows times positions), E hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

NORM_ROW_BYTES = 1 << 28
"""The float32 bytes of one tile of normed rows (the norm runs in float32): 256 MiB is 16K
rows of a 4096-wide model."""


@dataclass(frozen=True, slots=True)
class InputNorm:
    """The block's input norm: ``fn`` a row-wise function of ``[..., E]`` (the norm module's
    own forward), ``params`` its parameters that need a gradient, and ``before_tile(last)``,
    if given, called before each tile's backward with whether it is the last one (a ZeRO-1/2
    integration reduces a gradient when its hook fires: ``last`` says it is whole)."""

    fn: Callable[[Tensor], Tensor]
    params: Sequence[Tensor] = ()
    before_tile: Callable[[bool], None] | None = None


class NormedRows:
    """``norm(x_NE)`` of a ``[N, E]`` input, for the rows that :meth:`of` selects."""

    __slots__ = ("x", "norm")

    def __init__(self, x_NE: Tensor, norm: InputNorm) -> None:
        self.x, self.norm = x_NE, norm

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def new_empty(self, *shape) -> Tensor:
        return self.x.new_empty(*shape)

    def of(self, select: Callable[[Tensor], Tensor]) -> Tensor:
        """``norm(select(x))``: the normed rows ``select`` picks of ``x``."""
        return self.norm.fn(select(self.x))

    def narrowed(self, select: Callable[[Tensor], Tensor]) -> "NormedRows":
        """The rows ``select`` picks, still to be normed."""
        return NormedRows(select(self.x), self.norm)

    def tile_rows(self) -> int:
        """Rows per tile of normed values (:data:`NORM_ROW_BYTES` of float32)."""
        return max(1, NORM_ROW_BYTES // (4 * self.x.shape[-1]))


def rows_of(x, select: Callable[[Tensor], Tensor]) -> Tensor:
    """``select(x)``, normed where ``x`` is :class:`NormedRows`."""
    return x.of(select) if isinstance(x, NormedRows) else select(x)


def row_tiles(n: int, per_tile: int) -> list[slice]:
    """``[0, n)`` in slices of ``per_tile``."""
    return [slice(a, min(a + per_tile, n)) for a in range(0, n, per_tile)]


def norm_backward(x_NE: Tensor, norm: InputNorm, d_NE: Tensor) -> Tensor:
    """``d_NE``, the gradient of ``norm(x_NE)``, made that of ``x_NE`` in place, tile by
    tile (the norm recomputed per tile); the norm's parameters' ``.grad`` accumulate."""
    tiles = row_tiles(x_NE.shape[0], NormedRows(x_NE, norm).tile_rows())
    for i, t in enumerate(tiles):
        if norm.before_tile is not None:
            norm.before_tile(i == len(tiles) - 1)
        with torch.enable_grad():
            leaf = x_NE[t].detach().requires_grad_()
            y = norm.fn(leaf)
        torch.autograd.backward(y, d_NE[t])
        d_NE[t] = leaf.grad
        del y, leaf
    return d_NE


__all__ = ["InputNorm", "NORM_ROW_BYTES", "NormedRows", "norm_backward", "row_tiles",
           "rows_of"]
