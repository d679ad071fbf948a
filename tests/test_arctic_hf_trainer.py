"""SequenceParallelTrainer on 2 ranks (launched with torchrun, as users launch it) against a
plain single-process HF Trainer on the same data: the same loss at every step, the same eval
loss, the same step count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import launch_pool
import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent


SCRIPT = str(REPO / "examples" / "hf_trainer.py")
_PLAIN: dict[tuple[str, ...], dict] = {}
"""The plain Trainer's record per optimizer arguments: the same run serves every test."""


def _start(cmd: list[str], out: Path) -> subprocess.Popen | launch_pool.Started:
    """``cmd`` started: a real ``accelerate launch`` (the launcher is what that test tests);
    any other command through the warm launch pool, run when it is finished."""
    cmd = cmd + ["--losses-out", str(out), "--output-dir", str(out.parent),
                 "--use-model", str(out.parent / "model")]
    if Path(cmd[0]).name != "accelerate":
        return launch_pool.Started(cmd, cwd=REPO)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(proc: subprocess.Popen | launch_pool.Started, out: Path) -> dict:
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-6000:]
    return {**json.loads(out.read_text()), "model_dir": out.parent / "model"}


def _sp_and_plain(tmp_path: Path, sp_cmd: list[str], optim: list[str]) -> tuple[dict, dict]:
    """The SP run's record and the plain Trainer's, the plain one run beside it (once)."""
    sp_out, key = tmp_path / "sp" / "sp.json", tuple(optim)
    sp = _start(sp_cmd, sp_out)
    try:
        if key not in _PLAIN:
            out = tmp_path / "plain" / "plain.json"
            _PLAIN[key] = _finish(_start([sys.executable, SCRIPT, "--plain"] + optim, out), out)
        return _finish(sp, sp_out), _PLAIN[key]
    finally:
        sp.kill()  # a no-op once it has finished


@pytest.mark.parametrize("optim", [
    # Batches of 2 samples, train and eval, and metrics.
    pytest.param(["--optim", "adamw_torch", "--metrics", "--batch-size", "2"],
                 marks=pytest.mark.hf_facing),
    # Adam and clipping hide a wrong gradient scale; SGD does not (the default run's SGD case is
    # the accumulation test). TrainingArguments(gradient_checkpointing=True) too: HF's
    # checkpointing for the plain run, ours for SP.
    pytest.param(["--optim", "sgd", "--lr", "0.1", "--max-grad-norm", "0",
                  "--gradient-checkpointing", "--batch-size", "2"], marks=pytest.mark.slow)],
    ids=["adamw-batch2", "sgd-unclipped-gc-batch2"])
