"""The per-head prologue of a fused attention block: ``x @ W[rows]^T + b[rows]``, Qwen3's
per-head RMSNorm, RoPE, for any set of heads; and the transpose of each.

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
    """One of q/k/v: ``weight [heads D, E]``, optional ``bias [heads D]``, optional per-head
    RMSNorm ``norm [D]`` (Qwen3), and whether RoPE applies (q and k)."""

    weight: Tensor
    bias: Tensor | None
    norm: Tensor | None
    rope: bool


@dataclass(slots=True)
class ProjectionGrads:
    """Accumulators of one projection's gradients; None where no gradient is needed."""

    weight: Tensor | None
    bias: Tensor | None
    norm: Tensor | None
    """fp32; cast to the weight dtype at the end."""


def rope(t_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's ``q * cos + rotate_half(q) * sin``; cos/sin ``[B|1, s, 1, D]``."""
    t1, t2 = t_BsnD.chunk(2, dim=-1)
    return t_BsnD * cos + torch.cat((-t2, t1), dim=-1) * sin


def rope_backward(g_BsnD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The transpose of :func:`_rope`: rotate_half^T(z) = cat(z2, -z1)."""
    z1, z2 = (g_BsnD * sin).chunk(2, dim=-1)
    return g_BsnD * cos + torch.cat((z2, -z1), dim=-1)


def rms_norm(p_BsnD: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3's per-head RMSNorm: in fp32, cast back, times ``weight [D]``."""
    p32 = p_BsnD.float()
    rstd = torch.rsqrt(p32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (p32 * rstd).to(p_BsnD.dtype)


def rms_norm_backward(p_BsnD: Tensor, weight: Tensor, eps: float,
                       g_BsnD: Tensor) -> tuple[Tensor, Tensor]:
    """``(dp, dweight_fp32)`` of :func:`_rms_norm` at ``p`` for the output gradient ``g``."""
    p32 = p_BsnD.float()
    rstd = torch.rsqrt(p32.pow(2).mean(-1, keepdim=True) + eps)
    normed = p32 * rstd
    dweight = (g_BsnD.float() * normed.to(p_BsnD.dtype)).sum(dim=(0, 1, 2))
    dn = (g_BsnD * weight).float()
    dp = rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))
    return dp.to(p_BsnD.dtype), dweight


def _linear(x_NE: Tensor, proj: Projection, heads: HeadSet, w_rows: Tensor) -> Tensor:
    """``x @ W[rows]^T + b[rows]``: ``[B s, n D]``."""
    b = None if proj.bias is None else proj.bias.index_select(0, heads.rows)
    return F.linear(x_NE, w_rows, b)


def project(x_NE: Tensor, proj: Projection, heads: HeadSet, shape, rotary,
            eps: float) -> Tensor:
    """The heads ``heads`` of one projection, normed and rotated: ``[B, s, n, D]``.

    ``shape`` is ``(B, s, D)``; ``rotary`` the ``(cos, sin)`` tables as ``[B|1, s, 1, D]``.
    """
    B, s, D = shape
    w_rows = proj.weight.index_select(0, heads.rows)
    t = _linear(x_NE, proj, heads, w_rows).view(B, s, heads.count, D)
    if proj.norm is not None:
        t = rms_norm(t, proj.norm, eps)
    return rope(t, *rotary) if proj.rope else t


def project_backward(x_NE: Tensor, proj: Projection, heads: HeadSet, shape, rotary,
                     eps: float, g_BsnD: Tensor, grads: ProjectionGrads,
                     dx_NE: Tensor | None) -> None:
    """Accumulate the gradients of :func:`project` for its output gradient ``g_BsnD``:
    into ``grads`` (these heads' rows of the weight, bias and the norm weight) and ``dx_NE``.
    """
    B, s, D = shape
    w_rows = proj.weight.index_select(0, heads.rows)
    if proj.rope:
        g_BsnD = rope_backward(g_BsnD, *rotary)
    if proj.norm is not None:
        p = _linear(x_NE, proj, heads, w_rows)  # recomputed: the pre-norm values of these heads
        g_BsnD, dnorm = rms_norm_backward(p.view(B, s, heads.count, D), proj.norm, eps, g_BsnD)
        if grads.norm is not None:
            grads.norm += dnorm
    # [B, s, n, D] -> [B s, n D]
    g = g_BsnD.reshape(B * s, heads.count * D)
    if dx_NE is not None:
        dx_NE.addmm_(g, w_rows)
    if grads.weight is not None:
        grads.weight.index_add_(0, heads.rows, g.t() @ x_NE)
    if grads.bias is not None:
        grads.bias.index_add_(0, heads.rows, g.sum(0))
