"""The input checks of :func:`ulysses.fused_attention.fused_attention` that need no mesh:
shapes of ``x``, the rotary tables and every weight, one dtype and device, no autocast. Each is
a ``ValueError`` raised before any collective."""

from __future__ import annotations

import torch
from torch import Tensor


def _check_shape(name: str, t: Tensor | None, shape: tuple[int, ...]) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_fused_inputs(x, cos, sin, weights: dict, num_heads: int, num_kv_heads: int,
                       gated: bool) -> int:
    """Every input check of :func:`ulysses.fused_attention.fused_attention` that needs no
    mesh; returns D."""
    if x.dim() != 3:
        raise ValueError(f"x must be [batch, seq, hidden], got shape {tuple(x.shape)}")
    B, s, E = x.shape
    H, K = num_heads, num_kv_heads
    wo, q_rows = weights["wo"], 2 * H if gated else H
    if wo.dim() != 2 or wo.shape[1] % H != 0:
        raise ValueError(f"wo must be [hidden, num_heads * head_dim] with num_heads={H}, got "
                         f"shape {tuple(wo.shape)}")
    D = wo.shape[1] // H
    if D % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {D}")
    expected = {"wq": (q_rows * D, E), "wk": (K * D, E), "wv": (K * D, E), "wo": (E, H * D),
                "bq": (q_rows * D,), "bk": (K * D,), "bv": (K * D,), "bo": (E,),
                "q_norm_weight": (D,), "k_norm_weight": (D,)}
    for name, shape in expected.items():
        _check_shape(name, weights[name], shape)
    if (weights["q_norm_weight"] is None) != (weights["k_norm_weight"] is None):
        raise ValueError("pass both q_norm_weight and k_norm_weight (Qwen3), or neither")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or \
            cos.shape[1] != s or not 0 < cos.shape[2] <= D or cos.shape[2] % 2:
        raise ValueError(f"cos and sin must both be [{B} or 1, {s}, r] with r even and at most "
                         f"head_dim={D} (HF's position_embeddings for this rank's piece: the "
                         f"rotary dims, the first r of each head), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos/sin must not require grad: the fused path returns no gradient "
                         "for the rotary embedding")
    tensors = {"x": x, "cos": cos, "sin": sin, **{n: t for n, t in weights.items()
                                                  if t is not None}}
    if len({t.dtype for t in tensors.values()}) != 1 or \
            len({t.device for t in tensors.values()}) != 1:
        found = {n: f"{t.dtype}/{t.device}" for n, t in tensors.items()}
        raise ValueError(f"x, cos, sin and every weight must share one dtype and device, got "
                         f"{found}")
    if torch.is_autocast_enabled(x.device.type):
        raise ValueError("fused_attention does not run under torch.autocast (its projections "
                         "bypass autocast's casts); cast the model to the training dtype "
                         "instead, or use the unfused path")
    return D


__all__ = ["check_fused_inputs"]