def test_sp_trainer_matches_plain_trainer(tmp_path, optim):
    """The batch-2 AdamW case runs with HF's ALST guide's settings where accelerate has
    them (ParallelismConfig(sp_backend="deepspeed", sp_size=2, ...) beside a DeepSpeed JSON
    without sequence_parallel_size, SequenceParallelTrainer in place of Trainer); the
    other reads sequence_parallel_size from the DeepSpeed JSON, as every run does on an
    accelerate without ParallelismConfig."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    alst = "--metrics" in optim and _has_parallelism_config()
    settings = (["--alst", "--deepspeed", str(REPO / "configs" / "cpu_alst.json")] if alst
                else ["--deepspeed", str(REPO / "configs" / "cpu_trainer.json")])
    sp, plain = _sp_and_plain(tmp_path, [torchrun, "--nproc-per-node", "2", SCRIPT] + settings
                              + optim, optim)
    # accelerate installed none of DeepSpeed's Ulysses pieces beside ours (its attention over
    # the global "sdpa" entry, its loader); the JSON's "ulysses" block tiled the MLP
    assert sp["deepspeed_sp_installed"] is False
    assert sp["tiled_mlp"] and not plain["tiled_mlp"]
    assert sp["global_step"] == plain["global_step"] == 5
    assert len(sp["loss"]) == len(plain["loss"]) == 5
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    assert plain["loss"][-1] < plain["loss"][0]
    # cpu_trainer.json checkpoints with offload: the layer inputs did go to the host.
    assert sp["offloaded_bytes"] > 0 and plain["offloaded_bytes"] == 0
    assert sp["hf_checkpointed_layers"] == 0  # never a second, HF checkpoint around ours
    assert (plain["hf_checkpointed_layers"] > 0) == ("--gradient-checkpointing" in optim)
    if "--metrics" in optim:  # compute_metrics on preprocess_logits_for_metrics' argmax
        _check_metrics(sp, plain)
    _check_the_trained_models(sp, plain)


@pytest.mark.slow
def test_sp_trainer_on_a_hybrid_model_matches_plain_trainer(tmp_path):
    """Qwen3.5 (a gated delta net layer, then an attention layer; byte vocabulary): the SP
    Trainer's losses, eval loss and trained parameters equal the plain Trainer's."""
    import transformers as tf

    from test_arctic_hybrid_models import LINEAR, _skip_unless_supported

    _skip_unless_supported("qwen3_5")
    # hidden 256: each layer's input (128 tokens a rank) is over the offload threshold
    config = tf.Qwen3_5TextConfig(vocab_size=256, hidden_size=256, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                  **LINEAR)
    path = tmp_path / "qwen3_5.json"
    path.write_text(config.to_json_string())
    optim = ["--optim", "adamw_torch", "--model", str(path)]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    sp, plain = _sp_and_plain(tmp_path, [torchrun, "--nproc-per-node", "2", SCRIPT,
                                         "--deepspeed", str(REPO / "configs" /
                                                            "cpu_trainer.json")] + optim, optim)
    assert sp["global_step"] == plain["global_step"] == 5
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    assert plain["loss"][-1] < plain["loss"][0]
    assert sp["offloaded_bytes"] > 0
    _check_the_trained_models(sp, plain)


def _has_parallelism_config() -> bool:
    try:
        import accelerate.parallelism_config  # noqa: F401  (accelerate >= 1.10)
    except ImportError:
        return False
    return True


def _check_metrics(sp: dict, plain: dict) -> None:
    got, want = sp["metrics"], plain["metrics"]
    print(f"\nnext-token accuracy SP {got['eval_accuracy']} over {got['eval_targets']} targets, "
          f"plain {want['eval_accuracy']} over {want['eval_targets']}")
    assert got["eval_targets"] == want["eval_targets"] > 0
    assert got["eval_accuracy"] == want["eval_accuracy"]


def _check_the_trained_models(sp: dict, plain: dict) -> None:
    """After train(), the SP-trained model is a normal model: on every rank its own forward
    gives the whole sequence's logits (the plain model's), generate() the plain model's tokens,
    and the model saved by save_model() loads with from_pretrained to the same logits."""
    from transformers import AutoModelForCausalLM

    assert sp["generated"] == plain["generated"]
    sp_logits, plain_logits = torch.tensor(sp["logits"]), torch.tensor(plain["logits"])
    assert sp_logits.shape == (1, 64, 256)
    torch.testing.assert_close(sp_logits, plain_logits, rtol=0, atol=1e-4)
    loaded = AutoModelForCausalLM.from_pretrained(sp["model_dir"])
    # Bit for bit: the saved fp32 weights are the trained ones, and the forward is the one
    # the rank ran, on the same shapes and, pinned here, its one thread (torchrun's
    # OMP_NUM_THREADS=1): a kernel may split its sums by thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = loaded(input_ids=torch.tensor(sp["ids"])).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, sp_logits)
    print(f"\nlogits SP=2 vs plain: largest difference "
          f"{(sp_logits - plain_logits).abs().max().item():.3g}")
    _check_parameters(sp, plain, 1e-4)


def _check_parameters(sp: dict, plain: dict, atol: float) -> None:
    """The trained parameters (as save_model() wrote them) of the SP and the plain run."""
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(r["model_dir"]) for r in (sp, plain))
    worst = max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))
    print(f"largest parameter difference SP vs plain: {worst:.3g}")
    assert worst < atol


def test_accelerate_launch_with_the_shipped_yaml(tmp_path):
    """``accelerate launch --config_file configs/accelerate_cpu_2proc.yaml``: the YAML's
    DeepSpeed file carries the SP settings; the losses equal the plain Trainer's."""
    import yaml

    from arctic.config import SequenceParallelConfig

    config = REPO / "configs" / "accelerate_cpu_2proc.yaml"
    acc = yaml.safe_load(config.read_text())
    ds_file = REPO / acc["deepspeed_config"]["deepspeed_config_file"]
    assert SequenceParallelConfig.from_ds_config(ds_file, world_size=acc["num_processes"]).\
        sequence_parallel_size == 2
    accelerate = str(Path(sys.executable).parent / "accelerate")
    optim = ["--optim", "adamw_torch", "--metrics", "--batch-size", "2"]  # the parity test's
    sp, plain = _sp_and_plain(tmp_path, [accelerate, "launch", "--config_file", str(config),
                                         SCRIPT, "--save-steps", "5"] + optim, optim)
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    # Saving as a plain Trainer does: checkpoint-5 with the model and the trainer state.
    ckpt = tmp_path / "sp" / "checkpoint-5"
    assert (ckpt / "config.json").is_file() and (ckpt / "trainer_state.json").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 5
    assert any(ckpt.glob("*.safetensors")) or any(ckpt.glob("global_step5"))


