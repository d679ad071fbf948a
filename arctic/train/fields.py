"""Every ``TrainingArguments`` field, and what :class:`arctic.train.trainer.SequenceParallelTrainer`
does with it.

Each field is one of:

- ``HONOURED``: :class:`SequenceParallelTrainer`'s own code gives it its effect (the loaders,
  the loss, accumulation, checkpointing, resume); the row names the test in which SP=2
  equals the plain Trainer with it set.
- ``TRAINER``: the Trainer's own code does it, unchanged, from what SP leaves as the plain
  Trainer has it: the same parameters, gradients and losses (optimizer, schedule, clipping,
  saving, logging of the loss).
- ``REFUSED``: a value other than the default is refused with a ``ValueError`` at
  construction (:data:`REFUSALS` says which values and why).
- ``NO_EFFECT``: it changes nothing that is trained or evaluated (paths, logging, the hub).

A field that a newer transformers adds is in none of these: a value other than its default
is refused until it is classified here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

HONOURED, TRAINER, REFUSED, NO_EFFECT = "honoured", "trainer", "refused", "no effect"

_T = "tests/test_arctic_hf_trainer.py::"
_PARITY = _T + "test_sp_trainer_matches_plain_trainer"
_ACCUMULATION = _T + "test_gradient_accumulation_weighs_tokens_like_hf"
_RESUME = _T + "test_resume_gives_the_uninterrupted_losses"
_LOADERS = _T + "test_the_loaders_read_data_seed_and_num_workers"
_FSDP = "tests/test_arctic_hf_fsdp.py::test_fsdp2_trainer_matches_plain_trainer"
_SFT = "tests/test_arctic_trl.py::test_sft_trainer_with_packing_matches_plain_sft"
_CKPT = "tests/test_arctic_hf_checkpoints.py::"
_KILLED = _CKPT + "test_killed_while_saving_resumes_from_the_previous_checkpoint"

FIELDS: dict[str, tuple[str, str]] = {
    # the loaders
    "per_device_train_batch_size": (HONOURED, _PARITY),  # 2 in its SGD case
    "per_device_eval_batch_size": (HONOURED, _PARITY),
    "dataloader_drop_last": (HONOURED, _LOADERS),
    # HF's ALST settings: read as sequence_parallel_size and the kernel (arctic.train.parallelism)
    "parallelism_config": (HONOURED, _PARITY),  # its AdamW case, where accelerate has it
    "dataloader_num_workers": (HONOURED, _LOADERS),
    "dataloader_pin_memory": (HONOURED, _LOADERS),
    "dataloader_persistent_workers": (HONOURED, _LOADERS),
    "dataloader_prefetch_factor": (HONOURED, _LOADERS),
    "dataloader_multiprocessing_context": (HONOURED, _LOADERS),
    "dataloader_in_order": (HONOURED, _LOADERS),
    "seed": (HONOURED, _LOADERS),
    "data_seed": (HONOURED, _LOADERS),
    "train_sampling_strategy": (HONOURED, _RESUME),  # random (shuffled) and sequential
    # the loss and the step
    "gradient_accumulation_steps": (HONOURED, _ACCUMULATION),
    "average_tokens_across_devices": (HONOURED, _ACCUMULATION),
    "gradient_checkpointing": (HONOURED, _PARITY),  # ours, with offload as configured
    "activation_checkpointing": (HONOURED, _PARITY),
    "ignore_data_skip": (HONOURED, _T + "test_resume_with_ignore_data_skip_is_the_plain_"
                                        "trainer_s"),
    "max_steps": (HONOURED, _RESUME),
    "num_train_epochs": (HONOURED, _RESUME),  # two epochs of 4 steps
    "deepspeed": (HONOURED, _PARITY),  # it carries the SP settings
    # FSDP2 instead of DeepSpeed (arctic.train.hf_fsdp: every setting honoured or refused there)
    "fsdp": (HONOURED, _FSDP), "fsdp_config": (HONOURED, _FSDP),
    # the Trainer's own code, on the plain Trainer's parameters, gradients and losses
    "learning_rate": (TRAINER, _PARITY), "lr_scheduler_type": (TRAINER, _PARITY),
    "lr_scheduler_kwargs": (TRAINER, _PARITY), "warmup_steps": (TRAINER, _PARITY),
    "warmup_ratio": (TRAINER, _PARITY), "optim": (TRAINER, _PARITY),
    "optim_args": (TRAINER, _PARITY), "weight_decay": (TRAINER, _PARITY),
    "adam_beta1": (TRAINER, _PARITY), "adam_beta2": (TRAINER, _PARITY),
    "adam_epsilon": (TRAINER, _PARITY), "optim_target_modules": (TRAINER, _PARITY),
    "max_grad_norm": (TRAINER, _PARITY),
    "bf16": (TRAINER, "DeepSpeed's mixed precision; under FSDP2 the Trainer's autocast"),
    "fp16": (TRAINER, "DeepSpeed's mixed precision"),
    "bf16_full_eval": (TRAINER, "the evaluated model's dtype"),
    "fp16_full_eval": (TRAINER, "the evaluated model's dtype"),
    "tf32": (TRAINER, "CUDA matmul precision"),
    "use_cache": (TRAINER, "the SP loss never keeps a KV cache in training"),
    "torch_empty_cache_steps": (TRAINER, "frees the CUDA cache"),
    "eval_strategy": (TRAINER, _PARITY), "eval_steps": (TRAINER, _PARITY),
    "eval_delay": (TRAINER, _PARITY), "eval_on_start": (TRAINER, _PARITY),
    "prediction_loss_only": (HONOURED, _PARITY),  # metrics, or the loss only
    "save_strategy": (TRAINER, _T + "test_accelerate_launch_with_the_shipped_yaml"),
    "save_steps": (TRAINER, _RESUME), "save_total_limit": (TRAINER, _KILLED),
    "save_only_model": (TRAINER, "what a checkpoint holds"),
    "save_on_each_node": (TRAINER, "where checkpoints are written"),
    "enable_jit_checkpoint": (TRAINER, "a checkpoint on SIGTERM"),
    # under FSDP2 the trainer loads the sharded model (arctic.train.hf_fsdp)
    "load_best_model_at_end": (HONOURED, _CKPT + "test_load_best_model_at_end_loads_the_best_"
                                                "checkpoint"),
    "metric_for_best_model": (TRAINER, "the eval loss is the metric there is"),
    "greater_is_better": (TRAINER, "with metric_for_best_model"),
    "restore_callback_states_from_checkpoint": (TRAINER, "callback state"),
    "full_determinism": (TRAINER, "seeds and deterministic kernels"),
    "logging_nan_inf_filter": (TRAINER, "the logged loss"),
    "eval_do_concat_batches": (TRAINER, "how the gathered predictions are kept"),
    "eval_accumulation_steps": (TRAINER, "when the gathered predictions move to the host"),
    "eval_use_gather_object": (REFUSED, ""), "include_for_metrics": (REFUSED, ""),
    "batch_eval_metrics": (REFUSED, ""),
    "remove_unused_columns": (HONOURED, _T + "test_the_default_collate_drops_what_hf_drops"),
    # refused when set (REFUSALS)
    "label_smoothing_factor": (REFUSED, ""), "label_names": (REFUSED, ""),
    "torch_compile": (REFUSED, ""), "torch_compile_backend": (REFUSED, ""),
    "torch_compile_mode": (REFUSED, ""), "use_liger_kernel": (REFUSED, ""),
    "liger_kernel_config": (REFUSED, ""), "neftune_noise_alpha": (REFUSED, ""),
    "auto_find_batch_size": (REFUSED, ""), "include_num_input_tokens_seen": (REFUSED, ""),
    "gradient_checkpointing_kwargs": (REFUSED, ""),
    "activation_checkpointing_kwargs": (REFUSED, ""), "accelerator_config": (REFUSED, ""),
    "length_column_name": (NO_EFFECT, "read by group_by_length sampling, which is refused"),
    # nothing trained or evaluated changes
    **{name: (NO_EFFECT, "output, logging, reporting or the hub") for name in (
        "output_dir", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
        "log_on_each_node", "log_level", "log_level_replica", "disable_tqdm", "report_to",
        "run_name", "project", "trackio_space_id", "trackio_bucket_id",
        "trackio_static_space_id", "push_to_hub", "hub_token", "hub_private_repo",
        "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision", "skip_memory_metrics",
        "debug", "do_train", "do_eval", "do_predict", "resume_from_checkpoint", "local_rank",
        "use_cpu")},
    **{name: (NO_EFFECT, "DDP's settings: DeepSpeed or FSDP2 runs the model") for name in (
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
        "ddp_static_graph", "ddp_backend", "ddp_timeout")},
    # TRL's SFTConfig (arctic.train.trainer.SequenceParallelMixin with trl.SFTTrainer)
    "packing": (HONOURED, _SFT), "padding_free": (HONOURED, _SFT),
    "completion_only_loss": (HONOURED, _SFT),
    "assistant_only_loss": (TRAINER, "TRL's collator masks the labels; the SP loss reads them"),
    **{name: (TRAINER, "TRL's dataset preparation and collator, unchanged; the SP loaders cut "
                       "what they make") for name in (
        "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc",
        "eos_token", "pad_token", "max_length", "truncation_mode", "shuffle_dataset",
        "packing_strategy", "pad_to_multiple_of", "eval_packing")},
    "trust_remote_code": (NO_EFFECT, "for a model given by name, which is refused"),
    "model_init_kwargs": (REFUSED, ""), "router_aux_loss_coef": (REFUSED, ""),
    "loss_type": (REFUSED, ""), "activation_offloading": (REFUSED, ""),
}


def _set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], {}, (), "no")


def _accelerate_changed(config) -> bool:
    # The SP loaders are not accelerate's: its batch splitting and dispatching never apply.
    return config is not None and (bool(getattr(config, "split_batches", False)) or
                                   bool(getattr(config, "dispatch_batches", None)) or
                                   not getattr(config, "even_batches", True))


_METRICS = "the tiled SP loss never materialises the logits"
REFUSALS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "label_smoothing_factor": (_set, "the tiled SP loss computes plain cross-entropy and "
                                     "never holds the logits HF's LabelSmoother reads. Set "
                                     "it to 0"),
    "label_names": (lambda v: _set(v) and list(v) != ["labels"],
                    "the SP batches carry the targets as labels (or shift_labels)"),
    "torch_compile": (_set, "compiling the SP model is not supported"),
    "torch_compile_backend": (_set, "compiling the SP model is not supported"),
    "torch_compile_mode": (_set, "compiling the SP model is not supported"),
    "use_liger_kernel": (_set, "Liger replaces the model's norms, MLP and loss, which SP "
                               "tiles and replaces itself"),
    "liger_kernel_config": (_set, "Liger replaces the model's norms, MLP and loss"),
    "neftune_noise_alpha": (_set, "NEFTune scales its noise by the sequence length, which "
                                  "on a sequence piece is not the sequence's"),
    "auto_find_batch_size": (_set, "it rebuilds the loaders with batch sizes the SP loaders "
                                   "do not read"),
    "include_num_input_tokens_seen": (_set, "the count would add up padded sequence pieces"),
    "gradient_checkpointing_kwargs": (_set, "checkpointing is ours (non-reentrant, per "
                                            "layer, offload from the DeepSpeed config's "
                                            "ulysses block)"),
    "activation_checkpointing_kwargs": (_set, "checkpointing is ours (per layer, offload "
                                              "from the DeepSpeed config's ulysses block)"),
    "accelerator_config": (_accelerate_changed, "split_batches, dispatch_batches and "
                                                "even_batches act on accelerate's loaders, "
                                                "and the SP loaders are not accelerate's"),
    "eval_use_gather_object": (_set, "the SP predictions are gathered as tensors over the "
                                     "data-parallel ranks"),
    "include_for_metrics": (lambda v: _set(v) and list(v) != ["loss"],
                            "the inputs are sequence pieces; only 'loss' is supported"),
    "batch_eval_metrics": (_set, "metrics are computed once, over the whole evaluation"),
    # TRL's SFTConfig
    "model_init_kwargs": (_set, "the SP trainers take a model instance, to which sequence "
                                "parallelism is applied, not a name to load"),
    "router_aux_loss_coef": (lambda v: v is not None, "TRL rewrites the model config's router "
                                                      "settings after sequence parallelism is "
                                                      "applied; set output_router_logits and "
                                                      "router_aux_loss_coef in the model's "
                                                      "config, whose router loss the SP loss "
                                                      "adds over the group"),
    "loss_type": (lambda v: v != "nll", "the tiled SP loss is the token-mean cross-entropy "
                                        "(\"nll\")"),
    "activation_offloading": (_set, "checkpointing and offload are the DeepSpeed config's "
                                    "(its ulysses block)"),
}


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def refuse_unsupported_arguments(args) -> None:
    """``ValueError`` naming the first field of ``args`` that is refused (:data:`REFUSALS`),
    or set away from its default while not classified in :data:`FIELDS`."""
    for field in dataclasses.fields(args):
        name, value = field.name, getattr(args, field.name)
        if name in REFUSALS:
            refused, why = REFUSALS[name]
            if refused(value):
                raise ValueError(f"{type(args).__name__}({name}={value!r}) is not supported by "
                                 f"SequenceParallelTrainer: {why}")
        elif name not in FIELDS and value != _default(field):
            raise ValueError(f"{type(args).__name__}({name}={value!r}): SequenceParallelTrainer "
                             f"does not know this field (newer than the transformers it was "
                             f"checked against), so it cannot say that sequence parallelism "
                             f"gives it its effect. Leave it at its default")


__all__ = ["FIELDS", "HONOURED", "NO_EFFECT", "REFUSALS", "REFUSED", "TRAINER",
           "refuse_unsupported_arguments"]
