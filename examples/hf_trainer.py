"""The HF Trainer path: ``SequenceParallelTrainer`` on the demo model and corpus.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --deepspeed configs/cpu_trainer.json
    torchrun --nproc-per-node 2 examples/hf_trainer.py --alst --deepspeed configs/cpu_alst.json
    torchrun --nproc-per-node 2 examples/hf_trainer.py --fsdp configs/cpu_trainer_fsdp.json
    python3 examples/hf_trainer.py --plain          # the same run as a plain 1-process Trainer

The SP settings come from the DeepSpeed JSON given to ``TrainingArguments(deepspeed=...)``,
or, with ``--alst``, as HF's ALST guide sets them: ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=<world>, ...))`` beside a DeepSpeed JSON
whose ``"ulysses"`` block adds tiling and offload. With ``--fsdp SP_JSON`` the Trainer runs
FSDP2 instead of DeepSpeed (``TrainingArguments(fsdp="full_shard", fsdp_config={"version":
2})``) and the SP settings are ``SequenceParallelTrainer(sp_config=SP_JSON)``.
``--documents N`` packs N documents of varied lengths into each sequence (train and eval),
in HF's packed convention (as ``DataCollatorWithFlattening`` makes it): ``position_ids``
restart at 0 at each document and a document's first token is no label, so that attention
and loss stay within documents; ``--plain --documents N`` trains the plain Trainer on the same packed
batches. ``--losses-out`` writes the logged training losses (and the eval loss) as JSON. After
training the model is the user's own again: ``--use-model DIR`` saves it to ``DIR``, runs it
on a whole sequence (logits) and generates from it, on every rank, and writes those too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

# examples/_common.py, beside this file; importing it puts the checkout on sys.path.
from _common import REPO, ByteCorpus, build_model, run_main

from arctic.config import SequenceParallelConfig  # after _common: from the checkout
from arctic.order import applied_stages
from arctic.train.trainer import SequenceParallelTrainer


class _Plain(Trainer):
    """The reference: labels are the inputs, HF's own shifted loss."""


def _plain_collate(features):
    """The samples stacked (``position_ids`` too, with ``--documents``); labels default to
    the inputs."""
    batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
    batch.setdefault("labels", batch["input_ids"])
    return batch


class _UnevenLabels(torch.utils.data.Dataset):
    """The samples with labels on their tokens 1..k only: k = 10 for even samples, 200 for odd
    ones, so that accumulated micro-batches hold very different numbers of targets."""

    def __init__(self, samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        ids = self.samples[i]["input_ids"]
        k = 10 if i % 2 == 0 else 200
        labels = torch.full_like(ids, -100)
        labels[1:k + 1] = ids[1:k + 1]
        return {"input_ids": ids, "labels": labels}


MIN_DOCUMENT = 2
"""The fewest tokens a packed document holds: its first is no label, so one more is its
first target."""


def check_documents(n: int | None, seq_len: int) -> None:
    """``ValueError`` unless ``n`` documents of at least :data:`MIN_DOCUMENT` tokens fit in a
    sequence of ``seq_len`` (``None``: no packing)."""
    if n is not None and not 1 <= n <= seq_len // MIN_DOCUMENT:
        raise ValueError(f"--documents {n}: give 1 to {seq_len // MIN_DOCUMENT} documents per "
                         f"sequence of --seq-len {seq_len} (each holds at least "
                         f"{MIN_DOCUMENT} tokens), or a longer --seq-len")


class _PackedDocuments(torch.utils.data.Dataset):
    """Each sample's sequence cut into ``n`` documents of varied lengths (at least
    :data:`MIN_DOCUMENT` tokens each), packed as ``DataCollatorWithFlattening`` packs them:
    ``position_ids`` restart at 0 at each document, and each document's first token is no
    label (-100), so that no target is predicted across a boundary. The cuts are drawn from a
    generator seeded by the sample's index: every rank and every run packs alike. ``n`` is
    checked by :func:`check_documents` first."""

    def __init__(self, samples, n: int) -> None:
        self.samples, self.n = samples, n

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        sample = self.samples[i]
        ids = sample["input_ids"]
        seq_len, n = len(ids), self.n
        # n - 1 cuts, each document MIN_DOCUMENT tokens and a random share of the rest.
        g = torch.Generator().manual_seed(i)
        spare = torch.randint(0, seq_len - MIN_DOCUMENT * n + 1, (n - 1,), generator=g)
        starts = torch.cat([torch.zeros(1, dtype=torch.long),
                            spare.sort().values + MIN_DOCUMENT * torch.arange(1, n)])
        document = torch.zeros(seq_len, dtype=torch.long)
        document[starts[1:]] = 1
        document = document.cumsum(0)  # [S]: the document each token is in
        labels = sample.get("labels", ids).clone()
        labels[starts] = -100
        return {"input_ids": ids, "labels": labels,
                "position_ids": torch.arange(seq_len) - starts[document]}


def _argmax(logits, labels):
    """preprocess_logits_for_metrics: the predicted token at each position."""
    return logits.argmax(dim=-1)


def _accuracy(prediction) -> dict:
    """compute_metrics: next-token accuracy over the labelled targets."""
    preds, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean()), "targets": int(mask.sum())}