# Gradient accumulation over micro-batches with 10 and 200 target tokens: HF weighs each token
# once over the accumulated step (num_items_in_batch); a mean of micro-batch means gives the
# 10-token batch twenty times its weight. SGD without clipping: a wrong weight shows in every
# later loss.
ACCUMULATE = ["--grad-accum", "2", "--uneven-labels", "--optim", "sgd", "--lr", "0.1",
              "--max-grad-norm", "0", "--max-steps", "3"]


@pytest.mark.parametrize("stage", [pytest.param(3, marks=pytest.mark.hf_facing),
                                   pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow)],
                         ids=lambda s: f"zero{s}")
def test_gradient_accumulation_weighs_tokens_like_hf(tmp_path, stage):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    sp, plain = _sp_and_plain(tmp_path, [torchrun, "--nproc-per-node", "2", SCRIPT,
                                         "--zero-stage", str(stage)] + ACCUMULATE, ACCUMULATE)
    assert sp["global_step"] == plain["global_step"] == 3
    print(f"\nplain {plain['loss']}\nSP=2  {sp['loss']}")
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6, abs=0)
    _check_parameters(sp, plain, 1e-5)


@pytest.mark.slow
def test_two_data_parallel_sp_groups_weigh_tokens_over_both(tmp_path):
    """4 ranks: two SP=2 groups (dp=2) with one sample each, against the plain Trainer with
    batches of 2: accumulated, uneven micro-batches weighed by the tokens of all ranks
    (average_tokens_across_devices); the eval loss is the mean over samples, as the plain
    Trainer's over batches of 1 (HF averages eval batches, not tokens)."""
    dp2 = ACCUMULATE + ["--eval-batch-size", "1", "--metrics"]
    sp, plain = _sp_and_plain(tmp_path, _torchrun("--zero-stage", "3", *dp2, nproc=4),
                              dp2 + ["--batch-size", "2"])
    print(f"\nplain {plain['loss']}\nSP=2 x dp=2 {sp['loss']}")
    _check_metrics(sp, plain)  # the predictions gathered over the two SP groups
    assert sp["global_step"] == plain["global_step"] == 3
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6, abs=0)
    _check_parameters(sp, plain, 1e-5)


