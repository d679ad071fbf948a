"""Parameter sharding with FSDP2 (``torch.distributed.fsdp.fully_shard``) over dp x sp.

The last stage of the recipe (:mod:`arctic.order`): SP attention, tiling and the SP loss,
checkpointing, then :func:`apply_fsdp`. Every rank of the mesh is a shard rank, the SP ranks
included, so parameters, gradients and optimizer state are split ``W = dp * sp`` ways.

    mesh = config.dims(world_size).build_mesh(device_type)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    apply_fsdp(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())  # DTensor parameters, sharded

FSDP2 and DeepSpeed ZeRO are alternatives: a model or a DeepSpeed config that asks for both
is refused (:func:`check_no_zero`).

``apply_fsdp(model, mesh=mesh, offload_policy=CPUOffloadPolicy())`` keeps the sharded state on
the host: the full-precision parameter shards, their gradients and, because the optimizer
steps the parameters where they live, its state. Each layer's shard is copied to the device
just before its all-gather, and its gradient shard back to the host after the reduce-scatter;
the device holds only the gathered layers. A collective on the host-side gradients
(``clip_grad_norm_``, ``full_tensor()``) needs a process group with a CPU backend, e.g.
``init_process_group("cuda:nccl,cpu:gloo")`` (pytorch/pytorch#148532). On a CPU mesh (gloo)
nothing moves, since the host is the device, but FSDP2 takes its offload branches;
``pin_memory`` needs an accelerator (:func:`check_offload_policy`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from arctic.config import zero_stage
from arctic.hf.anatomy import decoder_layers, final_norm
from arctic.order import record_apply
from ulysses.mesh import check_mesh, flat_mesh
from ulysses.torch_internals import view_base

SHARD_AXIS = "dp_sp"
"""The flattened mesh axis spanning every rank (:meth:`SequenceParallelDims.build_mesh`)."""


def check_no_zero(ds_config: dict[str, Any]) -> None:
    """``ValueError`` if a DeepSpeed config turns on ZeRO, which FSDP2 replaces.

    Stage 0 (or no ``zero_optimization`` block) is accepted: it shards nothing.
    """
    stage = zero_stage(ds_config)
    if stage != 0:
        raise ValueError(f"FSDP2 and ZeRO cannot be mixed: the config sets "
                         f"zero_optimization.stage={stage!r}, but FSDP2 already shards "
                         f"parameters, gradients and optimizer state over every rank. Remove "
                         f"the zero_optimization block (or set its stage to 0), or train with "
                         f"DeepSpeed (examples/train.py) instead of FSDP2")


def check_offload_policy(offload_policy) -> None:
    """``ValueError`` unless ``offload_policy`` is None or a usable FSDP2 ``OffloadPolicy``.

    ``CPUOffloadPolicy(pin_memory=True)`` (its default) is refused when no accelerator is
    available: pinning host memory needs one. torch would raise ``RuntimeError: Cannot access
    accelerator device when none is available`` from inside the first ``fully_shard``, after
    :func:`apply_fsdp` has recorded the sharding stage on the model.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload_policy is None:
        return
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy (e.g. "
                         f"CPUOffloadPolicy()) or None, got {type(offload_policy).__name__} "
                         f"{offload_policy!r}")
    if (isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
            and not torch.accelerator.is_available()):
        raise ValueError("offload_policy=CPUOffloadPolicy(pin_memory=True) pins host memory, "
                         "which needs an accelerator, and none is available; pass "
                         "CPUOffloadPolicy(pin_memory=False) on a CPU-only machine")


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, reshard_after_forward: bool = True,
               mp_policy=None, offload_policy=None) -> nn.Module:
    """Shard ``model`` with FSDP2 over every rank of ``mesh``; returns ``model``.

    Each decoder layer (:func:`arctic.hf.anatomy.decoder_layers`: the modules holding a
    ``self_attn`` and an ``mlp``) becomes its own FSDP unit (all-gathered just before it runs,
    and resharded after it when ``reshard_after_forward``), as are the input embedding and
    the lm_head (one unit each, unless they share a weight) and then the final norm, and the
    root holds the rest (the final norm and the embeddings when tied). Parameters become
    ``DTensor``\\ s sharded on dim 0 over the mesh's ``"dp_sp"`` axis: every rank of an SP
    group is also a shard rank.

    Why gradients come out right: FSDP2 reduce-scatters gradients with a mean over all
    ``W = dp * sp`` ranks. Rank r's share of its sequence's gradient is
    ``d(loss_sum_r) / N`` (N = the SP group's valid tokens), so a plain mean would be ``sp``
    times too small. The SP loss's backward adds the upstream gradients of the group's ``sp``
    ranks (``averaged_over_sp=True``, which the loss also finds on the sharded model:
    :mod:`arctic.loss.reduction`), so after the reduction each parameter's gradient is the
    single-device gradient of its SP group's whole sequence, averaged over the ``dp`` groups.

    Args:
        model: a HF causal LM on the mesh's device type, after every earlier stage
            (:mod:`arctic.order`): SP attention, tiling and loss, checkpointing.
        mesh: from :meth:`ulysses.SequenceParallelDims.build_mesh`, axes
            ``("dp", "ring", "ulysses")`` plus the flattened ``"dp_sp"``.
        reshard_after_forward: free each layer's gathered parameters after its forward (and
            all-gather them again for backward); False keeps them (more memory, less traffic).
        mp_policy: an optional ``torch.distributed.fsdp.MixedPrecisionPolicy``.
        offload_policy: an optional ``torch.distributed.fsdp.OffloadPolicy``, given to every
            unit. ``CPUOffloadPolicy()`` keeps the sharded fp32 parameters, their gradients
            and the optimizer state on the host (the optimizer steps the parameters where
            they are, so build it after this call); each layer's shard is copied to the
            device for its all-gather. Device memory then holds only gathered layers and
            activations, at the price of a host-to-device copy per layer per all-gather, a
            device-to-host copy per gradient, and an optimizer step on the CPU.

    Raises ``ValueError``, before any communication and leaving the model as it was, when
    the model is under DeepSpeed ZeRO or already sharded, or has no decoder layers, or
    ``offload_policy`` is not an ``OffloadPolicy`` (:func:`check_offload_policy`).
    """
    check_offload_policy(offload_policy)
    check_mesh(mesh)
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(f"FSDP2 and ZeRO cannot be mixed: {type(model).__name__}'s parameters "
                         f"are already partitioned by DeepSpeed ZeRO (they carry ds_id). Shard "
                         f"with one of them: apply_fsdp on a plain model, or arctic.initialize "
                         f"with a zero_optimization stage")
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is already sharded with fully_shard; "
                         f"apply_fsdp must be called once, on the unsharded model")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers (modules with self_attn "
                         f"and mlp) to shard one by one")
    record_apply(model, "sharding")  # raises, changing nothing, when applied out of order
    kwargs = {"mesh": flat_mesh(mesh, SHARD_AXIS), "mp_policy": mp_policy or MixedPrecisionPolicy(),
              "offload_policy": offload_policy or OffloadPolicy()}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # The input embedding and the lm_head, when not tied, are units of their own: each is
    # gathered for its own forward and backward and its gradient reduce-scattered right after
    # its backward, as ZeRO-3 does (in the root, FSDP2 keeps them gathered from the forward to
    # the end of the backward, with the lm_head's whole gradient: three vocab-by-hidden
    # tensors for the whole backward of every layer).
    # The input embedding's backward reads no weight (it adds the output's gradient into the
    # rows it looked up), so its unit is not gathered again for it, nor prefetched during the
    # first layer's backward, where that was one vocab-by-hidden tensor more at its peak.
    embed, head = _vocab_ends(model)
    if embed is not None:
        weightless = not _backward_reads_weights(embed)
        fully_shard(embed, reshard_after_forward=reshard_after_forward, **kwargs)
        if weightless:
            embed.set_unshard_in_backward(False)
    if head is not None:
        fully_shard(head, reshard_after_forward=reshard_after_forward, **kwargs)
    # Beside an lm_head unit the final norm is one too. FSDP2 keeps a unit's reduce-scatter
    # input (the gradient in the reduce dtype) until the next unit's reduction: the norm's,
    # right after the lm_head's backward, instead of the last layer's, at the end of its
    # whole backward (vocabulary-by-hidden fp32, 3.8 GiB for Qwen3.5-9B, held through it).
    norm = final_norm(model)
    if head is not None and norm is not None and any(
            p.requires_grad for p in norm.parameters()):
        fully_shard(norm, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters (when tied: the embeddings and the final norm) are gathered in
    # its pre-forward and, being the root, kept until backward (FSDP2 does not reshard the
    # root after forward).
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def _vocab_ends(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the lm_head (HF's ``get_input_embeddings`` and
    ``get_output_embeddings``) that become units of their own: neither when they share a
    weight (one unit cannot be two), None for one the model lacks or that has no
    parameters."""
    ends = []
    for name in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, name, None)
        end = get() if callable(get) else None
        ends.append(end if isinstance(end, nn.Module) and any(True for _ in end.parameters())
                    else None)
    embed, head = ends
    if embed is not None and head is not None and (
            {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}):
        return None, None
    return embed, head


def _backward_reads_weights(module: nn.Module) -> bool:
    """Whether autograd saves any of ``module``'s parameters for its backward, seen in one
    forward of one token through a copy of it on the meta device (the module's own
    ``forward``, without hooks; its weights are neither read nor written). A forward that
    cannot run on one token that way counts as reading them."""
    clone = copy.copy(module)  # shallow: the dicts below are replaced, not changed
    clone._parameters = {k: None if p is None else nn.Parameter(p.detach().to("meta"),
                                                                requires_grad=p.requires_grad)
                         for k, p in module._parameters.items()}
    clone._buffers = {k: None if b is None else b.to("meta") for k, b in module._buffers.items()}
    params = [p for p in clone._parameters.values() if p is not None and p.requires_grad]
    saved = []

    def pack(t):
        saved.append(any(view_base(t) is p for p in params))
        return t

    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            type(module).forward(clone, ids)
    except Exception:  # noqa: BLE001 (a forward that needs more than ids: keep the default)
        return True
    return any(saved)


__all__ = ["apply_fsdp", "check_no_zero", "check_offload_policy"]
