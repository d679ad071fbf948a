"""The per-head prologue of a fused attention block: ``x @ W[rows]^T + b[rows]``, a per-head
RMSNorm (Qwen3's, or Qwen3.5's zero-centered one), RoPE over all or the first part of the head
dim, for any set of heads; and the transpose of each. A gated block's q_proj (Qwen3.5,
Qwen3-Next) holds, per head, D query rows and then D gate rows: :attr:`Projection.half` picks
one of the two.

:mod:`ulysses.fused_attention` calls :func:`project` for the heads one exchange sends and
:func:`project_backward` when their gradient comes back. Both only ever touch those heads:
weight rows are gathered with ``index_select`` (a copy of ``n D x E`` elements, small next to
the activations) and their gradients scattered back with ``index_add_``, which also sums the
contributions of a kv head sent to several ranks (replicated kv).

Shape legend: B batch, s this rank's sequence piece, E hidden size, D head dim, n heads of
one exchange; ``x_NE`` is ``x_BsE`` as ``[B s, E]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ulysses.input_norm import NormedRows, row_tiles, rows_of


@dataclass(frozen=True, slots=True)
class HeadSet:
    """The heads one exchange carries: per rank ``(first global head, count)``."""

    ranges: tuple[tuple[int, int], ...]
    local: tuple[tuple[int, int], ...]
    """The same heads as ``(offset, count)`` into the ``[B, s, n, D]`` tensor sent."""
    rows: Tensor
    """Their weight rows (q/k/v) or columns (o_proj), in send order: ``[n D]``."""
    count: int


def head_set(ranges, D: int, device) -> HeadSet:
    """The :class:`HeadSet` of per-rank head ranges ``ranges`` with head dim ``D``."""
    local, off = [], 0
    for _, n in ranges:
        local.append((off, n))
        off += n
    rows = torch.cat([torch.arange(start * D, (start + n) * D, device=device)
                      for start, n in ranges if n])
    return HeadSet(tuple(ranges), tuple(local), rows, off)


@dataclass(frozen=True, slots=True)
class Projection:
    """One of q/k/v (or a gated block's gate): ``weight [heads D, E]``, optional
    ``bias [heads D]``, optional per-head RMSNorm ``norm [D]`` (Qwen3; ``zero_centered``:
    Qwen3.5's, ``x * rstd * (1 + norm)`` in fp32, then cast), and whether RoPE applies (q
    and k). ``half``: None, or which half of each head's ``2 D`` rows of ``weight [2 heads D,
    E]`` this projection is (0 the query, 1 the gate: Qwen3.5's q_proj)."""

    weight: Tensor
    bias: Tensor | None
    norm: Tensor | None
    rope: bool
    zero_centered: bool = False
    half: int | None = None

    def rows(self, heads: HeadSet, D: int) -> Tensor:
        """The weight (and bias) rows of ``heads``: ``heads.rows`` where each head has D rows,
        each head's ``half`` of ``2 D`` rows otherwise."""
        if self.half is None:
            return heads.rows
        return heads.rows + (torch.div(heads.rows, D, rounding_mode="floor") + self.half) * D


@dataclass(slots=True)
class ProjectionGrads:
    """Accumulators of one projection's gradients; None where no gradient is needed."""

    weight: Tensor | None
    bias: Tensor | None
    norm: Tensor | None
    """fp32; cast to the weight dtype at the end."""


def _rotate(t_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    t1, t2 = t_BsnD.chunk(2, dim=-1)
    return t_BsnD * cos + torch.cat((-t2, t1), dim=-1) * sin


def _rotate_backward(g_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    z1, z2 = (g_BsnD * sin).chunk(2, dim=-1)
    return g_BsnD * cos + torch.cat((z2, -z1), dim=-1)


def _partial(fn, t_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``fn`` on the first ``cos.shape[-1]`` of the head dim, the rest passed through (HF's
    partial rotary: ``cat(rope(t[..., :r]), t[..., r:])``)."""
    r = cos.shape[-1]
    if r == t_BsnD.shape[-1]:
        return fn(t_BsnD, cos, sin)
    return torch.cat((fn(t_BsnD[..., :r], cos, sin), t_BsnD[..., r:]), dim=-1)


def rope(t_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's ``q * cos + rotate_half(q) * sin``; cos/sin ``[B|1, s, 1, r]``, over the first
    ``r <= D`` of the head dim."""
    return _partial(_rotate, t_BsnD, cos, sin)


def rope_backward(g_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The transpose of :func:`rope`: rotate_half^T(z) = cat(z2, -z1)."""
    return _partial(_rotate_backward, g_BsnD, cos, sin)


def rms_norm(p_BsnD: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """A per-head RMSNorm in fp32: Qwen3's (cast back, times ``weight [D]``), or
    ``zero_centered`` Qwen3.5's (times ``1 + weight`` in fp32, then cast)."""
    p32 = p_BsnD.float()
    normed = p32 * torch.rsqrt(p32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(p_BsnD.dtype)
    return weight * normed.to(p_BsnD.dtype)


def rms_norm_backward(p_BsnD: Tensor, weight: Tensor, eps: float, g_BsnD: Tensor,
                      zero_centered: bool = False) -> tuple[Tensor, Tensor]:
    """``(dp, dweight_fp32)`` of :func:`rms_norm` at ``p`` for the output gradient ``g``."""
    p32 = p_BsnD.float()
    rstd = torch.rsqrt(p32.pow(2).mean(-1, keepdim=True) + eps)
    normed = p32 * rstd
    if zero_centered:
        g32 = g_BsnD.float()
        dweight = (g32 * normed).sum(dim=(0, 1, 2))
        dn = g32 * (1.0 + weight.float())
    else:
        dweight = (g_BsnD.float() * normed.to(p_BsnD.dtype)).sum(dim=(0, 1, 2))
        dn = (g_BsnD * weight).float()
    dp = rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))
    return dp.to(p_BsnD.dtype), dweight


def _linear(x_NE: Tensor, proj: Projection, rows: Tensor, w_rows: Tensor) -> Tensor:
    """``x @ W[rows]^T + b[rows]``: ``[B s, n D]``."""
    b = None if proj.bias is None else proj.bias.index_select(0, rows)
    return F.linear(x_NE, w_rows, b)


NORM_TILE_BYTES = 1 << 28
"""The float32 bytes of one tile of a normed projection's rows: a per-head norm runs in
float32 (the input, the normed values and, in backward, their gradients), so a projection
with a norm runs over sequence tiles of at most this many float32 values' bytes; 256 MiB is
62K positions of Qwen3.5-9B's two 256-wide heads a step."""


def _tiles(proj: Projection, x_NE, B: int, s: int, n: int, D: int) -> list[slice]:
    """Sequence tiles of a projection: one, unless the heads have a norm (float32 tiles of
    :data:`NORM_TILE_BYTES`) or ``x_NE`` is still to be normed (:class:`NormedRows`)."""
    steps = [] if proj.norm is None else [NORM_TILE_BYTES // (4 * B * n * D)]
    if isinstance(x_NE, NormedRows):
        steps.append(x_NE.tile_rows() // B)
    if not steps:
        return [slice(0, s)]
    return row_tiles(s, max(1, min(steps)))


def _whole(t: Tensor) -> Tensor:
    return t


def _seq_rows(t_NX: Tensor, B: int, s: int, cut: slice) -> Tensor:
    """Positions ``cut`` of each batch row of a ``[B s, X]`` tensor, as ``[B b, X]``."""
    return t_NX.view(B, s, -1)[:, cut].reshape(-1, t_NX.shape[-1])


def _project_rows(x_NE: Tensor, proj: Projection, rows: Tensor, w_rows: Tensor, shape,
                  rotary, eps: float) -> Tensor:
    t = _linear(x_NE, proj, rows, w_rows).view(*shape)
    if proj.norm is not None:
        t = rms_norm(t, proj.norm, eps, proj.zero_centered)
    return rope(t, *rotary) if proj.rope else t


def project(x_NE: Tensor, proj: Projection, heads: HeadSet, shape, rotary,
            eps: float) -> Tensor:
    """The heads ``heads`` of one projection, normed and rotated: ``[B, s, n, D]``; with a
    norm, over sequence tiles of :data:`NORM_TILE_BYTES`.

    ``shape`` is ``(B, s, D)``; ``rotary`` the ``(cos, sin)`` tables as ``[B|1, s, 1, r]``.
    """
    B, s, D = shape
    n = heads.count
    rows = proj.rows(heads, D)
    w_rows = proj.weight.index_select(0, rows)
    cuts = _tiles(proj, x_NE, B, s, n, D)
    if len(cuts) == 1:
        return _project_rows(rows_of(x_NE, _whole), proj, rows, w_rows, (B, s, n, D), rotary,
                             eps)
    out = x_NE.new_empty(B, s, n, D)
    for cut in cuts:
        out[:, cut] = _project_rows(rows_of(x_NE, lambda t: _seq_rows(t, B, s, cut)), proj,
                                    rows, w_rows,
                                    (B, cut.stop - cut.start, n, D),
                                    tuple(r[:, cut] for r in rotary), eps)
    return out


def project_backward(x_NE: Tensor, proj: Projection, heads: HeadSet, shape, rotary,
                     eps: float, g_BsnD: Tensor, grads: ProjectionGrads,
                     dx_NE: Tensor | None) -> None:
    """Accumulate the gradients of :func:`project` for its output gradient ``g_BsnD``:
    into ``grads`` (these heads' rows of the weight, bias and the norm weight) and ``dx_NE``,
    over the same sequence tiles."""
    B, s, D = shape
    n = heads.count
    rows = proj.rows(heads, D)
    w_rows = proj.weight.index_select(0, rows)
    cuts = _tiles(proj, x_NE, B, s, n, D)
    for cut in cuts:
        whole = len(cuts) == 1
        b = cut.stop - cut.start
        x = rows_of(x_NE, _whole if whole else lambda t: _seq_rows(t, B, s, cut))
        g = g_BsnD if whole else g_BsnD[:, cut]
        if proj.rope:
            g = rope_backward(g, *(rotary if whole else (r[:, cut] for r in rotary)))
        if proj.norm is not None:
            p = _linear(x, proj, rows, w_rows)  # recomputed: the pre-norm values of these heads
            g, dnorm = rms_norm_backward(p.view(B, b, n, D), proj.norm, eps, g,
                                         proj.zero_centered)
            if grads.norm is not None:
                grads.norm += dnorm
        g = g.reshape(B * b, n * D)
        if whole or dx_NE is None:
            linear_backward(x, g, rows, w_rows, grads, dx_NE)
            continue
        dx = x.new_zeros(B * b, x_NE.shape[-1])
        linear_backward(x, g, rows, w_rows, grads, dx)
        dx_NE.view(B, s, -1)[:, cut] += dx.view(B, b, -1)


def linear_backward(x_NE: Tensor, g: Tensor, rows: Tensor, w_rows: Tensor,
                    grads: ProjectionGrads, dx_NE: Tensor | None) -> None:
    """The transpose of ``x @ W[rows]^T + b[rows]`` for its gradient ``g [B s, n D]``:
    ``dx += g W[rows]``, ``dW[rows] += g^T x``, ``db[rows] += sum(g)``."""
    if dx_NE is not None:
        dx_NE.addmm_(g, w_rows)
    if grads.weight is not None:
        grads.weight.index_add_(0, rows, g.t() @ x_NE)
    if grads.bias is not None:
        grads.bias.index_add_(0, rows, g.sum(0))


def _all_rows(gate: Projection, heads: HeadSet, D: int):
    rows = gate.rows(heads, D)
    return rows, gate.weight.index_select(0, rows), \
        None if gate.bias is None else gate.bias.index_select(0, rows)


def gated_output(x_NE: Tensor, out_NX: Tensor, gate: Projection, heads: HeadSet, D: int,
                 wo: Tensor, bo: Tensor | None, tile_rows: int) -> Tensor:
    """A gated block's output, ``(out * sigmoid(x @ Wg^T + bg)) @ Wo^T + bo``, over
    ``tile_rows`` rows of ``x_NE`` at a time (``heads``: every query head, ``out_NX``
    ``[B s, H D]``): ``[B s, E]``, with no all-heads gate."""
    _, wg, bg = _all_rows(gate, heads, D)
    y = x_NE.new_empty(x_NE.shape[0], wo.shape[0])
    for t in row_tiles(x_NE.shape[0], tile_rows):
        x = rows_of(x_NE, lambda v: v[t])
        y[t] = F.linear(out_NX[t] * torch.sigmoid(F.linear(x, wg, bg)), wo, bo)
    return y


def gated_output_backward(x_NE: Tensor, out_NX: Tensor, dy_NE: Tensor, gate: Projection,
                          heads: HeadSet, D: int, wo: Tensor, tile_rows: int,
                          dwo: Tensor | None, grads: ProjectionGrads,
                          dx_NE: Tensor | None) -> None:
    """The gradients of :func:`gated_output` but that of ``out`` (the fused loop's ``dout``,
    per step): ``dwo``, the gate's rows of ``grads`` (weight and bias) and its part of
    ``dx_NE``, in the same row tiles."""
    rows, wg, bg = _all_rows(gate, heads, D)
    for t in row_tiles(x_NE.shape[0], tile_rows):
        x = rows_of(x_NE, lambda v: v[t])
        sig = torch.sigmoid(F.linear(x, wg, bg))
        if dwo is not None:
            dwo.addmm_(dy_NE[t].t(), out_NX[t] * sig)
        dgate = (dy_NE[t] @ wo) * out_NX[t] * sig * (1 - sig)
        linear_backward(x, dgate, rows, wg, grads, None if dx_NE is None else dx_NE[t])