@pytest.mark.hf_facing
@pytest.mark.parametrize("option,needle", [
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"model_init": lambda: None}, "model_init"),
    ({"train_sampling_strategy": "group_by_length"},
     "train_sampling_strategy='group_by_length'"),
    ({"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: 0},
     "compute_loss_func"),
    ({"compute_metrics": lambda p: {}}, "give preprocess_logits_for_metrics too"),
])
def test_options_the_tiled_loss_cannot_give_are_refused_at_construction(tmp_path, option,
                                                                        needle):
    """Refused before the settings are read or any group is built (no process group exists
    here: anything past the check would fail differently)."""
    from transformers import TrainingArguments

    from arctic.train.trainer import SequenceParallelTrainer

    fields = {k: v for k, v in option.items()
              if k in ("label_smoothing_factor", "train_sampling_strategy")}
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)
    args.deepspeed = str(REPO / "configs" / "cpu_trainer.json")
    extra = {k: v for k, v in option.items() if k not in fields}
    with pytest.raises(ValueError, match=needle):
        SequenceParallelTrainer(model=None, args=args, **extra)


# A value each refused field is refused with (set after TrainingArguments' own checks, some of
# which need a GPU or a package).
REFUSED_VALUES = {
    "label_smoothing_factor": 0.1, "label_names": ["target"], "torch_compile": True,
    "torch_compile_backend": "inductor", "torch_compile_mode": "default",
    "use_liger_kernel": True, "liger_kernel_config": {"rms_norm": True},
    "neftune_noise_alpha": 5.0, "auto_find_batch_size": True,
    "include_num_input_tokens_seen": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": True},
    "activation_checkpointing_kwargs": {"every_n_layers": 2},
    "parallelism_config": object(),
    "eval_use_gather_object": True, "include_for_metrics": ["inputs"],
    "batch_eval_metrics": True,
}


def _refused_with(tmp_path, field: str, value) -> str:
    from transformers import TrainingArguments

    from arctic.train.trainer import SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    args.deepspeed = str(REPO / "configs" / "cpu_trainer.json")
    setattr(args, field, value)
    with pytest.raises(ValueError) as e:
        SequenceParallelTrainer(model=None, args=args)
    return str(e.value)


@pytest.mark.hf_facing
def test_every_training_argument_is_honoured_or_refused(tmp_path):
    """The table of TrainingArguments fields (arctic.train.fields): every field of the
    installed transformers has a row; an honoured row names the test in which SP=2 equals the
    plain Trainer with it; a refused row is refused at construction, naming the field; a row
    of any other kind fails here."""
    import dataclasses
    import importlib
    from transformers import TrainingArguments
    from transformers.trainer_pt_utils import AcceleratorConfig

    from arctic.train import fields as tf

    installed = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert installed <= tf.FIELDS.keys(), sorted(installed - tf.FIELDS.keys())
    for name, (kind, where) in tf.FIELDS.items():
        assert kind in (tf.HONOURED, tf.TRAINER, tf.REFUSED, tf.NO_EFFECT), (name, kind)
        assert (kind == tf.REFUSED) == (name in tf.REFUSALS), name
        if kind == tf.HONOURED or "::" in where:
            path, test = where.split("::")
            module = importlib.import_module(Path(path).stem)
            assert callable(getattr(module, test, None)), (name, where)
        elif kind != tf.REFUSED:
            assert where, name
    # Defaults pass (the refused fields included), in this transformers.
    tf.refuse_unsupported_arguments(TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                      use_cpu=True))
    values = {**REFUSED_VALUES, "accelerator_config": AcceleratorConfig(split_batches=True)}
    for name in tf.REFUSALS.keys() & installed:  # (some are newer than the oldest release)
        message = _refused_with(tmp_path, name, values[name])
        assert f"TrainingArguments({name}=" in message, message
    # A field the table does not know is refused away from its default, kept at it.
    fields = {k: v for k, v in tf.FIELDS.items() if k != "weight_decay"}
    original, tf.FIELDS = tf.FIELDS, fields
    try:
        message = _refused_with(tmp_path, "weight_decay", 0.1)
        assert "TrainingArguments(weight_decay=0.1): SequenceParallelTrainer does not know" \
            in message
    finally:
        tf.FIELDS = original


