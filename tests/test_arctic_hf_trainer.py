"""SequenceParallelTrainer on 2 ranks (launched with torchrun, as users launch it) against a
plain single-process HF Trainer on the same data: the same loss at every step, the same eval
loss, the same step count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], out: Path) -> dict:
    proc = subprocess.run(cmd + ["--losses-out", str(out), "--output-dir", str(out.parent)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("optim", [pytest.param(["--optim", "adamw_torch"],
                                                marks=pytest.mark.hf_facing),
                                   # Adam and clipping hide a wrong gradient scale; SGD does not.
                                   # TrainingArguments(gradient_checkpointing=True) too: HF's
                                   # checkpointing for the plain run, ours for SP.
                                   ["--optim", "sgd", "--lr", "0.1", "--max-grad-norm", "0",
                                    "--gradient-checkpointing"]],
                         ids=["adamw", "sgd-unclipped-gc"])
def test_sp_trainer_matches_plain_trainer(tmp_path, optim):
    script = str(REPO / "examples" / "hf_trainer.py")
    plain = _run([sys.executable, script, "--plain"] + optim, tmp_path / "plain.json")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    sp = _run([torchrun, "--nproc-per-node", "2", script, "--deepspeed",
               str(REPO / "configs" / "cpu_trainer.json")] + optim, tmp_path / "sp.json")
    assert sp["global_step"] == plain["global_step"] == 5
    assert len(sp["loss"]) == len(plain["loss"]) == 5
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    assert plain["loss"][-1] < plain["loss"][0]
    # cpu_trainer.json checkpoints with offload: the layer inputs did go to the host.
    assert sp["offloaded_bytes"] > 0 and plain["offloaded_bytes"] == 0
    assert sp["hf_checkpointed_layers"] == 0  # never a second, HF checkpoint around ours
    assert (plain["hf_checkpointed_layers"] > 0) == ("--gradient-checkpointing" in optim)


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
    script = str(REPO / "examples" / "hf_trainer.py")
    plain = _run([sys.executable, script, "--plain"], tmp_path / "plain.json")
    accelerate = str(Path(sys.executable).parent / "accelerate")
    sp = _run([accelerate, "launch", "--config_file", str(config), script, "--save-steps", "5"],
              tmp_path / "sp.json")
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    # Saving as a plain Trainer does: checkpoint-5 with the model and the trainer state.
    ckpt = tmp_path / "checkpoint-5"
    assert (ckpt / "config.json").is_file() and (ckpt / "trainer_state.json").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 5
    assert any(ckpt.glob("*.safetensors")) or any(ckpt.glob("global_step5"))
