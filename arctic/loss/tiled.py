"""The tiled logits + loss: lm_head logits and the cross-entropy tile by tile, so the
``[S_local, vocab]`` logits never exist whole (320 GB in fp32 for Llama-3 at 625K local
tokens). Its backward recomputes each tile's logits and produces the hidden-state gradient tile
by tile and the lm_head weight gradient by accumulation.

Shape legend: B batch, S this rank's sequence piece, E hidden size, V vocab, N = B * S tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from arctic.tiling.tiles import DEFAULT_TILE_BUDGET_BYTES, resolve_tiles, tile_rows

IGNORE_INDEX = -100


def check_logit_transform(scale: float, softcap: float | None) -> None:
    """``ValueError`` unless ``scale`` is a finite real number other than 0 and ``softcap`` is
    ``None`` or a finite real number > 0."""
    def finite(x) -> bool:  # abs(nan) < inf is False too
        return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < float("inf")

    if not finite(scale) or scale == 0:
        raise ValueError(f"logit_scale must be a finite number other than 0, got {scale!r}; "
                         f"use 1.0 for no scaling")
    if softcap is not None and (not finite(softcap) or softcap <= 0):
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got "
                         f"{softcap!r}; use None for no cap")


def transform_logits_(z: Tensor, *, scale: float = 1.0, softcap: float | None = None) -> Tensor:
    """A causal-LM head's transform of float32 logits, in place on ``z``: ``z * scale``, then
    with a ``softcap``, ``softcap * tanh(z / softcap)``. Returns ``z``.

    Granite divides by ``config.logits_scaling`` (``scale = 1 / logits_scaling``), Cohere
    multiplies by ``config.logit_scale``, Gemma 2/3 cap at ``config.final_logit_softcapping``.
    In place because the tiled loss must not hold a second copy of a tile's logits."""
    if softcap is None:
        return z.mul_(scale) if scale != 1.0 else z
    return z.mul_(scale / softcap).tanh_().mul_(softcap)


def tile_logits(h_tE: Tensor, weight_VE: Tensor, scale: float,
                 softcap: float | None) -> Tensor:
    """``[t, E] @ [V, E]^T`` -> transformed float32 ``[t, V]`` (the loss is computed in
    float32, as HF's loss upcasts the logits)."""
    # The product is a fresh tensor that nothing else holds, so transforming it (or its
    # float32 copy) in place is safe.
    return transform_logits_((h_tE @ weight_VE.t()).float(), scale=scale, softcap=softcap)


class _TiledLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NE, weight_VE, labels_N, tiles, scale, softcap):
        ctx.tiles, ctx.scale, ctx.softcap = tiles, scale, softcap
        ctx.save_for_backward(h_NE, weight_VE, labels_N)
        total = torch.zeros((), dtype=torch.float32, device=h_NE.device)
        for _, start, n in tile_rows(h_NE, h_NE.shape[0], tiles):
            h_t, y_t = h_NE[start:start + n], labels_N[start:start + n]
            total += F.cross_entropy(tile_logits(h_t, weight_VE, scale, softcap), y_t,
                                     ignore_index=IGNORE_INDEX, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_NE, weight_VE, labels_N = ctx.saved_tensors
        softcap = ctx.softcap
        dh = torch.empty_like(h_NE)
        dw = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device)
        # Chain rule through c = transform(z): d loss/dz = (softmax(c) - onehot) * dc/dz, with
        # dc/dz = scale * (1 - (c / softcap)^2) (tanh' = 1 - tanh^2), or just scale without a
        # cap. The constant scale joins the upstream gradient.
        upstream = grad_total * ctx.scale
        for _, start, n in tile_rows(h_NE, h_NE.shape[0], ctx.tiles):
            h_t, y_t = h_NE[start:start + n], labels_N[start:start + n]
            c = tile_logits(h_t, weight_VE, ctx.scale, softcap)         # [t, V] float32
            g = torch.softmax(c, dim=-1)                                   # [t, V] float32
            # Without nonzero()/boolean indexing: no device->host sync on CUDA, and the step
            # traces under FakeTensorMode (the memory planner) where the labels are unknown.
            valid = y_t != IGNORE_INDEX
            g.scatter_add_(1, y_t.clamp(min=0).unsqueeze(1), -valid.to(g.dtype).unsqueeze(1))
            g.mul_(valid.unsqueeze(1))
            if softcap is not None:
                # 1 - (c / softcap)^2 in place on c: still two [t, V] temporaries per tile.
                g.mul_(c.div_(softcap).square_().neg_().add_(1.0))
            del c
            g *= upstream
            g = g.to(h_NE.dtype)  # the matmuls run in the activations' dtype
            dh[start:start + n] = g @ weight_VE
            # The tile's weight gradient: a GEMM in the activations' dtype (it accumulates in
            # float32 and rounds its result once), summed over the tiles in float32. An fp32
            # GEMM here (g in fp32, h upcast) would run bf16 training's largest matmul on the
            # GPU's fp32 cores.
            dw += g.t() @ h_t
            del g
        return dh, dw.to(weight_VE.dtype), None, None, None, None


def tiled_logits_loss(hidden_BSE: Tensor, weight_VE: Tensor, labels_BS: Tensor, *,
                      tiles: int | str = "auto",
                      budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                      group: dist.ProcessGroup | None = None,
                      logit_scale: float = 1.0,
                      logit_softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of the transformed ``hidden @ weight^T`` against ``labels``, tile
    by tile.

    Args:
        hidden_BSE: final hidden states (after the last norm), this rank's sequence piece.
        weight_VE: the lm_head weight (no bias).
        labels_BS: already shifted labels (``labels[i]`` is the token after position i), with
            ``-100`` where no loss is taken; see :mod:`arctic.data`.
        tiles: an int, or ``"auto"``: enough tiles that one tile's float32 logits and
            softmax fit ``budget_bytes``; agreed over ``group`` (default: the world).
        logit_scale, logit_softcap: the head's transform of the float32 logits ``z``
            (:func:`transform_logits_`): ``z * logit_scale``, then
            ``logit_softcap * tanh(z / logit_softcap)`` unless the cap is ``None``. The
            backward differentiates through both exactly.

    Returns:
        ``(loss_sum, num_valid)``: the float32 sum of token losses (differentiable w.r.t.
        hidden and weight) and the int64 count of labels that are not -100. Combine ranks with
        :func:`arctic.loss.sp_token_loss`.

    Raises ``ValueError`` for mismatched shapes, a scale that is not finite or is 0, or a cap
    that is not > 0.
    """
    check_logit_transform(logit_scale, logit_softcap)
    if hidden_BSE.shape[:-1] != labels_BS.shape:
        raise ValueError(f"hidden {tuple(hidden_BSE.shape)} and labels {tuple(labels_BS.shape)} "
                         f"must agree on [batch, seq]")
    if hidden_BSE.shape[-1] != weight_VE.shape[-1]:
        raise ValueError(f"hidden size {hidden_BSE.shape[-1]} does not match the lm_head "
                         f"weight {tuple(weight_VE.shape)}")
    h_NE, labels_N = hidden_BSE.reshape(-1, hidden_BSE.shape[-1]), labels_BS.reshape(-1)
    n = resolve_tiles(tiles, h_NE.shape[0], 2 * weight_VE.shape[0] * 4,
                      budget_bytes=budget_bytes, group=group)
    loss_sum = _TiledLossFn.apply(h_NE, weight_VE, labels_N, n, float(logit_scale),
                                  None if logit_softcap is None else float(logit_softcap))
    return loss_sum, (labels_N != IGNORE_INDEX).sum()