def test_predict_and_hyperparameter_trials_are_refused():
    from arctic.train.trainer import SequenceParallelTrainer

    trainer = object.__new__(SequenceParallelTrainer)  # neither reads any state to refuse
    with pytest.raises(ValueError, match="predict is not supported"):
        trainer.predict([])
    with pytest.raises(ValueError, match=r"train\(trial=\.\.\.\) is not supported"):
        trainer.train(trial={"learning_rate": 1e-3})


# Resuming mid-epoch in the second epoch (4 samples: 4 steps an epoch; checkpoint-6 is 2
# batches into epoch 1), shuffled: the resumed run must skip the 2 batches it trained, in the
# order of epoch 1's shuffle. SGD without clipping, so any other batch shows in the loss.
RESUME = ["--train-samples", "4", "--max-steps", "8", "--save-steps", "3", "--optim", "sgd",
          "--lr", "0.1", "--max-grad-norm", "0"]


def _torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(nproc),
            SCRIPT, *args]


def _resumed(tmp_path: Path, cmd: list[str], name: str, *extra: str) -> tuple[dict, dict]:
    """The uninterrupted run of ``cmd``, and the run resumed from its checkpoint-6."""
    full = _finish(_start(cmd, tmp_path / name / "full.json"), tmp_path / name / "full.json")
    out = tmp_path / f"{name}-resumed" / "resumed.json"
    resumed = _finish(_start(cmd + ["--resume-from", str(tmp_path / name / "checkpoint-6"),
                                    *extra], out), out)
    return full, resumed


@pytest.mark.hf_facing
def test_resume_gives_the_uninterrupted_losses(tmp_path):
    full, resumed = _resumed(tmp_path, _torchrun("--shuffle", *RESUME), "sp")
    print(f"\nuninterrupted {full['loss_by_step']}\nresumed       {resumed['loss_by_step']}")
    assert full["global_step"] == resumed["global_step"] == 8
    for step in ("7", "8"):  # trained after the resume
        assert resumed["loss_by_step"][step] == pytest.approx(full["loss_by_step"][step],
                                                              rel=1e-6, abs=0)
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6, abs=0)
    _check_parameters(resumed, full, 1e-6)


@pytest.mark.slow
def test_resume_with_ignore_data_skip_is_the_plain_trainer_s(tmp_path):
    """ignore_data_skip=True: the resumed epoch starts over from its first batch, as the
    plain Trainer's does (in order, so that the two read the same samples)."""
    sp_full, sp_resumed = _resumed(tmp_path, _torchrun(*RESUME), "sp", "--ignore-data-skip")
    plain_full, plain_resumed = _resumed(tmp_path, [sys.executable, SCRIPT, "--plain", *RESUME],
                                         "plain", "--ignore-data-skip")
    print(f"\nplain resumed {plain_resumed['loss_by_step']}\n"
          f"SP=2 resumed  {sp_resumed['loss_by_step']}")
    for step in ("7", "8"):
        assert sp_resumed["loss_by_step"][step] == pytest.approx(
            plain_resumed["loss_by_step"][step], rel=1e-5, abs=0)
        assert sp_full["loss_by_step"][step] == pytest.approx(
            plain_full["loss_by_step"][step], rel=1e-5, abs=0)
    # The batches read again: not the uninterrupted run's losses.
    assert sp_resumed["loss_by_step"]["7"] != pytest.approx(sp_full["loss_by_step"]["7"],
                                                            rel=1e-4)


