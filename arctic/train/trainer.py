"""``SequenceParallelTrainer``: the HF Trainer with sequence parallelism.

A ``transformers.Trainer`` subclass. It reads the SP settings from the same DeepSpeed JSON
given as ``TrainingArguments(deepspeed=...)``, so a DeepSpeed user changes one class name:

    args = TrainingArguments(..., deepspeed="configs/cpu_demo.json")
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ev)
    trainer.train()

What it changes, and nothing else:

- the model: SP attention, tiled MLP, checkpointing, and a forward that returns the SP loss
  (``arctic.loss.apply_sp_loss``), before the Trainer wraps it;
- the dataloaders, train and eval: :class:`arctic.data.SequenceParallelDataLoader`, so the
  ranks of an SP group read the same samples and evaluation also runs sequence-parallel
  (running it without SP is what runs out of memory in transformers#46868);
- the loss: the token mean over the SP group, equal on its ranks, so the logged loss (the
  Trainer's mean over ranks) is the mean over data-parallel replicas;
- gradient accumulation, as HF weighs it: ``num_items_in_batch`` counts the valid
  ``shift_labels`` of all the step's micro-batches (every rank's piece, over all ranks with
  ``average_tokens_across_devices``, else over the SP group), and each micro-batch's loss is
  its summed token loss over that count.

What SP cannot give is refused at construction, before any collective: every
``TrainingArguments`` field is classified in :mod:`arctic.train.fields` (honoured here,
done by the Trainer's own code, refused, or without effect on what is trained), and a field
it does not know is refused away from its default. Refused also: ``compute_loss_func``
(it needs the whole logits, which are never materialised), ``compute_metrics`` without
``preprocess_logits_for_metrics``, a ``train_sampling_strategy`` other than random or
sequential, ``predict()``, ``model_init`` and ``train(trial=...)``.

Metrics: ``preprocess_logits_for_metrics(logits, labels)`` runs inside the SP loss on tiles
of each rank's logits (``[B, t, V]``, and the ``[B, t]`` labels of those positions), so it
must work position by position (an argmax, a top-k, a log-probability of the label); its
outputs are gathered in sequence order over the SP group and over the data-parallel ranks,
and ``compute_metrics`` receives them with HF's unshifted labels for the whole sequence. The
labels are rebuilt from the shifted targets: the first position's and each packed document's
first token's are -100 (no causal-LM metric reads them). The loaders read ``data_seed`` (else
``seed``) and the ``dataloader_*`` fields. Resuming
(``train(resume_from_checkpoint=...)``) skips the trained batches as the Trainer does:
the SP cut is the loader's ``collate_fn``, which the loader accelerate rebuilds keeps.

Checkpoints are safe to interrupt: every rank's files are written before the main process
writes ``trainer_state.json``, the last one, so a ``checkpoint-N`` without a readable one was
interrupted; ``resume_from_checkpoint=True`` takes the newest complete checkpoint
(:func:`resolve_checkpoint`), a path to an incomplete one is refused, and a checkpoint
written again at the same step replaces the old directory whole. ``save_total_limit`` rotates
only after the new checkpoint is complete (the Trainer's own order).

SP is on inside ``train()`` and ``evaluate()`` only (:func:`arctic.remove_sequence_parallel`
and :func:`arctic.restore_sequence_parallel`): elsewhere the model is the user's own, to run
on whole sequences, generate with and save.

DeepSpeed runs inside the Trainer without our ``mpu`` (accelerate builds the engine), so it
treats every rank as data parallel: it averages gradients over all ranks (the SP loss scales
by sp to match) and must not see ``sequence_parallel_size``, with which it would size batches
for world/sp ranks while the Trainer sizes them for all. The trainer hands DeepSpeed the
config without our keys.

FSDP2 instead of DeepSpeed: ``TrainingArguments(fsdp="full_shard", fsdp_config={"version":
2})`` with the SP settings as ``sp_config=`` (a JSON path or dict of the SP keys, or a
:class:`arctic.config.SequenceParallelConfig`); the trainer shards the model itself and keeps
accelerate from wrapping or sharding it again (:mod:`arctic.train.hf_fsdp`, where every FSDP setting
is honoured or refused).

HF's ALST settings work as they are: ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=N, sp_handler=...))`` beside the DeepSpeed
config is read as ``sequence_parallel_size=N`` and the handler's attention implementation
(:mod:`arctic.train.parallelism`), and removed from the arguments before the Trainer builds its
accelerator, so accelerate installs neither DeepSpeed's Ulysses attention nor its dataloader
adapter.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from arctic.data.batch import IGNORE_INDEX
from arctic.data.loader import SequenceParallelDataLoader
from arctic.export import zero3_full_state_dict
from arctic.hf.batch import cut_documents
from arctic.hf.vlm import is_vlm, vision_inputs
from arctic.memory import allocator
from arctic.recipe import apply_sp_recipe
from arctic.removal import (
    remove_sequence_parallel,
    restore_sequence_parallel,
    sequence_parallel_on,
)
from arctic.train.deepspeed import host_limit_beside_state
from arctic.train.ds_shm import release_deepspeed_shm
from arctic.train.ds_checkpoint import (barrier, layout_of, plan_resume, set_load_universal,
                                        untie_optimizer_steps, write_layout)
from arctic.train.trainer_setup import (Collate, ShuffleLikeTheEpoch, check_trainer_world,
                                        hand_deepspeed_plain_config, refuse_what_sp_cannot_give,
                                        resolve_checkpoint, stock_collator)
from arctic.train.hf_fsdp import (
    ShardedModel,
    full_state_dict,
    hand_accelerate_no_fsdp,
    load_sharded_model,
    load_sharded_optimizer,
    read_fsdp,
    save_sharded_state,
    shard,
)
from arctic.train.parallelism import SP_KEYS, sp_settings
from ulysses import flat_mesh, gather_sequence, shard_sequence
from ulysses.mesh import axis_group, axis_size
from ulysses.patching import instance_method, replace_method


class SequenceParallelMixin:
    """Sequence parallelism for a ``transformers.Trainer`` class: put it first among the
    bases, ``class SPSFTTrainer(SequenceParallelMixin, trl.SFTTrainer)``
    (:class:`SequenceParallelTrainer` is it with ``Trainer``). The arguments are the
    trainer's own; the SP settings come from ``args.deepspeed`` (and ``parallelism_config``),
    or under FSDP2 (``args.fsdp``) from ``sp_config=``.
    With TRL's ``SFTTrainer``, its ``SFTConfig`` fields are honoured or refused as the
    Trainer's are (:data:`arctic.train.fields.SFT_FIELDS`): its dataset preparation,
    packing and padding-free collator run unchanged and feed the SP loaders (packed documents
    become the attention's documents), and the completion and assistant masks reach the loss
    through the labels. Its token accuracy and entropy logs need the whole logits, which are
    never materialised: they are not logged."""

    def __init__(self, model=None, args=None, data_collator=None, *, sp_config=None,
                 **kwargs) -> None:
        fsdp = read_fsdp(args) if args is not None else None
        if args is None or not (args.deepspeed or fsdp):
            raise ValueError("SequenceParallelTrainer reads its settings from "
                             "TrainingArguments(deepspeed=<config with sequence_parallel_size>, "
                             "or parallelism_config=ParallelismConfig(sp_size=...) beside it), "
                             "or trains under FSDP2: TrainingArguments(fsdp='full_shard', "
                             "fsdp_config={'version': 2}) with sp_config=<SP settings>")
        refuse_what_sp_cannot_give(args, kwargs)
        check_trainer_world(args)
        if model is None:
            raise ValueError("SequenceParallelTrainer needs model= (a HF causal LM)")
        # HF's ALST settings (accelerate's ParallelismConfig) are read here; accelerate gets
        # the arguments without them, so it installs none of DeepSpeed's Ulysses pieces.
        ds, sp = sp_settings(args, sp_config)
        if getattr(args, "parallelism_config", None) is not None:
            args.parallelism_config = None
        allocator.use_expandable_segments()  # arctic.memory.allocator: unless the user set it
        if getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing or \
                (fsdp is not None and fsdp.activation_checkpointing):
            # TrainingArguments(activation_checkpointing=True), or its older name
            # gradient_checkpointing, means ours (non-reentrant, per layer, offload as
            # configured); HF's own would checkpoint every layer a second time.
            sp = dataclasses.replace(sp, activation_checkpointing=True)
            args.gradient_checkpointing = False
            if hasattr(args, "activation_checkpointing"):
                args.activation_checkpointing = False
        self.sp_config = sp
        self.sp_mesh = sp.dims(args.world_size).build_mesh(args.device.type)
        apply_sp_recipe(model, config=sp, mesh=self.sp_mesh, averaged_over_sp=True,
                        host_memory_limit=host_limit_beside_state(ds, sp, model, self.sp_mesh))
        self._fsdp = fsdp
        if fsdp is not None:
            shard(model, self.sp_mesh, fsdp)
            hand_accelerate_no_fsdp(args)
        else:
            hand_deepspeed_plain_config(args, {k: v for k, v in ds.items() if k not in SP_KEYS})
        self._full_state = None
        self._universal_resume = False  # a DeepSpeed resume from a universal checkpoint
        self._sp_collate = data_collator or Collate.of(model, args.remove_unused_columns)
        # a VLM's batches are cut with its vision inputs (each rank's own images)
        self._sp_vision = vision_inputs(model) if is_vlm(model) else None
        ours = instance_method(model)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        if fsdp is None:
            release_deepspeed_shm()  # a CPU job's shared-memory buffers: mapped, names go
        if instance_method(model) is not ours:
            # The trainer class after this one replaced the forward: TRL's SFTTrainer puts its
            # fused LM head there (log-probabilities in chunks, for its loss and its accuracy
            # and entropy logs). Under SP the forward is the tiled SP loss, and compute_loss
            # (here) never asks for the fused head: the SP forward goes back.
            replace_method(model, ours)
        if data_collator is None and not stock_collator(self.data_collator):
            # the trainer class's own collator (TRL's padding-free one makes the packed
            # documents' position ids): the SP loaders cut what it makes
            self._sp_collate = self.data_collator
        # The SP loss takes num_items_in_batch (its divisor): the Trainer then leaves the
        # accumulated loss undivided by the accumulation steps, as for HF's own losses.
        self.model_accepts_loss_kwargs = True
        # SP runs inside train() and evaluate(); elsewhere the model is the user's own.
        remove_sequence_parallel(model)
        self.add_callback(ShuffleLikeTheEpoch())
        # preprocess_logits_for_metrics runs inside the SP loss, on tiles of the logits; the
        # Trainer's loop must not run it again on what comes out.
        self._sp_preprocess, self.preprocess_logits_for_metrics = \
            self.preprocess_logits_for_metrics, None

    @contextmanager
    def _sequence_parallel(self):
        """SP on the model for the duration (nested calls: the outermost takes it off)."""
        was_on = sequence_parallel_on(self.model)
        restore_sequence_parallel(self.model)
        try:
            yield
        finally:
            if not was_on:
                remove_sequence_parallel(self.model)

    def get_train_dataloader(self) -> SequenceParallelDataLoader:
        if self.train_dataset is None:
            raise ValueError("SequenceParallelTrainer needs a train_dataset")
        # (train_sampling_strategy was checked when the trainer was built)
        return self._sp_loader(self.train_dataset, self.args.per_device_train_batch_size,
                               shuffle=self.args.train_sampling_strategy == "random")

    def _sp_loader(self, dataset, batch_size: int, shuffle: bool) -> SequenceParallelDataLoader:
        # data_seed seeds the sampler when given, as in the Trainer's own sampler; the workers
        # collate, and the SP pieces are cut in this process.
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        a = self.args
        return SequenceParallelDataLoader(
            dataset, self.sp_mesh, batch_size=batch_size, collate_fn=self._sp_collate,
            vision=self._sp_vision, shuffle=shuffle, seed=seed, drop_last=a.dataloader_drop_last,
            num_workers=a.dataloader_num_workers, pin_memory=a.dataloader_pin_memory,
            persistent_workers=a.dataloader_persistent_workers,
            prefetch_factor=a.dataloader_prefetch_factor,
            # transformers 5.24's fields; none before
            multiprocessing_context=getattr(a, "dataloader_multiprocessing_context", None),
            in_order=getattr(a, "dataloader_in_order", True))

    def get_eval_dataloader(self, eval_dataset=None) -> SequenceParallelDataLoader:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("SequenceParallelTrainer.evaluate needs an eval_dataset")
        if isinstance(dataset, dict):
            raise ValueError("pass one eval dataset at a time to SequenceParallelTrainer")
        return self._sp_loader(dataset, self.args.per_device_eval_batch_size, False)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, and HF's ``num_items_in_batch`` for them: the valid
        ``shift_labels`` of every piece, summed over all ranks (each token lives on one rank
        of its SP group) with ``average_tokens_across_devices``, else over the SP group."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        # int64: exact at any length (float32 counts stop being exact past 2**24 tokens)
        count = sum(b["shift_labels"].ne(IGNORE_INDEX).sum() for b in batches).to(device)
        if dist.is_initialized():
            group = (None if self.args.average_tokens_across_devices else
                     flat_mesh(self.sp_mesh, "sp").get_group())
            dist.all_reduce(count, group=group)
        return batches, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The model's forward is the SP loss already: the SP group's summed token loss over
        # num_items_in_batch (or over the group's own count), equal on the group's ranks.
        if num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        loss = model(**inputs)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            # As HF multiplies by the number of processes: the count spans every data-parallel
            # replica, and the ranks' mean (logged, and DeepSpeed's gradient average) must
            # add the replicas up. The SP loss already accounts for the SP ranks.
            loss = loss * axis_size(self.sp_mesh, "dp")
        return (loss, {"loss": loss}) if return_outputs else loss

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        if trial is not None:
            raise ValueError("SequenceParallelTrainer.train(trial=...) is not supported: a "
                             "hyperparameter search rebuilds the model with model_init, "
                             "which sequence parallelism is not applied to")
        # the newest complete checkpoint (one whose writing was interrupted is passed over)
        resume_from_checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint and self._fsdp is None:
            # DeepSpeed's shards load at the world size and ZeRO stage they were written at;
            # at another layout, from their universal conversion, or refused (naming the
            # conversion command) on every rank before any collective
            config = self._deepspeed_config()
            given = config.get("checkpoint") or {}
            plan = plan_resume(resume_from_checkpoint, None, self._deepspeed_layout(),
                               load_universal=bool(given.get("load_universal")))
            if plan.universal and not given.get("load_universal"):
                # read when accelerate builds the engine; switched off after the load
                config["checkpoint"] = {**given, "load_universal": True}
                self._universal_resume = True
        with self._sequence_parallel():
            return super().train(resume_from_checkpoint,
                                 ignore_keys_for_eval=ignore_keys_for_eval)

    def _save_checkpoint(self, model, trial):
        # A checkpoint-N left by an interrupted write (or by an earlier run that reached the
        # same step) goes first: none of its files may outlive into the new one (an RNG file
        # of a rank that no longer exists, a stale shard).
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            shutil.rmtree(folder)
        barrier()
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        # Every rank's files are written before the main process writes trainer_state.json,
        # the last file of a checkpoint: its presence is what makes the checkpoint complete
        # (resolve_checkpoint).
        barrier()
        if self._fsdp is None and self.args.should_save:
            # the layout DeepSpeed's shards were written at, which a resume compares with its own
            write_layout(output_dir, None, self._deepspeed_layout(),
                         global_steps=self.state.global_step)

    def _deepspeed_config(self) -> dict:
        """The DeepSpeed config accelerate builds the engine from."""
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def _deepspeed_layout(self):
        # under the Trainer DeepSpeed has no SP mpu: ZeRO partitions over every rank
        return layout_of(self._deepspeed_config(), world_size=self.args.world_size,
                         sequence_parallel_size=self.sp_config.sequence_parallel_size,
                         sp_mpu=False)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._fsdp is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # the model's and the optimizer's shards, every rank's (the Trainer's own code would
        # write the main process's optimizer shard alone), and the scheduler
        save_sharded_state(self.model, self.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._fsdp is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_sharded_model(self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._fsdp is None or checkpoint is None:
            # (under DeepSpeed the Trainer has just loaded the engine's checkpoint)
            engine = getattr(self, "deepspeed", None)
            if checkpoint is not None and engine is not None and \
                    engine.load_universal_checkpoint():
                untie_optimizer_steps(engine)
            if self._universal_resume:
                set_load_universal(engine, False)
                self._universal_resume = False
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_optimizer(self.model, self.optimizer, checkpoint)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self):
        if self._fsdp is None:
            # a best checkpoint written before a resume at another layout loads universally
            plan = plan_resume(self.state.best_model_checkpoint, None, self._deepspeed_layout())
            before = set_load_universal(self.deepspeed, plan.universal)
            try:
                return super()._load_best_model()
            finally:
                set_load_universal(self.deepspeed, before)
        load_sharded_model(self.model, self.state.best_model_checkpoint)

    def _wrap_model(self, model, training=True, dataloader=None):
        # Under FSDP2 the model is sharded already: accelerate must neither wrap it in DDP nor
        # shard it again (nor wrap its forward in autocast), and the Trainer leaves a model
        # that _wrap_model wrapped unprepared, in training and in evaluation.
        if self._fsdp is None:
            return super()._wrap_model(model, training, dataloader)
        return model if isinstance(model, ShardedModel) else ShardedModel(self.model)

    def save_model(self, output_dir=None, _internal_call=False):
        if self._fsdp is None:
            engine = getattr(self, "deepspeed", None)
            if engine is not None and engine.zero_optimization_partition_weights() and \
                    not engine.zero_gather_16bit_weights_on_model_save():
                # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the Trainer would
                # write a DeepSpeed checkpoint instead of the weights. Gathered one parameter
                # at a time (every rank), the main process writes the full HF weights.
                state = zero3_full_state_dict(engine)
                self._save(output_dir or self.args.output_dir, state_dict=state)
                if self.args.push_to_hub and not _internal_call:
                    self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
                return None
            return super().save_model(output_dir, _internal_call)
        # Every rank gathers the whole state (a collective); the main process writes it.
        self._full_state = full_state_dict(self.model)
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            self._full_state = None

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None and self._full_state is not None:
            state_dict = self._full_state
        return super()._save(output_dir, state_dict=state_dict)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        with self._sequence_parallel():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        raise ValueError("SequenceParallelTrainer.predict is not supported: the tiled loss never "
                         "materialises the logits. Use evaluate() for the loss; for "
                         "predictions, use the trained model itself (sequence parallelism is "
                         "off outside train() and evaluate()), e.g. with a plain Trainer")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        if prediction_loss_only or self._sp_preprocess is None:
            with torch.no_grad():
                return model(**inputs).detach(), None, None
        # Metrics: the preprocessed logits of the whole sequence, in order, on every rank of
        # the SP group, and HF's unshifted labels rebuilt from the shifted ones.
        cut = cut_documents(self.sp_mesh, inputs, *inputs["shift_labels"].shape)
        with torch.no_grad():
            full = gather_sequence(inputs["shift_labels"], self.sp_mesh, dim=1, segments=cut)
            labels = torch.cat([torch.full_like(full[:, :1], IGNORE_INDEX), full[:, :-1]], 1)
            out = model(**inputs, labels=shard_sequence(labels, self.sp_mesh, dim=1,
                                                        segments=cut),
                        logits_fn=self._sp_preprocess, return_dict=True)
            return (out.loss.detach(),
                    gather_sequence(out.logits, self.sp_mesh, dim=1, segments=cut), labels)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None,
                        ignore_keys=None, metric_key_prefix="eval"):
        # Each SP group's ranks hold the same predictions: gather them over the data-parallel
        # ranks only (the Trainer resets its gather function at the end of the loop).
        self.gather_function = self._gather_over_dp
        return super().evaluation_loop(dataloader, description, prediction_loss_only,
                                       ignore_keys, metric_key_prefix)

    def _gather_over_dp(self, tensor):
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self._gather_over_dp(t) for t in tensor)
        dp = axis_size(self.sp_mesh, "dp")
        if dp == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(dp)]
        dist.all_gather(pieces, tensor.contiguous(), group=axis_group(self.sp_mesh, "dp"))
        return torch.cat(pieces)


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` with the sequence parallelism named in ``args.deepspeed`` (or,
    under FSDP2, in ``sp_config=``)."""
