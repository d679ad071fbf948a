"""The token-weighted loss across the ranks of a sequence-parallel group, and HF's causal-LM
loss on sequence pieces (:class:`SPCausalLMLoss`).

Each SP rank holds a piece of one sequence and the summed loss of its own tokens. The loss of
the sequence is ``sum over ranks of loss_sum / sum over ranks of num_valid``: a mean over
tokens, not a mean of per-rank means (which would overweight a rank with few valid labels,
and divide by zero on a rank with none). Every rank of the group gets that value.

Gradients are exact for any differentiable use of the returned value on each rank: used as
is, scaled, summed, or gathered and re-weighted per rank as DeepSpeed's documented ALST loop
does (``all_gather`` the per-rank losses, weight each by its rank's token count). The
forward adds over the group, so the backward adds the upstream gradients of the group's
ranks (one scalar all-reduce): rank r's ``loss_sum`` gets ``sum over ranks of grad / N``, its
true share of the objective, the mean over the SP ranks of what each backpropagates. Then
the framework's gradient reduction:
- averages over every rank (dp x sp): DDP, FSDP2, ZeRO-3's default reduce-scatter;
  ``averaged_over_sp=True``;
- or adds over the SP ranks (DeepSpeed ZeRO-0/1/2 given an SP ``mpu``, ZeRO-3's contiguous
  path): ``averaged_over_sp=False`` divides the backward by sp.
A model's SP loss learns which from the engine that wraps the model when it runs
(:mod:`arctic.loss.reduction`). Either way, after the reduction the gradients equal those of
single-device training on the whole sequence (and with dp > 1, the mean over the dp
replicas' sequences, as in plain data parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from arctic.hf.batch import cut_documents
from arctic.hf.binding import of_module
from arctic.hf.features import loss_arguments
from arctic.loss.reduction import resolve_sp_averaging
from arctic.loss.tiled import IGNORE_INDEX
from ulysses.mesh import flat_mesh
from ulysses.patching import instance_method
from ulysses.sharding import gather_sequence, shard_sequence


class _SPTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_sum, num_valid, group, averaged_over_sp, num_items):
        sp = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
        totals = torch.stack([loss_sum.detach().float(), num_valid.detach().float()])
        if sp > 1:
            dist.all_reduce(totals, group=group)
        # No valid label anywhere in the group: the loss is 0 and so are the gradients.
        count = totals[1].clamp(min=1.0) if num_items is None else num_items
        ctx.group, ctx.sp = group, sp
        ctx.scale = (1 if averaged_over_sp else 1 / sp) / count
        return totals[0] / count

    @staticmethod
    def backward(ctx, grad):
        # The forward added the ranks' loss sums, so each one's gradient is the sum of what
        # every rank backpropagates into the (equal) result; the callers' uses may differ.
        grad = grad.float().clone()
        if ctx.sp > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.scale, None, None, None, None


def sp_token_loss(loss_sum: Tensor, num_valid: Tensor | int, *,
                  group: dist.ProcessGroup | None, averaged_over_sp: bool = True,
                  num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """The group's token-mean loss, with gradients for the framework's reduction.

    Args:
        loss_sum: this rank's summed token loss (a differentiable scalar), e.g. from
            :func:`arctic.tiling.tiled_logits_loss` or ``cross_entropy(..., reduction="sum")``.
        num_valid: this rank's count of labels that are not -100 (may be 0).
        group: the sequence-parallel group (the mesh's ``"sp"`` axis); ``None`` with an
            uninitialized process group means a single rank.
        averaged_over_sp: whether the gradient reduction averages over the sp ranks too
            (DDP, FSDP2, ZeRO-3's reduce-scatter: True) or adds them (DeepSpeed ZeRO-0/1/2
            with an SP ``mpu``: False); :mod:`arctic.loss.reduction` tells which.
        num_items_in_batch: HF's divisor: the valid labels of everything the caller's loss is
            normalised over (all micro-batches of an accumulated step, and the ranks the caller
            counted), used in place of the group's own count. Must be positive.

    Returns:
        A scalar equal on every rank of the group: ``sum(loss_sum) / max(1, sum(num_valid))``,
        or ``sum(loss_sum) / num_items_in_batch``. Backward gives this rank's ``loss_sum`` the
        gradient ``G / divisor`` (``G / (sp * divisor)`` when not ``averaged_over_sp``),
        where ``G`` is the sum over the group's ranks of the gradient each backpropagates into
        the result: exact for any use of it, the same on every rank or not. Every rank must
        call this (it all-reduces), including ranks with no valid label, and every rank must
        backpropagate through the result (its backward all-reduces too).
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
    if not torch.is_tensor(num_valid):
        num_valid = torch.tensor(num_valid, device=loss_sum.device)
    divisor = None
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch).detach().float().reshape(())
        if not bool(divisor > 0):
            raise ValueError(f"num_items_in_batch must be positive, got "
                             f"{float(divisor):g}")
        divisor = divisor.to(loss_sum.device)
    return _SPTokenLoss.apply(loss_sum, num_valid.to(loss_sum.device), group, averaged_over_sp,
                              divisor)


