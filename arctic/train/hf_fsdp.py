"""FSDP2 under the HF Trainer: ``TrainingArguments(fsdp="full_shard", fsdp_config={"version":
2, ...})`` with :class:`arctic.train.trainer.SequenceParallelTrainer` (or the mixin), the SP
settings given as ``sp_config=`` (or ``parallelism_config``).

accelerate shards with FSDP2 only on GPUs (on CPU processes it never sets its FSDP type and
wraps the model in DDP instead), and with its own wrap policy. So the trainer shards the
model itself, the same way on every device: the SP recipe, then :func:`arctic.apply_fsdp`
over every rank (dp x sp), one unit per decoder layer. accelerate gets the arguments without
FSDP, and the Trainer trains the model through :class:`ShardedModel`, a wrapper it does not
know, so that it neither wraps it in DDP nor shards it again (the Trainer's own hook for
models it must not wrap, ``_wrap_model``). Gradients are reduce-scattered once per optimizer
step (``no_sync`` defers them over the accumulated micro-batches).

Each FSDP setting is honoured or refused (:func:`read_fsdp`):

- ``version``: 2 (FSDP1 is refused);
- ``reshard_after_forward``: honoured (``fsdp="shard_grad_op"`` sets it False);
- ``cpu_offload`` (``fsdp="full_shard offload"``): honoured, as FSDP2's ``CPUOffloadPolicy``
  (pinned where an accelerator is present);
- ``activation_checkpointing``: ours (per layer, offload as the SP settings say), as for
  ``gradient_checkpointing``;
- ``auto_wrap_policy``: the transformer-layer policy is the per-layer units here; the
  ``transformer_layer_cls_to_wrap`` given must name the model's decoder layer class. A size
  policy or no wrapping is refused;
- ``state_dict_type``: ``FULL_STATE_DICT``; ``save_model`` gathers the whole state on every
  rank and the main process writes it. Sharded state dicts are refused;
- ``cpu_ram_efficient_loading``: refused (the model is given whole, not loaded on rank 0);
- ``xla`` is refused (``hybrid_shard`` is FSDP1's, which transformers refuses for FSDP2).

Checkpoints hold the whole training state, and resume at another layout. Each
``checkpoint-N`` holds, beside what the Trainer writes itself (``trainer_state.json``, the
scheduler, each rank's RNG state ``rng_state_R.pth``, and the full weights, which
``from_pretrained`` and ``python -m arctic.export`` read), a ``torch.distributed.checkpoint``
directory :data:`DCP_DIR` with the model's and the optimizer's shards. Every rank writes its
shards there (so the directory must be shared by the ranks: ``save_on_each_node`` is
refused), and DCP reshards them on load: a checkpoint written by W ranks at SP degree s
resumes on W' ranks at s'. ``resume_from_checkpoint`` and ``load_best_model_at_end`` load
from it.

Precision: ``bf16=True`` is FSDP2's mixed precision, as accelerate's FSDP2 has it: each
layer's parameters are gathered as bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), so the forward and backward run in bfloat16, while the sharded
parameters, their gradients and the optimizer stay float32. accelerate's autocast is not
used (the Trainer gets it by wrapping the forward of a model accelerate prepares, and this
one is not). fp16 (which FSDP2 would need a sharded gradient scaler for) and the
``*_full_eval`` casts (which would cast the float32 shards themselves) are refused.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from arctic.hf.anatomy import decoder_layers
from arctic.train.fsdp import apply_fsdp

_KNOWN = {"fsdp_version", "reshard_after_forward", "cpu_offload", "activation_checkpointing",
          "auto_wrap_policy", "transformer_cls_names_to_wrap", "state_dict_type",
          "cpu_ram_efficient_loading", "min_num_params"}
"""What transformers' ``TrainingArguments`` hands accelerate's FSDP plugin
(``fsdp_plugin_args``), 5.13 to 5.24; anything else is refused by name."""


@dataclass(frozen=True)
class FsdpSettings:
    reshard_after_forward: bool
    cpu_offload: bool
    activation_checkpointing: bool
    layer_classes: tuple[str, ...] | None
    """The ``transformer_layer_cls_to_wrap`` names given (checked against the model), or None."""
    bf16: bool
    """Gather the parameters as bfloat16 (FSDP2's mixed precision), reduce in float32."""


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"TrainingArguments({what}) is not supported by SequenceParallelTrainer "
                      f"under FSDP2: {why}")


