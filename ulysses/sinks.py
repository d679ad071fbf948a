"""Attention sinks (GPT-OSS's ``s_aux``): one learned logit per head that joins every query's
softmax with a zero value vector.

With ``s_h`` the sink of head h and ``lse`` the log-sum-exp of a row's real scores, the sink
only adds ``exp(s_h)`` to the softmax denominator, so it is exact to apply after any
attention that returns ``(out, lse)``, however that attention was split (chunks, ring
blocks, documents, windows):

- ``lse' = logaddexp(lse, s_h)`` and ``out' = out * exp(lse - lse') = out * sigmoid(lse - s_h)``.
- The kernels' backward, run with ``out'`` and ``lse'``, gives the exact dq, dk, dv of the
  attention with the sink: it recomputes the probabilities as ``exp(score - lse')``, and the
  sink's own term in ``delta = rowsum(dout' * out')`` is zero because its value is zero.
- ``d loss / d s_h = -sum over rows of exp(s_h - lse') * rowsum(dout' * out')``.

Shape legend: B batch, S rows, h heads (this rank's), D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sinks(sinks: Tensor | None, num_heads: int, device: torch.device) -> None:
    """``ValueError`` unless ``sinks`` is None or a floating ``[num_heads]`` tensor on
    ``device``."""
    if sinks is None:
        return
    if not torch.is_tensor(sinks) or sinks.shape != (num_heads,) or \
            not sinks.dtype.is_floating_point:
        got = tuple(sinks.shape) if torch.is_tensor(sinks) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating tensor of shape ({num_heads},) (one logit "
                         f"per query head), got {got}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}")


def apply_sinks(out_BShD: Tensor, lse_BhS: Tensor, sinks_h: Tensor) -> tuple[Tensor, Tensor]:
    """``(out', lse')`` with the sinks in the softmax. ``out`` is scaled in place (it is a
    fresh kernel output); ``lse'`` is float32."""
    s = sinks_h.detach().float()[None, :, None]                    # [1, h, 1]
    new = torch.logaddexp(lse_BhS, s)
    # [B, h, S] -> [B, S, h, 1]: each row keeps exp(lse - lse') of its mass.
    out_BShD.mul_(torch.exp(lse_BhS - new).transpose(1, 2).unsqueeze(-1).to(out_BShD.dtype))
    return out_BShD, new


def sinks_grad(dout_BShD: Tensor, out_BShD: Tensor, lse_BhS: Tensor, sinks_h: Tensor) -> Tensor:
    """``d loss / d sinks_h`` (float32 ``[h]``) from the output gradient and the sinks-applied
    ``out`` and ``lse``. One head at a time, so the float32 temporaries are ``[B, S, D]``."""
    s = sinks_h.detach().float()
    grad = torch.empty(s.shape, dtype=torch.float32, device=s.device)
    for i in range(s.shape[0]):
        delta = (dout_BShD[:, :, i].float() * out_BShD[:, :, i].float()).sum(-1)   # [B, S]
        grad[i] = -(torch.exp(s[i] - lse_BhS[:, i]) * delta).sum()
    return grad