def _use_trained_model(trainer, corpus, out: Path) -> dict:
    """What a user does with the model once trained: save it, run it on a whole sequence,
    generate from it. Every rank calls (ZeRO-3 gathers the parameters for each forward)."""
    trainer.save_model(str(out))
    ids = corpus[72]["input_ids"][None, :64]
    model = trainer.model
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids[:, :16], max_new_tokens=8, do_sample=False)
    return {"ids": ids.tolist(), "logits": logits.tolist(), "generated": generated.tolist()}


def _alst_settings(alst: bool) -> dict:
    """HF's ALST guide's ``parallelism_config``, over every rank of this run."""
    if not alst:
        return {}
    import torch.distributed as dist
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    world = int(dist.get_world_size() if dist.is_initialized() else
                __import__("os").environ.get("WORLD_SIZE", 1))
    return {"parallelism_config": ParallelismConfig(
        sp_backend="deepspeed", sp_size=world, dp_replicate_size=1,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                   sp_attn_implementation="sdpa"))}


class _SeesTiling(TrainerCallback):
    """Whether the MLPs ran tiled during training (SP is on inside train() only), and whether
    our activation checkpointing was applied."""

    seen = checkpointed = False

    def on_step_end(self, args, state, control, model=None, **event):
        # ``event``: the rest of what the Trainer hands every callback (optimizer, loaders,
        # ...), which this one does not need.
        layers = getattr(getattr(model, "model", None), "layers", [])
        self.seen = self.seen or any("Tiled" in type(m.mlp.forward).__name__ for m in layers)
        self.checkpointed = "checkpointing" in applied_stages(model)


def _sharding(trainer) -> dict:
    """How the trained model is held: FSDP2 units (with their reshard and offload settings)
    and what the Trainer trained it through. FSDP2 keeps what a unit was given in private
    state, which ulysses.torch_internals reads for every torch release it knows."""
    from torch.distributed.fsdp import FSDPModule

    from arctic.hf.anatomy import decoder_layers
    from ulysses.torch_internals import fsdp_unit_settings

    units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in decoder_layers(trainer.model) if isinstance(m, FSDPModule)]
    unit = fsdp_unit_settings(layers[0]) if layers else {}
    return {"fsdp_units": len(units), "trained_through": type(trainer.model_wrapped).__name__,
            "fsdp_offload": unit.get("offload_policy"),
            "fsdp_reshard": unit.get("reshard_after_forward"),
            "fsdp_param_dtype": unit.get("param_dtype")}


