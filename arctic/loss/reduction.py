"""How the gradient reduction that trains a model combines the ranks of its SP group.

Each rank of a sequence-parallel group computes the parameter gradients of its own piece of
the sequence. The framework that reduces gradients then either **averages** them over every
rank (dp x sp) or **adds** them over the SP ranks (and averages over dp only). The SP losses
(:mod:`arctic.loss`, :mod:`arctic.loss.router`) scale their backward by which one, so that
after the reduction the gradients are single-device training's. What reduces, and how
(DeepSpeed 0.19.8, read from its sources):

| reduction | the SP ranks are |
|---|---|
| DDP, FSDP2, a plain all-reduce mean over all ranks | averaged |
| DeepSpeed without an SP ``mpu`` (the HF Trainer through accelerate): every rank is data parallel to it | averaged |
| DeepSpeed ZeRO-0/1/2 with an SP ``mpu``: ``engine._reduce_non_expert_gradients`` and ``stage_1_and_2`` divide by ``world / sp`` | added |
| ZeRO-3 with an SP ``mpu`` and ``reduce_scatter`` (its default): ``__avg_scatter_grads`` divides by ``world`` | averaged |
| ZeRO-3 with an SP ``mpu``, ``reduce_scatter: false``, contiguous gradients and every parameter within ``reduce_bucket_size`` (what :func:`arctic.initialize` sets): ``__avg_scatter_contiguous_grads`` divides by ``world / sp`` | added |
| ZeRO-3 with an SP ``mpu`` where a parameter is larger than the bucket, or gradients are not contiguous: some buckets one way, some the other | refused |

Where the reduction adds, :func:`install_sp_gradient_average` makes it average: a forward
hook on the model scales the gradient of each of its outputs by ``1 / sp``, so that whatever
loss is computed from them (the SP loss, or a plain mean over this rank's tokens written by
the user) gets the same gradients at every ZeRO stage: the average over the dp x sp ranks,
which is single-device training's when the ranks hold equal numbers of labels.
:func:`resolve_sp_averaging` then answers "averaged" for the SP loss too.

:func:`sp_gradients_averaged` reads the answer off the model when its loss runs, so a loss
installed before ``deepspeed.initialize`` (``model.loss_function`` on the ALST path) learns
the engine that wraps it: DeepSpeed's engine hooks the module it wraps, and ZeRO marks the
parameters it owns. DeepSpeed's SP size comes from DeepSpeed's own ``groups``, which its
reductions read too (a process-wide ``mpu`` that DeepSpeed keeps from the last engine given
one). This module is the only one that reads DeepSpeed's internals for it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ulysses.torch_internals import forward_hooks


def _deepspeed_engine_hooks(model: nn.Module) -> bool:
    """Whether a DeepSpeed engine wraps ``model``: every engine registers a forward pre-hook,
    defined in ``deepspeed.runtime.engine``, on the module it wraps (any ZeRO stage)."""
    return any(getattr(h, "__module__", None) == "deepspeed.runtime.engine"
               for h in forward_hooks(model)[0].values())


def sp_gradients_averaged(model: nn.Module, sp_size: int) -> bool | None:
    """Whether the reduction that trains ``model`` averages the gradients of its SP ranks
    (True) or adds them (False); None when no framework this module knows (DeepSpeed,
    FSDP2) holds the model: DDP and a plain all-reduce mean average, which is the default.

    ``ValueError`` where DeepSpeed's reduction cannot be matched: its SP size is not
    ``sp_size``, or ZeRO-3 would reduce some buckets one way and some the other.
    """
    if sp_size == 1 or "deepspeed" not in sys.modules:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    first = params[0]
    if isinstance(first, DTensor):
        return True  # FSDP2 averages over its mesh, every rank
    zero3 = hasattr(first, "ds_id")
    zero12 = hasattr(first, "param_idx_in_group")  # set by ZeRO-1/2's optimizer on its own
    if not (zero3 or zero12 or _deepspeed_engine_hooks(model)):
        return None
    from deepspeed.utils import groups

    if zero3:
        optimizer = getattr(first, "_z3_optimizer", None)
        if optimizer is None:
            raise ValueError("the model's parameters are partitioned by ZeRO-3, but no ZeRO-3 "
                             "optimizer reduces their gradients (deepspeed.initialize without "
                             "an optimizer): the SP loss cannot train it")
        ds_sp = int(optimizer.sequence_parallel_size)
    else:
        ds_sp = int(groups._get_sequence_parallel_world_size())
    if ds_sp == 1:
        return True  # DeepSpeed treats every rank as data parallel: it averages them all
    if ds_sp != sp_size:
        raise ValueError(f"DeepSpeed reduces gradients for sequence_parallel_size={ds_sp} (its "
                         f"mpu), but the model's SP group has {sp_size} ranks; build the mpu "
                         f"from the model's mesh: ulysses.DeepSpeedMPU(mesh)")
    if not zero3:
        return False
    if optimizer.reduce_scatter:
        return True
    largest = max(int(p.ds_numel) for p in params)
    if optimizer.contiguous_gradients and largest <= optimizer.reduce_bucket_size:
        return False
    raise ValueError(f"ZeRO-3 with sequence_parallel_size={ds_sp} and reduce_scatter=false "
                     f"adds the SP ranks' gradients in contiguous buckets but averages them in "
                     f"the others (contiguous_gradients="
                     f"{optimizer.contiguous_gradients}, reduce_bucket_size="
                     f"{optimizer.reduce_bucket_size}, largest parameter {largest} elements): "
                     f"set contiguous_gradients=true and reduce_bucket_size >= {largest}, or "
                     f"leave reduce_scatter at its default (true)")


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _scaled(value, factor: float):
    if torch.is_tensor(value):
        return _ScaleGrad.apply(value, factor) \
            if value.requires_grad and value.is_floating_point() else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_scaled(v, factor) for v in value)
    if isinstance(value, dict):  # a HF ModelOutput (an OrderedDict): its fields in place
        for k in list(value.keys()):
            value[k] = _scaled(value[k], factor)
    return value


def install_sp_gradient_average(model: nn.Module, sp_size: int) -> None:
    """Make a reduction that adds the SP ranks' gradients average them instead: on each
    forward under grad where :func:`sp_gradients_averaged` finds "added" (DeepSpeed with an
    SP ``mpu`` at ZeRO-0/1/2, or ZeRO-3 as :func:`arctic.initialize` pins it), the outputs'
    gradients are scaled by ``1 / sp_size``. Nothing otherwise (DDP, FSDP2, DeepSpeed
    without an SP ``mpu``, ZeRO-3's default reduce-scatter already average)."""
    old = getattr(model, "_sp_average_hook", None)
    if old is not None:
        old.remove()
    if sp_size == 1:
        return

    def average(module, args, output):
        if torch.is_grad_enabled() and sp_gradients_averaged(module, sp_size) is False:
            return _scaled(output, 1.0 / sp_size)
        return output

    model._sp_average_hook = model.register_forward_hook(average)


def resolve_sp_averaging(model: nn.Module, sp_size: int, given: bool | None) -> bool:
    """The ``averaged_over_sp`` an SP loss of ``model`` uses: ``given`` when set (checked
    against the reduction found on the model, ``ValueError`` on a contradiction), else what
    :func:`sp_gradients_averaged` finds, else True (DDP's average). A reduction that adds is
    averaged where :func:`install_sp_gradient_average` hooks the model."""
    found = sp_gradients_averaged(model, sp_size)
    if found is False and getattr(model, "_sp_average_hook", None) is not None:
        found = True
    if given is None:
        return True if found is None else found
    if found is not None and found != given:
        how = {True: "averages", False: "adds"}
        raise ValueError(f"the SP loss was built with averaged_over_sp={given}, but the "
                         f"reduction that trains this model {how[found]} the gradients of the "
                         f"{sp_size} SP ranks (see arctic.loss.reduction); leave "
                         f"averaged_over_sp unset to follow the reduction")
    return given


__all__ = ["install_sp_gradient_average", "resolve_sp_averaging", "sp_gradients_averaged"]
