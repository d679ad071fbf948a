"""Token-weighted loss across the ranks of a sequence-parallel group.

Each SP rank holds a piece of one sequence and the summed loss of its own tokens. The loss of
the sequence is ``sum over ranks of loss_sum / sum over ranks of num_valid``: a mean over
tokens, not a mean of per-rank means (which would overweight a rank with few valid labels,
and divide by zero on a rank with none).

Gradients: rank r's true share of the sequence gradient is ``d(loss_sum_r) / N``.
- DDP, FSDP2 and a plain all-reduce mean average over every rank (dp x sp), which divides
  each share by sp too: ``averaged_over_sp=True`` (the default) scales the backward by sp to
  compensate.
- DeepSpeed given an SP-aware ``mpu`` divides by dp only (it sums over the sp ranks):
  ``averaged_over_sp=False``.
Either way, after the framework's reduction the gradients equal those of single-device
training on the whole sequence (and with dp > 1, the mean over the dp replicas' sequences, as
in plain data parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from offload.order import record_apply
from arctic.tiling import tiled_logits_loss


class _SPTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_sum, num_valid, group, averaged_over_sp):
        sp = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
        totals = torch.stack([loss_sum.detach().float(), num_valid.detach().float()])
        if sp > 1:
            dist.all_reduce(totals, group=group)
        # No valid label anywhere in the group: the loss is 0 and so are the gradients.
        count = totals[1].clamp(min=1.0)
        ctx.scale = (sp if averaged_over_sp else 1) / count
        return totals[0] / count

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None


def sp_token_loss(loss_sum: Tensor, num_valid: Tensor | int, *,
                  group: dist.ProcessGroup | None, averaged_over_sp: bool = True) -> Tensor:
    """The group's token-mean loss, with gradients scaled for dp x sp averaging.

    Args:
        loss_sum: this rank's summed token loss (a differentiable scalar), e.g. from
            :func:`arctic.tiling.tiled_logits_loss` or ``cross_entropy(..., reduction="sum")``.
        num_valid: this rank's count of labels that are not -100 (may be 0).
        group: the sequence-parallel group (the mesh's ``"sp"`` axis); ``None`` with an
            uninitialized process group means a single rank.
        averaged_over_sp: whether the gradient reduction divides by the sp ranks too (DDP,
            FSDP2: True) or sums over them (DeepSpeed with an SP ``mpu``: False).

    Returns:
        A scalar equal on every rank of the group: ``sum(loss_sum) / max(1, sum(num_valid))``.
        Backward gives this rank's ``loss_sum`` the gradient ``sp / sum(num_valid)`` (or
        ``1 / sum(num_valid)`` when not ``averaged_over_sp``). Every
        rank must call this (it all-reduces), including ranks with no valid label.
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
    if not torch.is_tensor(num_valid):
        num_valid = torch.tensor(num_valid, device=loss_sum.device)
    return _SPTokenLoss.apply(loss_sum, num_valid.to(loss_sum.device), group, averaged_over_sp)


class _TiledHeadForward:
    """An lm_head instance's forward, replaced by the tiled logits + summed loss."""

    def __init__(self, head: nn.Module, tiles, group) -> None:
        self.head, self.tiles, self.group = head, tiles, group

    def __call__(self, hidden_BSE: Tensor, shift_labels_BS: Tensor) -> tuple[Tensor, Tensor]:
        return tiled_logits_loss(hidden_BSE, self.head.weight, shift_labels_BS,
                                 tiles=self.tiles, group=self.group)


class _SPLossForward:
    """A causal LM instance's forward, replaced by the SP loss of one sharded batch."""

    def __init__(self, model: nn.Module, group, averaged_over_sp: bool) -> None:
        self.model, self.group, self.averaged_over_sp = model, group, averaged_over_sp

    def __call__(self, input_ids: Tensor, position_ids: Tensor, shift_labels: Tensor,
                 **kwargs: Any) -> Tensor:
        # No KV cache in training: it would keep every layer's k/v alive until the step ends.
        kwargs.setdefault("use_cache", False)
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids,
                                       **kwargs).last_hidden_state
        loss_sum, num_valid = self.model.get_output_embeddings()(hidden, shift_labels)
        return sp_token_loss(loss_sum, num_valid, group=self.group,
                             averaged_over_sp=self.averaged_over_sp)


def apply_sp_loss(model: nn.Module, *, group, loss_tiles: int | str = "auto",
                  averaged_over_sp: bool = True) -> nn.Module:
    """Make ``model(input_ids=, position_ids=, shift_labels=)`` return the SP loss.

    The batch is one from :func:`arctic.data.prepare_sp_batch`. The loss runs through module
    calls only (the base model, then the lm_head), so parameter-sharding hooks (ZeRO-3) fire
    where the parameters are used. The lm_head keeps its parameters and state_dict keys; its
    instance forward computes :func:`arctic.tiling.tiled_logits_loss` instead of logits.
    ``averaged_over_sp``: see :func:`sp_token_loss` (True for DDP/FSDP2, False for DeepSpeed
    given an SP ``mpu``). ``ValueError`` if the head has a bias.
    """
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("the tiled loss needs an lm_head (get_output_embeddings) without bias")
    record_apply(model, "tiling")
    head.forward = _TiledHeadForward(head, loss_tiles, group)
    model.forward = _SPLossForward(model, group, averaged_over_sp)
    return model
