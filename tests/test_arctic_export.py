"""``python -m arctic.export``: the HF model of a training checkpoint gives the trained model's
logits, from ZeRO-3 and FSDP2 runs alike; what it cannot read is refused by name.

The reference logits come from the trained model itself, sharded as it trained (SP taken off,
the whole sequence through ZeRO-3's or FSDP2's gathers), never from the checkpoint: the
exporter reads the files in another process, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_pool
import launch_pool

pytest.importorskip("transformers", reason="the exporter needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent
VOCAB, S = 256, 64
TOL = 1e-6
"""Max abs logit difference allowed: the same fp32 weights through the same kernels (both
runs on one CPU); a wrong, stale or half-loaded weight moves the logits by far more."""


def _config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=tie)


def _model(tie: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(tie), attn_implementation="sdpa")


def _ids(seed: int):
    return torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(seed))


def _trained_logits(model):
    """The sharded model's logits on the whole probe sequence, SP off (every rank calls)."""
    import arctic

    arctic.remove_sequence_parallel(model)
    with torch.no_grad():
        return model(input_ids=_ids(99)).logits.detach().clone()


def _rank_deepspeed(save_dir: str, steps: int, stage: int):
    """ZeRO ``stage`` with SP=2, fused projections in head chunks, tiled MLP, checkpointing:
    train, save as examples/train.py does, and return the trained logits and, under ZeRO-3,
    the live gather."""
    import torch.distributed as dist

    import arctic
    from arctic.data.batch import prepare_sp_batch
    from arctic.export import zero3_full_state_dict
    from helpers import init_deepspeed_comm

    init_deepspeed_comm()
    model = _model(tie=True)
    if dist.get_rank() == 0:
        model.config.save_pretrained(save_dir)  # as examples/_common.save_model_config
    dist.barrier()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "sequence_parallel_size": 2,
              "ulysses": {"head_chunk_size": 1, "fuse_projections": True, "tiled_mlp": 2,
                          "activation_checkpointing": True}}
    engine, *_ = arctic.initialize(model=model, config=config)
    for step in range(steps):
        loss = engine(**prepare_sp_batch({"input_ids": _ids(step)}, engine.sp_mesh))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag=f"step{steps}")
    logits = _trained_logits(engine.module)
    return logits, zero3_full_state_dict(engine) if stage == 3 else None