def _deepspeed_sp_installed(trainer) -> bool:
    """Whether accelerate installed DeepSpeed's Ulysses pieces as well: its attention over the
    global "sdpa" entry, or its dataloader adapter."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    loader = type(trainer.get_train_dataloader()).__name__
    return ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward or "Ulysses" in loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", default=str(REPO / "configs" / "cpu_trainer.json"))
    p.add_argument("--plain", action="store_true", help="plain Trainer, no SP, no DeepSpeed")
    p.add_argument("--fsdp", default=None, metavar="SP_JSON",
                   help="FSDP2 instead of DeepSpeed, with these SP settings (sp_config=)")
    p.add_argument("--sp-config-object", action="store_true",
                   help="with --fsdp: pass sp_config as a SequenceParallelConfig, not the path")
    p.add_argument("--fsdp-config", default="{}", type=json.loads,
                   help="with --fsdp: more fsdp_config entries, as JSON")
    p.add_argument("--fsdp-options", default="full_shard",
                   help="TrainingArguments(fsdp=...) with --fsdp, e.g. 'shard_grad_op offload'")
    p.add_argument("--alst", action="store_true",
                   help="HF's ALST settings: sp_size from TrainingArguments(parallelism_config)")
    p.add_argument("--model", default="tiny-llama",
                   help="'tiny-llama', a name of python -m arctic.plan's catalogue, or a "
                        "config.json path (random weights)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--output-dir", default="/tmp/arctic_hf_trainer")
    p.add_argument("--losses-out", type=Path, default=None)
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TrainingArguments(gradient_checkpointing=True)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--documents", type=int, default=None, metavar="N",
                   help="pack N documents of varied lengths into each sequence (position_ids "
                        "restarting at each, HF's packed convention)")
    p.add_argument("--uneven-labels", action="store_true",
                   help="labels on 10 tokens of even samples and 200 of odd ones")
    p.add_argument("--zero-stage", type=int, default=None,
                   help="the DeepSpeed config's zero_optimization becomes {'stage': N} alone "
                        "(with 3: save_model gathers the weights without "
                        "stage3_gather_16bit_weights_on_model_save)")
    p.add_argument("--train-samples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1,
                   help="per_device_train_batch_size (and per_device_eval_batch_size)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="per_device_eval_batch_size, if not --batch-size")
    p.add_argument("--shuffle", action="store_true",
                   help="train_sampling_strategy='random' (default: 'sequential')")
    p.add_argument("--resume-from", default=None, metavar="CHECKPOINT",
                   help="train(resume_from_checkpoint=CHECKPOINT)")
    p.add_argument("--resume", action="store_true",
                   help="train(resume_from_checkpoint=True): the newest checkpoint in --output-dir")
    p.add_argument("--lr-scheduler", default="constant", help="lr_scheduler_type")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--load-best", choices=("lowest", "highest"), default=None,
                   help="load_best_model_at_end on the eval loss (evaluated at each save), the "
                        "lowest or the highest being the best")
    p.add_argument("--ignore-data-skip", action="store_true")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    p.add_argument("--metrics", action="store_true",
                   help="evaluate with compute_metrics (next-token accuracy) and "
                        "preprocess_logits_for_metrics (argmax)")
    p.add_argument("--use-model", type=Path, default=None, metavar="DIR",
                   help="after training: save_model(DIR), whole-sequence logits, generate()")
    args = p.parse_args()
    check_documents(args.documents, args.seq_len)

    torch.manual_seed(0)
    model = build_model(args.model, args.seq_len)
    corpus = ByteCorpus(REPO / "examples" / "data" / "corpus.txt", args.seq_len)
    train = torch.utils.data.Subset(corpus, range(args.train_samples))
    evaluation = torch.utils.data.Subset(corpus, range(64, 72))
    if args.uneven_labels:
        train, evaluation = _UnevenLabels(train), _UnevenLabels(evaluation)
    if args.documents is not None:
        train = _PackedDocuments(train, args.documents)
        evaluation = _PackedDocuments(evaluation, args.documents)
    deepspeed = args.deepspeed
    if args.zero_stage is not None:
        deepspeed = json.loads(Path(args.deepspeed).read_text())
        deepspeed["zero_optimization"] = {"stage": args.zero_stage}
    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size or args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps, save_total_limit=args.save_total_limit,
        **({"load_best_model_at_end": True, "eval_strategy": "steps",
            "eval_steps": args.save_steps, "metric_for_best_model": "eval_loss",
            "greater_is_better": args.load_best == "highest"} if args.load_best else {}),
        gradient_accumulation_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=[], use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="random" if args.shuffle else "sequential", optim=args.optim,
        seed=0, ignore_data_skip=args.ignore_data_skip, bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        deepspeed=None if args.plain or args.fsdp else deepspeed,
        **({"fsdp": args.fsdp_options, "fsdp_config": {"version": 2, **args.fsdp_config}}
           if args.fsdp else {}),
        **_alst_settings(args.alst))
    metrics_fns = ({"compute_metrics": _accuracy, "preprocess_logits_for_metrics": _argmax}
                   if args.metrics else {})
    if args.plain:
        trainer = _Plain(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                         data_collator=_plain_collate, **metrics_fns)
    else:
        sp_config = {"sp_config": SequenceParallelConfig.from_ds_config(args.fsdp)
                     if args.sp_config_object else args.fsdp} if args.fsdp else {}
        trainer = SequenceParallelTrainer(model=model, args=targs, train_dataset=train,
                                          eval_dataset=evaluation, **metrics_fns, **sp_config)
    deepspeed_sp = _deepspeed_sp_installed(trainer)
    tiling = _SeesTiling()
    trainer.add_callback(tiling)
    if args.resume and args.resume_from:
        p.error("give --resume or --resume-from")
    trainer.train(resume_from_checkpoint=True if args.resume else args.resume_from)
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    by_step = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    used = _use_trained_model(trainer, corpus, args.use_model) if args.use_model else {}
    offload = getattr(model, "activation_offload", None)
    offloaded = offload.pool.stats.bytes_offloaded if offload is not None else 0
    if trainer.is_world_process_zero():
        print(f"losses {losses}\neval_loss {metrics['eval_loss']}\n"
              f"offloaded to host {offloaded / 2**20:.1f} MiB", flush=True)
        if args.losses_out:
            args.losses_out.write_text(json.dumps({"loss": losses, "eval_loss":
                                                   metrics["eval_loss"],
                                                   "global_step": trainer.state.global_step,
                                                   "best_metric": trainer.state.best_metric,
                                                   "best_model_checkpoint":
                                                       trainer.state.best_model_checkpoint,
                                                   "loss_by_step": by_step,
                                                   "metrics": metrics,
                                                   **used,
                                                   "offloaded_bytes": offloaded,
                                                   "deepspeed_sp_installed": deepspeed_sp,
                                                   "tiled_mlp": tiling.seen,
                                                   "checkpointed": tiling.checkpointed,
                                                   **_sharding(trainer),
                                                   "hf_checkpointed_layers": sum(
                                                       getattr(m, "gradient_checkpointing", False)
                                                       is True for m in model.modules())}))


if __name__ == "__main__":
    run_main(main)
