"""The fixed order of the ``apply_*`` functions, recorded on the model and enforced.

The memory features wrap one another, so they compose in one order only:

1. SP attention (:func:`arctic.apply_sequence_parallel`);
2. tiling (:func:`arctic.apply_tiled_mlp`, :func:`arctic.apply_sp_loss`);
3. activation checkpointing and offload (:func:`arctic.apply_activation_checkpointing`);
4. parameter sharding (:func:`arctic.train.fsdp.apply_fsdp`, or DeepSpeed ZeRO through
   :func:`arctic.initialize`).

Why: checkpointing must wrap the tiled MLP and the SP attention so that its recompute runs
them; FSDP2 must see the checkpointed layer so that its pre-backward unshard precedes the
recompute. Applying a stage after a later one would leave the earlier wrapper outside, where
it silently does nothing useful (tiles that checkpointing already saved whole) or breaks
(parameters that are already sharded). Every ``apply_*`` calls :func:`record_apply` first.

The order lives in ``arctic``, beside :func:`arctic.recipe.apply_sp_recipe` that follows it,
because telling which stages a model already has means knowing FSDP2, DeepSpeed ZeRO and HF
checkpointing; ``offload`` stays torch-only.
"""

from __future__ import annotations

from torch import nn

from arctic.hf.anatomy import hf_checkpointing

STAGES = ("sp_attention", "tiling", "checkpointing", "sharding")
_ATTR = "_sp_applied_stages"


def applied_stages(model: nn.Module) -> set[str]:
    """The stages applied to ``model``: recorded ones, plus sharding or checkpointing that was
    applied by hand (``fully_shard``, a DeepSpeed ZeRO-3 partition, HF's
    ``gradient_checkpointing_enable``)."""
    from torch.distributed.fsdp import FSDPModule

    stages = set(getattr(model, _ATTR, ()))
    if any(isinstance(m, FSDPModule) for m in model.modules()) or \
            any(hasattr(p, "ds_id") for p in model.parameters()):
        stages.add("sharding")
    if hf_checkpointing(model):
        stages.add("checkpointing")
    return stages


def record_apply(model: nn.Module, stage: str) -> None:
    """Record that ``stage`` is being applied to ``model``.

    Raises ``ValueError`` when a later stage is already applied; the model is unchanged then.
    Applying the same stage again (e.g. the tiled MLP and then the tiled loss) is allowed.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    done = applied_stages(model)
    later = [s for s in STAGES[STAGES.index(stage) + 1:] if s in done]
    if "checkpointing" in later and "checkpointing" not in getattr(model, _ATTR, ()):
        raise ValueError(
            f"HF gradient checkpointing is on for {type(model).__name__} "
            f"(model.gradient_checkpointing_enable() or, in transformers 5, "
            f"activation_checkpointing_enable(); or TrainingArguments("
            f"gradient_checkpointing=True) outside the Trainer plugin): arctic checkpoints "
            f"each decoder layer itself, after sequence parallelism (non-reentrant, with the "
            f"layer inputs offloaded when asked). Call model.gradient_checkpointing_disable() "
            f"(activation_checkpointing_disable()), or leave out the call, and set "
            f"\"activation_checkpointing\": true in the DeepSpeed config's \"ulysses\" block "
            f"(arctic.initialize, the recipe), "
            f"or call arctic.apply_activation_checkpointing(model) after {stage}")
    if later:
        raise ValueError(f"cannot apply {stage} to {type(model).__name__}: {', '.join(later)} "
                         f"is already applied. The order is {' -> '.join(STAGES)}; apply "
                         f"{stage} to the model before {later[0]}")
    # One list per model, extended in place: a stage applied after the recipe (FSDP2 by the
    # Trainer) leaves the entry the recipe's journal recorded (arctic.removal) as it was.
    recorded = vars(model).get(_ATTR)
    if recorded is None:
        recorded = []
        setattr(model, _ATTR, recorded)
    recorded[:] = sorted(done | {stage}, key=STAGES.index)


__all__ = ["STAGES", "applied_stages", "record_apply"]
