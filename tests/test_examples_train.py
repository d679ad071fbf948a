"""The README's main job, run as users run it (``deepspeed --num_gpus 2 examples/train.py``).

- The README's main command runs to completion and the loss decreases.
- (slow) A run killed with SIGKILL mid-way and resumed with ``--resume`` reproduces the loss
  trajectory of an uninterrupted run, step for step (a run killed while saving, resumed at
  another layout: tests/test_checkpoint_deepspeed.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the main job needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _main_command() -> list[str]:
    """The deepspeed part of the README's main-job line."""
    line = next(l for l in (REPO / "README.md").read_text().splitlines()
                if "deepspeed --num_gpus 2" in l and "pip install" in l)
    return shlex.split(re.sub(r"^.*?&& ", "", line))


def _launcher() -> list[str]:
    # The `deepspeed` script of this interpreter's environment.
    return [str(Path(sys.executable).parent / "deepspeed")]


def _losses(log: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (replayed after a resume) keeps its last record."""
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _run(args: list[str], timeout: float = 300) -> None:
    proc = subprocess.run(_launcher() + args, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_readme_main_job_runs_and_loss_decreases(tmp_path):
    cmd = _main_command()
    assert cmd[:4] == ["deepspeed", "--num_gpus", "2", "examples/train.py"], cmd
    _run(cmd[1:] + ["--log-file", str(tmp_path / "log.jsonl")])
    losses = _losses(tmp_path / "log.jsonl")
    assert sorted(losses) == list(range(1, len(losses) + 1)) and len(losses) >= 10
    first, last = sum(list(losses.values())[:3]) / 3, sum(list(losses.values())[-3:]) / 3
    assert last < first - 0.5, losses
    # cpu_demo.json turns on checkpointing with offload: the host held the layer inputs.
    records = [json.loads(r) for r in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(r["offload_host_peak_mib"] > 0 for r in records)


@pytest.mark.slow  # killed and resumed in the default run: test_checkpoint_deepspeed.py
def test_killed_run_resumes_step_for_step(tmp_path):
    # The uninterrupted run and the one to kill start together (their imports overlap).
    common = ["--num_gpus", "2", "examples/train.py", "--seq-len", "256", "--max-steps", "9"]
    uninterrupted = subprocess.Popen(  # its own port: DeepSpeed's shared memory is named by it
        _launcher() + ["--master_port", "29517"] + common + ["--log-file",
                                                             str(tmp_path / "ref.jsonl")],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)

    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    run = common + ["--save-dir", str(ckpt), "--save-every", "2", "--log-file", str(log)]
    proc = subprocess.Popen(_launcher() + run, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600  # a loaded machine starts DeepSpeed's ranks slowly
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    assert log.exists() and len(log.read_text().splitlines()) >= 5, \
        "the run logged fewer than 5 steps in 600 s: the machine is too loaded to time the kill"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no clean shutdown
    proc.wait(timeout=30)
    killed_at = max(_losses(log))
    assert killed_at < 9, killed_at

    try:
        out, _ = uninterrupted.communicate(timeout=300)
    finally:
        if uninterrupted.poll() is None:
            os.killpg(uninterrupted.pid, signal.SIGKILL)
    assert uninterrupted.returncode == 0, out[-3000:]
    reference = _losses(tmp_path / "ref.jsonl")
    _run(run + ["--resume"])
    resumed = _losses(log)
    assert sorted(resumed) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=0), (step, killed_at)


def test_a_refusal_on_every_rank_prints_one_message_and_no_traceback(tmp_path):
    """4 ranks, a config every rank refuses (SP 3 does not divide 4): one ``error:`` line, from
    rank 0, no traceback, exit status 1. ``ARCTIC_TRACEBACK=1`` gives the tracebacks back."""
    import launch_pool

    config = json.loads((REPO / "configs" / "cpu_demo.json").read_text())
    config["sequence_parallel_size"] = 3
    (tmp_path / "sp3.json").write_text(json.dumps(config))
    args = ["--deepspeed_config", str(tmp_path / "sp3.json"), "--max-steps", "1"]
    proc = launch_pool.launch("examples/train.py", *args, nproc=4, cwd=REPO, env=ENV,
                              launcher="deepspeed")
    lines = [l for l in proc.stdout.splitlines() if "must divide" in l]
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout[-3000:]
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    asked = launch_pool.launch("examples/train.py", *args, nproc=2, cwd=REPO,
                               env={**ENV, "ARCTIC_TRACEBACK": "1"}, launcher="deepspeed")
    assert asked.returncode == 1 and "Traceback" in asked.stdout, asked.stdout[-3000:]


def test_a_cpu_job_leaves_no_shared_memory_behind(tmp_path):
    """DeepSpeed's CPU shared-memory all-reduce creates one 69 MB /dev/shm file per rank and
    never removes it; arctic.initialize unlinks each once every rank has mapped them all, so a
    finished job leaves none (here: none under its port)."""
    import launch_pool

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    port = launch_pool.free_port()
    proc = launch_pool.launch("examples/train.py", "--max-steps", "1", "--seq-len", "256",
                              nproc=2, cwd=REPO, env=ENV, launcher="deepspeed", port=port)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "deepspeed_shm_comm" in proc.stdout  # the op was built: the files were made
    assert not list(shm.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


HYBRIDS = {
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"])),
    "nemotron_h": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4, mamba_head_dim=32,
        n_groups=2, ssm_state_size=16, chunk_size=64)),
}


@pytest.mark.slow  # 4 launches; kept vs recomputed on a hybrid in the default run:
# tests/test_arctic_recompute_attention.py::test_a_hybrid_keeps_its_attention_layers_...
@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_the_cpu_demo_config_trains_a_hybrid_with_kept_attention(tmp_path, family):
    """configs/cpu_demo.json keeps attention (recompute_attention: false): on a tiny Qwen3.5
    and a tiny Nemotron-H (``--model config.json``) it trains, and its losses are the
    recomputed run's, step for step."""
    import transformers
    import launch_pool

    name, fields = HYBRIDS[family]
    if not hasattr(transformers, name):
        pytest.skip(f"this transformers has no {name}")
    getattr(transformers, name)(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, **fields).save_pretrained(tmp_path)
    config = json.loads((REPO / "configs" / "cpu_demo.json").read_text())
    assert config["ulysses"]["recompute_attention"] is False
    config["ulysses"]["recompute_attention"] = True
    (tmp_path / "recompute.json").write_text(json.dumps(config))
    losses = {}
    for which, ds_config in (("kept", REPO / "configs" / "cpu_demo.json"),
                             ("recomputed", tmp_path / "recompute.json")):
        log = tmp_path / f"{which}.jsonl"
        proc = launch_pool.launch("examples/train.py", "--model", str(tmp_path / "config.json"),
                                  "--deepspeed_config", str(ds_config), "--max-steps", "4",
                                  "--seq-len", "512", "--log-file", str(log), nproc=2, cwd=REPO,
                                  env=ENV, launcher="deepspeed")
        assert proc.returncode == 0, proc.stdout[-3000:]
        losses[which] = _losses(log)
    assert sorted(losses["kept"]) == [1, 2, 3, 4]
    assert losses["kept"] == losses["recomputed"]