def shift_labels_across_pieces(labels_BS: Tensor, mesh, *, ignore_index: int = IGNORE_INDEX,
                               segments=None) -> Tensor:
    """HF's shift of unshifted ``labels`` (each token's target is the next label, the last
    one ``ignore_index``), for this rank's piece of the sequence, with the targets that live on
    another rank: the pieces of the SP group are gathered (integers, ``[B, S]`` in all),
    shifted whole and cut again in the mesh's layout. Labels equal to ``ignore_index`` come
    back as -100, what the losses here ignore."""
    full = gather_sequence(labels_BS, mesh, dim=1)
    if ignore_index != IGNORE_INDEX and bool((full == IGNORE_INDEX).any()):
        raise ValueError(f"labels hold {IGNORE_INDEX} but ignore_index={ignore_index}: HF's "
                         f"cross-entropy would reject that target; use one ignore value")
    shifted = torch.full_like(full, IGNORE_INDEX)
    shifted[:, :-1] = full[:, 1:]
    shifted[shifted == ignore_index] = IGNORE_INDEX
    return shard_sequence(shifted, mesh, dim=1, segments=segments).contiguous()


def hf_targets(*, labels: Tensor | None, shift_labels: Tensor | None, ignore_index: int,
               mesh, group, kwargs=None) -> Tensor:
    """This piece's targets as HF's causal-LM loss reads them: ``shift_labels`` when given
    (HF's precedence), else ``labels`` shifted across the pieces; ``ignore_index`` labels
    become -100. Refused alike on every rank of ``group`` (a -100 target beside another
    ``ignore_index``, which HF's cross-entropy rejects): no rank goes on alone. ``kwargs``:
    the call's other keyword arguments (the varlen ones name a per-document mesh's cut)."""
    if shift_labels is None:
        segments = cut_documents(mesh, kwargs or {}, *labels.shape)
        return shift_labels_across_pieces(labels, mesh, ignore_index=ignore_index,
                                          segments=segments)
    if ignore_index == IGNORE_INDEX:
        return shift_labels
    bad = (shift_labels == IGNORE_INDEX).any().to(torch.int32).reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bool(bad):
        raise ValueError(f"shift_labels hold {IGNORE_INDEX} but ignore_index={ignore_index}: "
                         f"HF's cross-entropy would reject that target; use one ignore value")
    return shift_labels.masked_fill(shift_labels == ignore_index, IGNORE_INDEX)