def read_fsdp(args) -> FsdpSettings | None:
    """The FSDP2 settings of ``args`` (None without ``fsdp``); ``ValueError`` for what cannot
    be honoured. Call before the Trainer is built; :func:`hand_accelerate_no_fsdp` then takes
    FSDP out of the arguments."""
    if not args.fsdp:
        return None
    if args.deepspeed:
        raise ValueError("TrainingArguments(fsdp=..., deepspeed=...): give one of them (the "
                         "Trainer refuses both together)")
    config = dict(args.fsdp_config or {})
    if config.get("xla") or config.get("xla_fsdp_v2"):
        raise _refuse("fsdp_config={'xla': True}", "XLA's FSDP is not this trainer's")
    plugin = dict(args.fsdp_plugin_args or {})
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ValueError("SequenceParallelTrainer applies FSDP2 itself from TrainingArguments("
                         "fsdp=..., fsdp_config=...); launched with an accelerate FSDP config "
                         "(ACCELERATE_USE_FSDP=true), accelerate would shard the model again. "
                         "Launch with torchrun or a plain multi-process accelerate config")
    if int(plugin.get("fsdp_version", 1)) != 2:
        raise _refuse(f"fsdp_config={{'version': {plugin.get('fsdp_version')}}}",
                      "only FSDP2 (version 2) is supported")
    unknown = sorted(set(plugin) - _KNOWN)
    if unknown:
        raise _refuse(f"fsdp_config with {unknown}", "these settings are not known here")
    policy = plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP":
        raise _refuse(f"fsdp_config={{'auto_wrap_policy': {policy!r}}}",
                      "each decoder layer is one FSDP unit (TRANSFORMER_BASED_WRAP)")
    if plugin.get("state_dict_type", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        raise _refuse(f"fsdp_config={{'state_dict_type': {plugin['state_dict_type']!r}}}",
                      "save_model writes the full state dict (FULL_STATE_DICT)")
    if plugin.get("cpu_ram_efficient_loading"):
        raise _refuse("fsdp_config={'cpu_ram_efficient_loading': True}",
                      "the model is given to the trainer whole, on every rank")
    if args.fp16:
        raise _refuse("fp16=True", "FSDP2 would need a sharded gradient scaler; use bf16")
    for name in ("bf16_full_eval", "fp16_full_eval"):
        if getattr(args, name, False):
            raise _refuse(f"{name}=True", "it would cast the sharded float32 parameters "
                          "themselves; evaluation runs in the training precision")
    if args.save_only_model and args.load_best_model_at_end:
        # (the Trainer refuses this under its own FSDP, which it does not see here)
        raise _refuse("save_only_model=True with load_best_model_at_end=True", "the best "
                      "checkpoint is loaded from its sharded state, which save_only_model does "
                      "not write")
    if args.save_on_each_node and args.save_strategy != "no":
        raise _refuse("save_on_each_node=True", "every rank writes its shards of the model and "
                      "the optimizer into the checkpoint, so the checkpoint directory must be "
                      "one that all the ranks share")
    names = plugin.get("transformer_cls_names_to_wrap")
    return FsdpSettings(
        reshard_after_forward=bool(plugin.get("reshard_after_forward", True)),
        cpu_offload=bool(plugin.get("cpu_offload", False)),
        activation_checkpointing=bool(plugin.get("activation_checkpointing", False)),
        layer_classes=tuple(n.strip() for n in names.split(",")) if names else None,
        bf16=bool(args.bf16))


def hand_accelerate_no_fsdp(args) -> None:
    """Take FSDP out of ``args`` before the Trainer builds its accelerator (the trainer shards
    the model itself)."""
    args.fsdp = []
    args.fsdp_plugin_args = None


def shard(model: nn.Module, mesh, settings: FsdpSettings) -> None:
    """:func:`arctic.apply_fsdp` with ``settings``, after checking the wrapped class names."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if settings.layer_classes is not None:
        own = sorted({type(m).__name__ for m in decoder_layers(model)})
        if sorted(set(settings.layer_classes)) != own:
            raise _refuse(f"fsdp_config={{'transformer_layer_cls_to_wrap': "
                          f"{list(settings.layer_classes)}}}",
                          f"the FSDP units are the model's decoder layers, {own}; name those, "
                          f"or leave it out")
    offload = (CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
               if settings.cpu_offload else None)
    mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if settings.bf16 else None)
    apply_fsdp(model, mesh=mesh, reshard_after_forward=settings.reshard_after_forward,
               offload_policy=offload, mp_policy=mixed)


class ShardedModel(nn.Module):
    """What the Trainer trains and evaluates under FSDP2: the sharded model, in a wrapper
    accelerate does not know (so it neither wraps it in DDP, nor shards it again, nor wraps its
    forward). ``no_sync`` defers FSDP2's
    gradient reduce-scatter over the micro-batches of an accumulated step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


DCP_DIR = "dcp"
"""The ``torch.distributed.checkpoint`` directory in a ``checkpoint-N``: keys ``"model"`` and
``"optim"``, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` names them."""


def save_sharded_state(model: nn.Module, optimizer, checkpoint: str | os.PathLike) -> None:
    """Write the shards of ``model`` and ``optimizer`` into ``checkpoint``/:data:`DCP_DIR`;
    every rank must call it (DCP's coordinator writes ``.metadata`` last, after every rank's
    shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd},
             checkpoint_id=os.path.join(checkpoint, DCP_DIR))


def _dcp_path(checkpoint: str | os.PathLike) -> str:
    path = os.path.join(checkpoint, DCP_DIR)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{checkpoint} holds no sharded training state ({DCP_DIR}/.metadata): it "
                         f"was not written by SequenceParallelTrainer under FSDP2, or its writing "
                         f"did not finish")
    return path


def load_sharded_model(model: nn.Module, checkpoint: str | os.PathLike) -> None:
    """Load the model's shards that :func:`save_sharded_state` wrote (at any world size and
    SP degree: DCP reshards) into the sharded ``model``; every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = _dcp_path(checkpoint)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def load_sharded_optimizer(model: nn.Module, optimizer, checkpoint: str | os.PathLike) -> None:
    """Load the optimizer's shards that :func:`save_sharded_state` wrote into ``optimizer``
    (of the sharded ``model``); every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    path = _dcp_path(checkpoint)
    state = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def full_state_dict(model: nn.Module) -> dict:
    """The whole state dict of the sharded ``model``, on the main process (empty elsewhere);
    every rank must call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


__all__ = ["DCP_DIR", "FsdpSettings", "ShardedModel", "full_state_dict",
           "hand_accelerate_no_fsdp", "load_sharded_model", "load_sharded_optimizer",
           "read_fsdp", "save_sharded_state", "shard"]
