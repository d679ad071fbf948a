"""TRL's SFTTrainer with ``SequenceParallelMixin`` (``examples/trl_sft.py``) on 2 ranks,
launched with torchrun, against a plain single-process SFTTrainer on the same data: packed
documents (TRL's padding-free collator: position ids restarting per document, and flash-attn
varlen arguments), the same loss at every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples" / "trl_sft.py")


def _start(cmd: list[str], out: Path) -> tuple[subprocess.Popen, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd + ["--losses-out", str(out), "--output-dir", str(out.parent)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), out


def _finish(started: tuple[subprocess.Popen, Path]) -> dict:
    proc, out = started
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text())


def _sp_and_plain(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """The SP run and the plain one, side by side (their imports overlap)."""
    pytest.importorskip("trl", reason="TRL is in the test extras")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    sp = _start([torchrun, "--nproc-per-node", "2", SCRIPT, "--deepspeed",
                 str(REPO / "configs" / "cpu_trainer.json"), *extra], tmp_path / "sp" / "sp.json")
    plain = _start([sys.executable, SCRIPT, "--plain", *extra], tmp_path / "plain" / "p.json")
    return _finish(sp), _finish(plain)


@pytest.mark.parametrize("extra", [
    pytest.param((), id="packing"),
    # prompt-completion documents, the loss on the completions only (the collator's labels)
    pytest.param(("--completion-only",), id="completion-only", marks=pytest.mark.slow)])
def test_sft_trainer_with_packing_matches_plain_sft(tmp_path, extra):
    sp, plain = _sp_and_plain(tmp_path, *extra)
    print(f"\nSP=2 {sp['loss']}\nplain {plain['loss']}")
    assert sp["global_step"] == plain["global_step"] == 4
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert plain["loss"][-1] < plain["loss"][0]


@pytest.mark.parametrize("field,value,needle", [
    ("loss_type", "dft", "token-mean cross-entropy"),
    ("activation_offloading", True, "the DeepSpeed config's"),
    ("model_init_kwargs", {"dtype": "bfloat16"}, "model instance"),
    ("router_aux_loss_coef", 0.01, "router loss"),
])
def test_sft_fields_the_sp_trainer_cannot_give_are_refused(tmp_path, field, value, needle):
    """SFTConfig fields are classified like TrainingArguments' (arctic.train.fields): these
    are refused at construction, naming the field, before anything runs."""
    pytest.importorskip("trl", reason="TRL is in the test extras")
    from trl import SFTConfig, SFTTrainer

    from arctic.train.trainer import SequenceParallelMixin

    class SPSFTTrainer(SequenceParallelMixin, SFTTrainer):
        pass

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False)
    args.deepspeed = str(REPO / "configs" / "cpu_trainer.json")
    setattr(args, field, value)
    with pytest.raises(ValueError) as e:
        SPSFTTrainer(model=None, args=args)
    assert f"SFTConfig({field}=" in str(e.value) and needle in str(e.value), str(e.value)
