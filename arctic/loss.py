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

import torch
import torch.distributed as dist
from torch import Tensor


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


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Tensor], *,
                   group: dist.ProcessGroup | None, tiles: int | str = "auto") -> Tensor:
    """The SP loss of a HF causal LM on a batch from :func:`arctic.data.prepare_sp_batch`.

    Runs the base model for hidden states, then :func:`arctic.tiling.tiled_logits_loss`
    against the lm_head weight (logits are never whole) and :func:`sp_token_loss` over
    ``group`` (the mesh's ``"sp"`` axis).
    """
    from arctic.tiling import tiled_logits_loss

    if "shift_labels" not in batch:
        raise ValueError("batch needs shift_labels; prepare it with arctic.data.prepare_sp_batch")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the tiled loss supports an lm_head without bias")
    hidden = model.base_model(input_ids=batch["input_ids"],
                              position_ids=batch["position_ids"]).last_hidden_state
    loss_sum, num_valid = tiled_logits_loss(hidden, head.weight, batch["shift_labels"],
                                            tiles=tiles, group=group)
    return sp_token_loss(loss_sum, num_valid, group=group)
