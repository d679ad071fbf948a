"""``benchmarks/step_gpu.py`` runs end to end (here on CPU, one rank of two through the fake
process group, as it runs one rank of eight on a GPU) and its FLOP accounting is right: the
model FLOPs follow the formula, and the executed attention FLOPs of kept attention are one
forward fewer than the full recompute's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the benchmark builds HF models ([hf])")

REPO = Path(__file__).resolve().parent.parent


def test_step_benchmark_runs_and_counts_flops(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_gpu.py", "--model", "tiny-llama", "--world", "2",
         "--tokens-per-rank", "512", "--iters", "1", "--stack", "ours",
         "--stack", "ours-keep-attention", "--dtype", "fp32", "--peak-tflops", "1",
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["stack"]: r for r in json.loads(out.read_text())["runs"]}
    full, kept = runs["ours"], runs["ours-keep-attention"]
    # tiny-llama: 2 layers, E=128, I=256, 8 heads of 16, vocab 256, untied; S=1024 on 2 ranks.
    L, E, I, V, S, s = 2, 128, 256, 256, 1024, 512
    params = L * (E * (E + 2 * E // 2 + E) + 3 * E * I + 2 * E) + E + V * E
    attention = L * 2 * S * S * E / 2
    assert full["model_flops"] == kept["model_flops"] == 6 * params * s + 3 * attention
    # forward + recompute + backward (2.5 forwards) against forward + backward
    assert full["executed_attention_flops"] == pytest.approx(attention * 4.5)
    assert kept["executed_attention_flops"] == pytest.approx(attention * 3.5)
    assert kept["executed_flops"] < full["executed_flops"]
    for r in (full, kept):
        assert r["step_s"] > 0 and 0 < r["mfu"] <= r["mfu_executed"]
        assert r["kernel"] == "cpu_flash"


@pytest.mark.slow  # 11 s; the counts themselves: test_step_benchmark_runs_and_counts_flops
def test_flops_only_traces_on_fake_tensors(tmp_path):
    """--flops-only counts the same executed attention FLOPs without running anything."""
    out = tmp_path / "flops.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_gpu.py", "--flops-only", "--model", "tiny-llama",
         "--world", "2", "--tokens-per-rank", "512", "--stack", "ours",
         "--stack", "ours-keep-attention", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["stack"]: r for r in json.loads(out.read_text())["flops_only"]}
    attention = 2 * 2 * 1024 * 1024 * 128 / 2
    assert rows["ours"]["attention_flops"] == pytest.approx(attention * 4.5)
    assert rows["ours-keep-attention"]["attention_flops"] == pytest.approx(attention * 3.5)
    assert rows["ours-keep-attention"]["implied_mfu"] > rows["ours"]["implied_mfu"]