class SPCausalLMLoss:
    """HF's causal-LM loss (``ForCausalLMLoss``: ``labels`` or ``shift_labels``,
    ``ignore_index``, ``num_items_in_batch``) for a model whose sequence is cut over the SP
    group: the token mean over the whole sequence, equal on the group's ranks, with gradients
    for dp x sp averaging (:func:`sp_token_loss`). :func:`arctic.apply_sequence_parallel`
    makes it the model's ``loss_function``, so ``model(input_ids=, position_ids=, labels=)``
    on the pieces gives the loss of the whole sequence. HF's forward hands its loss every
    keyword of the call: a loss argument of the installed transformers that this loss does not
    compute is refused; the others are the model's (the SP attention already honoured or
    refused them), which HF's loss passes over too.

    Unlike HF's loss on a piece (the mean over that piece's tokens), every rank gets the
    loss of the whole sequence. Its gradients are single-device training's whether the
    caller uses it as it is (``model(..., labels=).loss``), scales it, or gathers the ranks'
    losses and re-weights them by their token counts (DeepSpeed's ALST loop, HF's
    ``deepspeed_sp_compute_loss``): a re-weighting with weights that sum to 1 gives the same
    value and the same gradients. The gradient reduction that trains ``model`` (DDP, FSDP2,
    DeepSpeed at any ZeRO stage) is read off the model at each call
    (:mod:`arctic.loss.reduction`)."""

    HANDLED = frozenset({"logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index",
                         "shift_labels"})

    def __init__(self, mesh, replaced: Callable | None = None,
                 loss_arguments: frozenset[str] = frozenset(),
                 model: nn.Module | None = None) -> None:
        self.mesh, self.replaced = mesh, replaced
        self.refused = frozenset(loss_arguments) - self.HANDLED
        self.model = model  # the model whose loss_function this is

    def __call__(self, logits: Tensor, labels: Tensor | None, vocab_size: int,
                 num_items_in_batch: Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        if self.replaced is not None:
            raise ValueError(f"this model's loss ({getattr(self.replaced, '__name__', '?')}) is "
                             f"not the causal-LM loss that sequence parallelism computes over "
                             f"the pieces of the sequence; compute the loss yourself, or use "
                             f"arctic.apply_sp_loss")
        kwargs.pop("token_mask", None)  # arctic.data's padding mask: the SP loss's alone
        asked = sorted(n for n, v in kwargs.items() if n in self.refused and v is not None)
        if asked:
            raise ValueError(f"the sequence-parallel causal-LM loss computes labels/"
                             f"shift_labels, ignore_index and num_items_in_batch as HF does; "
                             f"{asked} would ask HF's loss for something else: leave them out")
        group = flat_mesh(self.mesh, "sp").get_group()
        targets = hf_targets(labels=labels, shift_labels=shift_labels, ignore_index=ignore_index,
                             mesh=self.mesh, group=group, kwargs=kwargs
                             ).reshape(-1).to(logits.device)
        loss_sum = F.cross_entropy(logits.float().reshape(-1, vocab_size), targets,
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        averaged = True if self.model is None else resolve_sp_averaging(self.model,
                                                                         group.size(), None)
        return sp_token_loss(loss_sum, targets.ne(IGNORE_INDEX).sum(), group=group,
                             averaged_over_sp=averaged, num_items_in_batch=num_items_in_batch)


def install_sp_causal_lm_loss(model: nn.Module, mesh) -> None:
    """Give ``model`` (a HF ``PreTrainedModel``) the :class:`SPCausalLMLoss` as its
    ``loss_function``; a model whose loss is another one gets a loss that refuses."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return  # not a HF model: it has no loss of HF's to stand in for
    from transformers.loss.loss_utils import LOSS_MAPPING

    current = model.loss_function
    if isinstance(current, SPCausalLMLoss):
        current = current.replaced or LOSS_MAPPING["ForCausalLM"]
    model.loss_function = SPCausalLMLoss(
        mesh, None if current is LOSS_MAPPING["ForCausalLM"] else current, loss_arguments(model),
        model)
    old = getattr(model, "_sp_own_loss_hook", None)
    if old is not None:
        old.remove()
    if not _uses_loss_function(type(model)):
        model._sp_own_loss_hook = model.register_forward_pre_hook(_refuse_own_loss,
                                                                  with_kwargs=True)


def _uses_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss through ``self.loss_function`` (read from
    its source: transformers 5.13's Gemma3ForConditionalGeneration computes a cross-entropy
    of its own instead, which on the pieces would be this rank's loss alone)."""
    import inspect

    try:
        return "loss_function" in inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return False


def _refuse_own_loss(module, args, kwargs):
    if instance_method(module) is not None:  # apply_sp_loss's forward computes the loss
        return
    if of_module(module).bind(args, kwargs).named.get("labels") is not None:
        raise ValueError(f"{type(module).__name__}.forward computes its loss itself, not "
                         f"through loss_function, so labels= on the pieces would give this "
                         f"rank's loss alone; use arctic.apply_sp_loss (the model then takes "
                         f"shift_labels from arctic.prepare_sp_batch), or compute the loss "
                         f"from the logits with arctic.sp_token_loss")
