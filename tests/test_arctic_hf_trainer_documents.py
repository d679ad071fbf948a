"""``examples/hf_trainer.py --documents N``: the SP Trainer on packed documents (HF's packed
convention, ``position_ids`` restarting at each document) logs the plain single-process
Trainer's losses on the same packed batches, and the packing changes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launch_pool
import pytest

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples" / "hf_trainer.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
JOB = ["--max-steps", "3", "--batch-size", "2"]


def _run(cmd: list[str], out: Path) -> dict:
    proc = launch_pool.run(cmd + ["--losses-out", str(out), "--output-dir", str(out.parent)],
                           cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text())


@pytest.mark.hf_facing
def test_packed_documents_give_the_plain_trainer_s_losses(tmp_path):
    packed = ["--documents", "4", *JOB]
    sp = _run([TORCHRUN, "--nproc-per-node", "2", SCRIPT, *packed], tmp_path / "sp" / "r.json")
    plain = _run([sys.executable, SCRIPT, "--plain", *packed], tmp_path / "plain" / "r.json")
    whole = _run([sys.executable, SCRIPT, "--plain", *JOB], tmp_path / "whole" / "r.json")
    print(f"\nplain packed {plain['loss']}\nSP=2 packed  {sp['loss']}\nplain whole  "
          f"{whole['loss']}")
    assert sp["global_step"] == plain["global_step"] == 3
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    # The packing moves every loss by 10x that tolerance or more (measured: 5e-4 and up).
    for a, b in zip(plain["loss"] + [plain["eval_loss"]], whole["loss"] + [whole["eval_loss"]]):
        assert a != pytest.approx(b, rel=1e-4, abs=0)


@pytest.mark.parametrize("nproc,n", [
    (2, "0"),  # torchrun: refused on each rank, before any collective (no rank hangs)
    (1, "129")])  # a 256-token sequence holds 128 documents of 2 tokens at most
def test_documents_that_do_not_fit_are_refused(tmp_path, nproc, n):
    launch = [TORCHRUN, "--nproc-per-node", "2", SCRIPT] if nproc == 2 else \
        [sys.executable, SCRIPT, "--plain"]
    proc = launch_pool.run([*launch, "--documents", n, "--output-dir", str(tmp_path)],
                           cwd=REPO, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert f"error: --documents {n}: give 1 to 128 documents per sequence of --seq-len 256" \
        in proc.stdout, proc.stdout[-3000:]
