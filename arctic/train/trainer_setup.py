"""What :class:`arctic.train.trainer.SequenceParallelMixin` reads and checks around the
Trainer: the default collate (:class:`Collate`), the checkpoint a resume starts from
(:func:`resolve_checkpoint`), the arguments SP cannot give their effect
(:func:`refuse_what_sp_cannot_give`), the DeepSpeed config handed on without the SP keys,
and the callback that keeps the loader's epoch."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from arctic.data.loader import SequenceParallelDataLoader
from arctic.export import TRAINER_STATE, trainer_checkpoint_complete
from arctic.train.fields import refuse_unsupported_arguments


@dataclasses.dataclass(frozen=True)
class Collate:
    """The default collate: the samples' values stacked, key by key (strings and None left
    out), as HF's default collator does. With ``remove_unused_columns`` (HF's default) the
    keys that the model's own forward does not name go first, as HF's column removal drops
    them; what is left is cut by :mod:`arctic.data`, which refuses a key it does not read."""

    keep: frozenset[str] | None
    """The keys kept; None: all."""

    @classmethod
    def of(cls, model, remove_unused_columns: bool) -> "Collate":
        if not remove_unused_columns:
            return cls(None)
        names = inspect.signature(type(model).forward).parameters
        return cls(frozenset(names) | {"labels", "label", "label_ids"})

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        first = features[0]
        return {k: torch.stack([torch.as_tensor(f[k]) for f in features]) for k in first
                if (self.keep is None or k in self.keep) and
                first[k] is not None and not isinstance(first[k], str)}


def stock_collator(collate) -> bool:
    """Whether ``collate`` is the Trainer's own default (no collator of the trainer class's)."""
    from transformers.data.data_collator import (
        DataCollatorWithPadding,
        default_data_collator,
    )

    return collate is default_data_collator or isinstance(collate, DataCollatorWithPadding)


class ShuffleLikeTheEpoch(TrainerCallback):
    """Sets the train loader's epoch (its shuffle) at each epoch's start, from the step count
    as the Trainer counts epochs. The Trainer sets it too, on the loader it holds; but to
    resume mid-epoch it iterates a loader that accelerate rebuilt around our batch sampler,
    whose epoch not every transformers version sets (5.13 does not)."""

    def on_epoch_begin(self, args, state, control, *, train_dataloader=None, **event):
        # ``event``: the rest of what the Trainer hands every callback (model, optimizer,
        # ...), which this one does not need.
        if isinstance(train_dataloader, SequenceParallelDataLoader):
            accumulate = args.gradient_accumulation_steps
            n = len(train_dataloader)
            per_epoch = max(n // accumulate + int(n % accumulate > 0), 1)
            train_dataloader.set_epoch(state.global_step // per_epoch)


def check_trainer_world(args) -> None:
    """``ValueError`` when the launcher started more processes than the Trainer trains on: on a
    machine without GPUs, ``TrainingArguments`` without ``use_cpu=True`` makes each process a
    world of its own (the SP size would not divide it, and the error would not say why)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        hint = ("; on a machine without GPUs, TrainingArguments(use_cpu=True) makes the "
                "Trainer run on every process (gloo)" if not torch.cuda.is_available() else "")
        raise ValueError(f"the Trainer sees a world of {args.world_size} process(es), but the "
                         f"launcher started {launched} (WORLD_SIZE){hint}")


def resolve_checkpoint(resume_from_checkpoint, output_dir: str):
    """What to resume from: ``True`` is the newest complete ``checkpoint-N`` in
    ``output_dir`` (a newer one whose writing was interrupted is passed over); a path must be
    a complete checkpoint. ``ValueError`` otherwise; every rank reads the same files, so every
    rank raises, before any collective."""
    if not resume_from_checkpoint:
        return resume_from_checkpoint
    if resume_from_checkpoint is True:
        pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
        found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                        if (m := pattern.match(name)) and
                        os.path.isdir(os.path.join(output_dir, name)))
                       if os.path.isdir(output_dir) else [], reverse=True)
        for _, name in found:
            if trainer_checkpoint_complete(os.path.join(output_dir, name)):
                return os.path.join(output_dir, name)
        raise ValueError(f"train(resume_from_checkpoint=True): no complete checkpoint in "
                         f"{output_dir} (found {[name for _, name in found]}; a complete one "
                         f"has its {TRAINER_STATE})")
    if not trainer_checkpoint_complete(resume_from_checkpoint):
        raise ValueError(f"train(resume_from_checkpoint={str(resume_from_checkpoint)!r}): not a "
                         f"complete checkpoint (no readable {TRAINER_STATE}; its writing "
                         f"was interrupted, or it is not a checkpoint-N directory); "
                         f"resume_from_checkpoint=True takes the newest complete one")
    return resume_from_checkpoint


def hand_deepspeed_plain_config(args, ds_config: dict) -> None:
    """Rebuild the arguments' DeepSpeed config without the SP keys (the way the Trainer
    itself rebuilds it for hyperparameter sweeps)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args.deepspeed = ds_config
    args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(ds_config)
    args.hf_deepspeed_config.trainer_config_process(args)
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)


def refuse_what_sp_cannot_give(args, kwargs: dict) -> None:
    """A ValueError naming the first Trainer argument or ``TrainingArguments`` field that SP
    cannot give its effect (:mod:`arctic.train.fields`)."""
    refuse_unsupported_arguments(args)
    strategy = args.train_sampling_strategy
    if strategy not in ("random", "sequential"):
        raise ValueError(f"TrainingArguments(train_sampling_strategy={strategy!r}) is not "
                         f"supported by SequenceParallelTrainer: its loader splits samples over "
                         f"the data-parallel ranks only, shuffled or in order; use 'random' or "
                         f"'sequential'")
    if kwargs.get("model_init") is not None:
        raise ValueError("SequenceParallelTrainer does not support model_init: sequence "
                         "parallelism is applied to the model given as model=, once")
    if kwargs.get("compute_loss_func") is not None:
        raise ValueError("SequenceParallelTrainer does not support compute_loss_func: it needs "
                         "the model's whole logits, which the tiled SP loss never "
                         "materialises. Leave it out")
    if kwargs.get("compute_metrics") is not None and \
            kwargs.get("preprocess_logits_for_metrics") is None:
        raise ValueError("SequenceParallelTrainer runs compute_metrics on what "
                         "preprocess_logits_for_metrics makes of each tile of the logits (the "
                         "whole [batch, seq, vocab] logits are never materialised); give "
                         "preprocess_logits_for_metrics too, e.g. lambda logits, labels: "
                         "logits.argmax(-1)")