def _rank_loader_reads_the_arguments():
    from types import SimpleNamespace

    from arctic.train.trainer import SequenceParallelTrainer
    from arctic.train.trainer_setup import Collate
    from helpers import get_mesh

    trainer = object.__new__(SequenceParallelTrainer)  # the loader reads these fields only
    trainer.sp_mesh, trainer._sp_collate = get_mesh(1, 1), Collate(None)
    trainer._sp_vision = None
    data = [{"input_ids": torch.arange(8) + i} for i in range(6)]
    found = {}
    for data_seed, workers in ((None, 0), (7, 0), (7, 2)):
        trainer.args = SimpleNamespace(
            seed=3, data_seed=data_seed, dataloader_num_workers=workers,
            dataloader_drop_last=workers > 0, dataloader_pin_memory=workers > 0,
            dataloader_persistent_workers=workers > 0,
            dataloader_prefetch_factor=3 if workers else None,
            dataloader_multiprocessing_context="spawn" if workers else None,
            dataloader_in_order=not workers)
        loader = trainer._sp_loader(data, 4, shuffle=True)
        # (a pool worker is a daemon and cannot start loader workers: those are not iterated)
        order = [int(v) for b in loader for v in b["input_ids"][:, 0]] if not workers else None
        context = loader.multiprocessing_context
        found[data_seed, workers] = (
            loader.batch_sampler.sampler.seed, loader.num_workers, order,
            (loader.batch_sampler.drop_last, loader.pin_memory, loader.persistent_workers,
             loader.prefetch_factor, context.get_start_method() if context else None,
             getattr(loader, "in_order", True)))
    return found


def test_the_loaders_read_data_seed_and_num_workers():
    """data_seed (else seed) seeds the shuffle, dataloader_num_workers collate, and the other
    dataloader_* fields reach the loader as they reach the plain Trainer's."""
    import dist_pool

    found = dist_pool.run(_rank_loader_reads_the_arguments, world_size=1)[0]
    assert found[None, 0][:2] == (3, 0) and found[7, 2][:2] == (7, 2), found
    assert found[7, 0][3] == (False, False, False, None, None, True), found
    assert found[7, 2][3] == (True, True, True, 3, "spawn", False), found
    assert sorted(found[None, 0][2]) == sorted(found[7, 0][2]) == list(range(6))
    assert found[None, 0][2] != found[7, 0][2], found  # another seed, another order



def test_the_default_collate_drops_what_hf_drops(tmp_path):
    """Without a data_collator the SP loaders stack the samples' keys; with
    remove_unused_columns (the default) the keys the model's forward does not name go first,
    the ones HF's own column removal drops (its signature columns). With
    remove_unused_columns=False they are kept, and the cut refuses a key it does not read
    (tests/test_arctic_data.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from arctic.train.trainer_setup import Collate

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    sample = {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "attention_mask": [1] * 4,
              "token_type_ids": [0, 0, 1, 1], "text": "abcd"}
    plain = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                        use_cpu=True))
    plain._set_signature_columns_if_needed()
    hf_kept = {k for k in sample if k in plain._signature_columns}
    got = Collate.of(model, True)([sample, sample])
    assert set(got) == hf_kept == {"input_ids", "labels", "attention_mask"}
    assert got["input_ids"].shape == (2, 4)
    assert set(Collate.of(model, False)([sample, sample])) == hf_kept | {"token_type_ids"}


_WITHOUT_USE_CPU = """
import sys
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
from arctic.trainer import SequenceParallelTrainer

args = TrainingArguments(output_dir=sys.argv[1], deepspeed=sys.argv[2], report_to=[])
model = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2))
SequenceParallelTrainer(model=model, args=args)
"""


def test_a_trainer_that_sees_one_process_of_several_says_use_cpu(tmp_path):
    """torchrun starts 2 ranks on a machine without GPUs; TrainingArguments without
    use_cpu=True leaves the Trainer a world of 1: the refusal says so, and what to set (not
    that the SP size does not divide 1)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU case")
    script = tmp_path / "no_use_cpu.py"
    script.write_text(_WITHOUT_USE_CPU)
    proc = launch_pool.launch(str(script), str(tmp_path / "out"),
                              str(REPO / "configs" / "cpu_trainer.json"), nproc=2, cwd=REPO)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "the Trainer sees a world of 1 process(es), but the launcher started 2" in \
        proc.stdout and "TrainingArguments(use_cpu=True)" in proc.stdout, proc.stdout[-3000:]