def _rank_fsdp2(save_dir: str, steps: int):
    """FSDP2 over both ranks with SP=2, tiled MLP, checkpointing with host offload: train,
    save with examples/train_fsdp.py's own save_checkpoint, return the trained logits."""
    import torch.distributed as dist

    import arctic
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe

    sys.path.insert(0, str(REPO / "examples"))
    from train_fsdp import save_checkpoint

    model = _model(tie=False)
    if dist.get_rank() == 0:
        model.config.save_pretrained(save_dir)
    dist.barrier()
    config = arctic.SequenceParallelConfig(sequence_parallel_size=2, tiled_mlp=2,
                                           activation_checkpointing=True,
                                           offload_activations=True)
    mesh = config.dims(2).build_mesh("cpu")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    arctic.apply_fsdp(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(**prepare_sp_batch({"input_ids": _ids(step)}, mesh)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # an older finished step: the newest must be the one exported
            save_checkpoint(Path(save_dir) / "step1", model, optimizer, [1, 0, 1])
    save_checkpoint(Path(save_dir) / f"step{steps}", model, optimizer, [steps, 0, steps])
    return _trained_logits(model)


def _export_cli(checkpoint: Path, out: Path, *extra: str) -> str:
    proc = launch_pool.run([sys.executable, "-m", "arctic.export", str(checkpoint), str(out),
                            *extra], cwd=REPO, timeout=240,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _exported_logits(out: Path):
    from transformers import AutoModelForCausalLM

    text = (out / "config.json").read_text()
    assert "ulysses" not in text, text  # loadable where arctic is not installed
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        return model, model(input_ids=_ids(99)).logits


@pytest.mark.parametrize("stage", [pytest.param(3, marks=pytest.mark.hf_facing),
                                   pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(0, marks=pytest.mark.slow)])
def test_deepspeed_run_exports_the_trained_model(tmp_path, stage):
    save = tmp_path / "save"
    ranks = dist_pool.run(_rank_deepspeed, str(save), 3, stage, world_size=2, timeout=240)
    (trained, gathered), (trained1, other) = ranks
    assert torch.equal(trained, trained1)
    printed = _export_cli(save, tmp_path / "out")  # the save dir: 'latest' names step3
    assert f"{save / 'step3'}" in printed, printed
    model, logits = _exported_logits(tmp_path / "out")
    diff = (logits - trained).abs().max().item()
    print(f"zero{stage}: max abs logit difference {diff:.3g}")
    assert diff <= TOL, diff
    assert model.dtype == torch.float32  # ZeRO's fp32 master weights
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as trained
    if stage != 3:
        return
    assert other == {}
    # zero3_full_state_dict (for the Trainer's save_model) gathers the same weights live.
    exported = model.state_dict()
    assert sorted(gathered) == sorted(exported)
    for name, tensor in gathered.items():
        assert torch.equal(tensor, exported[name]), name


def test_fsdp2_run_exports_the_trained_model(tmp_path):
    save = tmp_path / "save"
    trained, trained1 = dist_pool.run(_rank_fsdp2, str(save), 3, world_size=2, timeout=240)
    assert torch.equal(trained, trained1)
    (save / "step9").mkdir()  # an unfinished step (no .metadata) is passed over
    printed = _export_cli(save, tmp_path / "out")
    assert f"{save / 'step3'}" in printed, printed
    model, logits = _exported_logits(tmp_path / "out")
    diff = (logits - trained).abs().max().item()
    print(f"fsdp2: max abs logit difference {diff:.3g}")
    assert diff <= TOL, diff
    assert not model.config.tie_word_embeddings and model.dtype == torch.float32
    # The older step, exported explicitly, is another model: the comparison can fail.
    from arctic.export import export

    export(save / "step1", tmp_path / "out1")
    _, older = _exported_logits(tmp_path / "out1")
    assert (older - trained).abs().max().item() > 1e-3


# -- one process: DCP checkpoints written without a process group ------------------------------


def _dcp_checkpoint(path: Path, model, extra: dict | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {**model.state_dict(), **(extra or {})}, "progress": torch.tensor([1])},
             checkpoint_id=str(path), no_dist=True)


def test_trainer_checkpoint_dcp_and_dtype(tmp_path):
    """A Trainer output directory: the newest finished checkpoint-N/dcp, the config from
    checkpoint-N; a config naming our attention is exported with the default one; --dtype
    casts exactly."""
    from arctic.export import export

    model = _model(tie=False)
    for step in (2, 4):
        ckpt = tmp_path / "run" / f"checkpoint-{step}"
        _dcp_checkpoint(ckpt / "dcp", model)
        raw = model.config.to_dict() | {"attn_implementation": "ulysses"}
        (ckpt / "config.json").write_text(json.dumps(raw))
        (ckpt / "trainer_state.json").write_text("{}")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # the newest checkpoint: other weights
    _dcp_checkpoint(tmp_path / "run" / "checkpoint-6" / "dcp", model)  # unfinished: no state
    export(tmp_path / "run", tmp_path / "out", dtype="bfloat16")
    got, logits = _exported_logits(tmp_path / "out")
    assert got.dtype == torch.bfloat16 and got.config._attn_implementation == "sdpa"
    ref = _model(tie=False)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_a_vision_language_model_exports_as_its_own_class(tmp_path):
    """A Qwen2.5-VL checkpoint (DCP, the trained class named in config.json's architectures)
    exports as Qwen2_5_VLForConditionalGeneration, which AutoModelForImageTextToText loads
    to the same logits on an image and text."""
    from test_arctic_vlm import _batch, _model as vlm
    from transformers import AutoModelForImageTextToText

    from arctic.export import export

    model = vlm("qwen2_5_vl").eval()
    save = tmp_path / "save"
    _dcp_checkpoint(save / "step3", model)
    model.config.save_pretrained(save)
    export(save, tmp_path / "out")
    got = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(got) is type(model)
    inputs = {k: v for k, v in _batch("qwen2_5_vl").items() if k != "labels"}
    with torch.no_grad():
        want, logits = model(**inputs).logits, got(**inputs).logits
    assert (logits - want).abs().max().item() <= TOL


def test_refusals(tmp_path):
    from arctic.export import export

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no checkpoint this exporter reads \(found: notes\.txt"):
        export(tmp_path / "empty", tmp_path / "out")
    _model(tie=False).save_pretrained(tmp_path / "hf")  # e.g. a save_only_model checkpoint
    with pytest.raises(ValueError, match="holds HF weights already"):
        export(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(ValueError, match="is not a directory"):
        export(tmp_path / "missing", tmp_path / "out")

    model = _model(tie=False)
    _dcp_checkpoint(tmp_path / "a" / "step1", model)
    with pytest.raises(ValueError, match="no config.json in .*; pass the model's HF config"):
        export(tmp_path / "a" / "step1", tmp_path / "out")
    # Names that do not fit the config are named, both ways.
    _dcp_checkpoint(tmp_path / "b" / "step1", model, {"model.layers.7.extra.weight":
                                                      torch.zeros(2)})
    fewer = _config(tie=False)
    fewer.num_hidden_layers = 1
    fewer.save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['model.layers.1.input_"
                                         r"layernorm.weight'.*'model.layers.7.extra.weight'"):
        export(tmp_path / "b", tmp_path / "out")
    # A DCP checkpoint without the model.
    import torch.distributed.checkpoint as dcp

    dcp.save({"optim": {"x": torch.zeros(1)}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    with pytest.raises(ValueError, match=r"without a 'model' entry \(its keys: \['optim'\]\)"):
        export(tmp_path / "c", tmp_path / "out", config=tmp_path / "b")
    with pytest.raises(ValueError, match="dtype must be one of"):
        export(tmp_path / "a" / "step1", tmp_path / "out", dtype="fp8")


# -- as users run it: the HF Trainer and the example scripts, launched (slow) -----------------


def _launch(cmd: list[str], timeout: float = 480) -> None:
    proc = launch_pool.run(cmd, cwd=REPO, timeout=timeout,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _torchrun(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", *args]


def _hf_trainer(tmp_path: Path, *engine: str) -> dict:
    """examples/hf_trainer.py for 2 steps with a checkpoint at step 2; after training it
    runs the trained model on a whole sequence (the reference logits) and save_model()s it."""
    out = tmp_path / "run"
    _launch(_torchrun(str(REPO / "examples" / "hf_trainer.py"), *engine, "--max-steps", "2",
                      "--save-steps", "2", "--output-dir", str(out), "--losses-out",
                      str(tmp_path / "record.json"), "--use-model", str(tmp_path / "model")))
    return json.loads((tmp_path / "record.json").read_text())


def _check_export(checkpoint: Path, out: Path, record: dict) -> float:
    from transformers import AutoModelForCausalLM

    _export_cli(checkpoint, out)
    assert "ulysses" not in (out / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(record["ids"])).logits
    diff = (logits - torch.tensor(record["logits"])).abs().max().item()
    print(f"{checkpoint}: max abs logit difference {diff:.3g}")
    assert diff <= TOL, diff
    return diff


@pytest.mark.slow
def test_hf_trainer_zero3_checkpoint_and_save_model_export(tmp_path):
    """ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the Trainer's checkpoint-2
    (global_step2/) exports to the trained model (save_model writes the weights itself:
    test_trainer_save_model_under_zero3_writes_the_weights)."""
    config = json.loads((REPO / "configs" / "cpu_trainer.json").read_text())
    config["zero_optimization"] = {"stage": 3}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    record = _hf_trainer(tmp_path, "--deepspeed", str(tmp_path / "ds.json"))
    assert (tmp_path / "run" / "checkpoint-2" / "global_step2").is_dir()
    _check_export(tmp_path / "run", tmp_path / "out", record)


@pytest.mark.slow
def test_hf_trainer_fsdp2_checkpoint_export(tmp_path):
    record = _hf_trainer(tmp_path, "--fsdp", str(REPO / "configs" / "cpu_trainer_fsdp.json"))
    assert (tmp_path / "run" / "checkpoint-2" / "dcp" / ".metadata").is_file()
    _check_export(tmp_path / "run", tmp_path / "out", record)


@pytest.mark.slow
def test_trainer_save_model_under_zero3_writes_the_weights(tmp_path):
    """SequenceParallelTrainer.save_model (tests/export_zero3_save_model.py) writes HF weights
    that give the trained model's logits, where transformers alone writes a DeepSpeed
    checkpoint (without stage3_gather_16bit_weights_on_model_save)."""
    from transformers import AutoModelForCausalLM

    _launch(_torchrun(str(REPO / "tests" / "export_zero3_save_model.py"), str(tmp_path)))
    assert not (tmp_path / "model" / "latest").exists()  # not DeepSpeed's fallback
    record = json.loads((tmp_path / "record.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(record["ids"])).logits
    diff = (logits - torch.tensor(record["logits"])).abs().max().item()
    print(f"save_model under ZeRO-3: max abs logit difference {diff:.3g}")
    assert diff <= TOL, diff


@pytest.mark.slow
def test_example_scripts_checkpoints_export(tmp_path):
    """examples/train.py (deepspeed launcher, cpu_demo.json: ZeRO-3, SP=2) and
    examples/train_fsdp.py (torchrun, FSDP2, SP=2), each saving at steps 2 and 4: their save
    directories export the step-4 weights, config.json from the save directory. The DCP
    export equals torch's own conversion of the checkpoint (format_utils.dcp_to_torch_save);
    the DeepSpeed one is trained (lower loss than the initial weights on the data)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    common = ["--seq-len", "256", "--max-steps", "4", "--save-every", "2"]
    ds = subprocess.Popen([str(Path(sys.executable).parent / "deepspeed"), "--master_port",
                           "29531", "--num_gpus", "2", "examples/train.py", *common,
                           "--save-dir", str(tmp_path / "ds")], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _launch(_torchrun("--master-port", "29532", "examples/train_fsdp.py",
                          "--sequence-parallel-size", "2", *common,
                          "--save-dir", str(tmp_path / "fsdp")))
        log, _ = ds.communicate(timeout=480)
    finally:
        ds.kill()
    assert ds.returncode == 0, log[-4000:]

    assert f"{tmp_path / 'fsdp' / 'step4'}" in _export_cli(tmp_path / "fsdp", tmp_path / "o1")
    dcp_to_torch_save(tmp_path / "fsdp" / "step4", tmp_path / "torch.pt")
    ref = torch.load(tmp_path / "torch.pt", weights_only=True)["model"]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "o1").state_dict()
    assert sorted(ref) == sorted(got)
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name

    assert f"{tmp_path / 'ds' / 'step4'}" in _export_cli(tmp_path / "ds", tmp_path / "o2")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "o2")
    sys.path.insert(0, str(REPO / "examples"))
    from _common import ByteCorpus, build_model

    torch.manual_seed(0)
    initial = build_model("tiny-llama", 256)
    ids = ByteCorpus(REPO / "examples" / "data" / "corpus.txt", 256)[0]["input_ids"][None]
    with torch.no_grad():
        losses = [m(input_ids=ids, labels=ids).loss.item() for m in (trained, initial)]
    assert losses[0] < losses[1] - 0.1, losses


def test_universal_checkpoint_refused(tmp_path):
    from arctic.export import export

    tag = tmp_path / "step2_universal"
    (tag / "zero" / "lm_head.weight").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="universal checkpoint; export the checkpoint it was "
                                         "converted from"):
        export(tag, tmp_path / "out")


def test_a_config_saved_with_an_infinite_float_loads_for_export_and_training(tmp_path):
    """save_pretrained writes an infinite float (Nemotron-H's default time_step_limit,
    (0, inf)) as {"__float__": "Infinity"}: the export's --config and the examples' --model
    read config.json through HF's own reader, which decodes it."""
    import transformers

    from arctic.export import load_config

    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("this transformers has no Nemotron-H")
    transformers.NemotronHConfig(
        vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=16).save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    assert list(load_config(tmp_path).time_step_limit) == [0.0, float("inf")]
    sys.path.insert(0, str(REPO / "examples"))
    from _common import build_model

    model = build_model(str(tmp_path / "config.json"), 64)
    assert type(model).__name__ == "NemotronHForCausalLM"
    assert list(model.config.time_step_limit) == [0.0, float("inf")]
    (tmp_path / "bad.json").write_text('{"model_type": "llama", ')
    for load in (lambda: load_config(tmp_path / "bad.json"),
                 lambda: build_model(str(tmp_path / "bad.json"), 64)):
        with pytest.raises(ValueError, match="not a valid JSON file"):
            load()
