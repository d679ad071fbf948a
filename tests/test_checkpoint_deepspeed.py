"""DeepSpeed checkpoints: a write killed half-way leaves the previous checkpoint the one
resumed, and a checkpoint resumes at another layout through DeepSpeed's universal checkpoint,
or is refused by name with the conversion command.

- The resume plan, on checkpoint directories written here (no process group); rank 0's
  conversion failing on 2 gloo ranks stops both.
- ``examples/train.py`` under ZeRO-3, on the ranks the ``deepspeed`` launcher would start
  (tests/launch_pool.py; the README main job's test launches it for real): SP=2 on 2 ranks,
  killed (SIGKILL of the whole launch) while writing its step-4 checkpoint, after rank 0's
  files; at SP=4 on 4 ranks its newest complete checkpoint, step2, needs the universal
  conversion; without ``--convert-universal`` the resume is refused naming the command and the
  flag, and with it rank 0 converts once and the resumed steps' losses equal the SP=2 run's.
- The HF Trainer under ZeRO-3, written at SP=2 on 2 ranks, resumed at SP=4 on 4 ranks from
  the conversion its resume plan names; (slow) without it, refused on every rank naming the
  command.
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

import dist_pool
import launch_pool
import pytest

from arctic.train.ds_checkpoint import (
    LAYOUT_FILE,
    CheckpointLayout,
    complete_tags,
    plan_resume,
    universal_command,
    universal_converted,
    write_layout,
)
from arctic.train.ds_universal import convert_on_rank0, read_latest

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
TOLERANCE = 1e-5
"""Resumed against uninterrupted losses, fp32: the SP=4 attention sums its pieces in another
order than SP=2's (measured: 5e-7 apart)."""

SP2 = CheckpointLayout(world_size=2, sequence_parallel_size=2, zero_stage=3, sp_mpu=True)
SP4 = CheckpointLayout(world_size=4, sequence_parallel_size=4, zero_stage=3, sp_mpu=True)


def _checkpoint(save_dir: Path, tag: str, layout: CheckpointLayout | None, steps: int) -> None:
    """A tag directory as save_checkpoint leaves it (``layout=None``: its write was killed)."""
    (save_dir / tag).mkdir(parents=True)
    (save_dir / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")
    if layout is not None:
        write_layout(save_dir, tag, layout, global_steps=steps)
        (save_dir / "latest").write_text(tag)


def test_the_newest_complete_checkpoint_is_resumed(tmp_path):
    _checkpoint(tmp_path, "step10", SP2, 10)
    _checkpoint(tmp_path, "step5", SP2, 5)
    _checkpoint(tmp_path, "step15", None, 15)  # killed while writing
    (tmp_path / "step10_universal").mkdir()    # a conversion is no checkpoint of its own
    assert complete_tags(tmp_path) == ["step5", "step10"]
    plan = plan_resume(tmp_path, "step10", SP2)
    assert (plan.tag, plan.universal, plan.saved) == ("step10", False, SP2)
    with pytest.raises(ValueError, match=rf"step15 holds no {LAYOUT_FILE}"):
        plan_resume(tmp_path, "step15", SP2)


def test_the_sp_degree_alone_loads_natively(tmp_path):
    """ZeRO shards over every rank: at the same world size only the SP degree differs."""
    _checkpoint(tmp_path, "step2", SP2, 2)
    dp2 = CheckpointLayout(world_size=2, sequence_parallel_size=1, zero_stage=3, sp_mpu=True)
    assert not plan_resume(tmp_path, None, dp2).universal


@pytest.mark.parametrize("current", [SP4, CheckpointLayout(world_size=2, sequence_parallel_size=2,
                                                           zero_stage=2, sp_mpu=True)],
                         ids=["world", "stage"])
def test_another_layout_is_refused_with_the_command(tmp_path, current):
    _checkpoint(tmp_path, "step2", SP2, 2)
    with pytest.raises(ValueError) as err:
        plan_resume(tmp_path, None, current)
    message = str(err.value)
    assert SP2.describe() in message and current.describe() in message
    assert universal_command(tmp_path, "step2") in message
    assert "--input_folder" in message and str(tmp_path / "step2_universal") in message


def test_the_conversion_is_planned_when_asked_for(tmp_path):
    """``convert=True``: a missing conversion is planned (``convert_from``) instead of
    refused; without it the refusal names the caller's flag beside the command."""
    _checkpoint(tmp_path, "step2", SP2, 2)
    plan = plan_resume(tmp_path, None, SP4, convert=True)
    assert (plan.tag, plan.universal, plan.convert_from) == ("step2_universal", True, "step2")
    assert plan_resume(tmp_path, None, SP2, convert=True).convert_from is None  # loads natively
    with pytest.raises(ValueError) as err:
        plan_resume(tmp_path, None, SP4, convert_flag="--convert-universal")
    assert universal_command(tmp_path, "step2") in str(err.value)
    assert "or resume with --convert-universal, which runs that command" in str(err.value)
    (tmp_path / "step2_universal" / "zero").mkdir(parents=True)
    (tmp_path / "step2_universal" / "zero" / "optimizer_state.pt").write_bytes(b"state")
    (tmp_path / "latest_universal").write_text("step2_universal")
    assert plan_resume(tmp_path, None, SP4, convert=True).convert_from is None  # converted


def test_a_finished_conversion_is_loaded(tmp_path):
    _checkpoint(tmp_path, "step2", SP2, 2)
    converted = tmp_path / "step2_universal" / "zero"
    converted.mkdir(parents=True)
    (converted / "optimizer_state.pt").write_bytes(b"state")
    with pytest.raises(ValueError, match="does not exist yet"):  # not finished: no latest_universal
        plan_resume(tmp_path, None, SP4)
    (tmp_path / "latest_universal").write_text("step2_universal")
    plan = plan_resume(tmp_path, None, SP4)
    assert (plan.tag, plan.universal) == ("step2_universal", True)
    # checkpoint.load_universal in the config: the conversion at the same layout too
    assert plan_resume(tmp_path, None, SP2, load_universal=True).universal
    assert not plan_resume(tmp_path, None, SP2).universal


def test_zero12_under_the_sp_mpu_is_refused_by_name(tmp_path):
    """ds_to_universal reads the SP mpu's size as a tensor-parallel degree of ZeRO-1/2
    checkpoints: such a checkpoint cannot convert, and the message says so."""
    z2 = CheckpointLayout(world_size=2, sequence_parallel_size=2, zero_stage=2, sp_mpu=True)
    _checkpoint(tmp_path, "step2", z2, 2)
    with pytest.raises(ValueError, match="cannot convert a ZeRO-2 checkpoint"):
        plan_resume(tmp_path, None, CheckpointLayout(world_size=4, sequence_parallel_size=4,
                                                     zero_stage=2, sp_mpu=True))
    trainer = CheckpointLayout(world_size=2, sequence_parallel_size=2, zero_stage=2, sp_mpu=False)
    assert trainer.converts_to_universal()


def _convert_broken(save_dir: str) -> str:
    try:
        convert_on_rank0(save_dir, "step2")
    except RuntimeError as e:
        return str(e)
    return "converted"


def test_a_failed_conversion_stops_every_rank(tmp_path):
    """Rank 0's converter fails (a shard that is no torch file): every rank raises, none
    waits on; what an earlier, interrupted conversion left is gone, not taken as finished."""
    _checkpoint(tmp_path, "step2", SP2, 2)
    (tmp_path / "step2_universal" / "zero").mkdir(parents=True)  # interrupted before
    (tmp_path / "step2_universal" / "zero" / "leftover.pt").write_bytes(b"part")
    (tmp_path / "latest_universal").write_text("step2_universal")
    rank0, rank1 = dist_pool.run(_convert_broken, str(tmp_path), world_size=2)
    assert rank0.startswith(f"the universal conversion of {tmp_path / 'step2'} failed: "
                            f"{universal_command(tmp_path, 'step2')} exited with status 1")
    assert rank1 == f"rank 0 could not convert {tmp_path / 'step2'}: RuntimeError: {rank0}"
    assert read_latest(tmp_path, "latest_universal") is None
    assert not (tmp_path / "step2_universal" / "zero" / "leftover.pt").exists()


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="must divide world_size"):
        CheckpointLayout(world_size=4, sequence_parallel_size=3, zero_stage=3, sp_mpu=True)


# -- examples/train.py, launched -------------------------------------------------------------

KILLED_TRAIN = '''\
"""examples/train.py whose rank 1 writes half of its optimizer shard of the tag
KILL_IN_SAVE_TAG, once rank 0's is written, and SIGKILLs the whole launch (its process
group), as a machine lost mid-save would."""
import io
import os
import runpy
import signal
import sys
import time

import torch

EXAMPLES = os.path.join(os.environ["ARCTIC_REPO"], "examples")
sys.path.insert(0, EXAMPLES)  # train.py imports _common from beside it
_save = torch.save


def save(obj, f, *args, **kwargs):
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else ""
    if (os.environ.get("RANK") == "1" and path.endswith("optim_states.pt")
            and os.path.basename(os.path.dirname(path)) == os.environ["KILL_IN_SAVE_TAG"]):
        first = os.path.join(os.path.dirname(path), "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        deadline = time.time() + 120
        while not os.path.exists(first) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        buf = io.BytesIO()
        _save(obj, buf, *args, **kwargs)
        with open(path, "wb") as out:
            out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return _save(obj, f, *args, **kwargs)


torch.save = save
sys.argv[0] = os.path.join(EXAMPLES, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _losses(log: Path) -> dict[int, float]:
    """step -> loss; a step logged twice keeps its last record."""
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _config(tmp_path: Path, sp: int) -> Path:
    config = json.loads((REPO / "configs" / "cpu_demo.json").read_text())
    assert config["zero_optimization"]["stage"] == 3
    config["sequence_parallel_size"] = sp
    path = tmp_path / f"sp{sp}.json"
    path.write_text(json.dumps(config))
    return path


def test_killed_mid_write_then_resumed_at_sp4(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "sp2.jsonl"
    job = ["examples/train.py", "--seq-len", "256", "--max-steps", "4", "--save-dir", str(ckpt),
           "--save-every", "2"]
    killing = tmp_path / "train_killed_saving.py"
    killing.write_text(KILLED_TRAIN)
    killed_env = {**ENV, "KILL_IN_SAVE_TAG": "step4", "ARCTIC_REPO": str(REPO)}
    start = time.perf_counter()
    killed = launch_pool.run(["deepspeed", "--num_gpus", "2", str(killing), *job[1:],
                              "--deepspeed_config", str(_config(tmp_path, 2)),
                              "--log-file", str(log)], cwd=REPO, env=killed_env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    # killed inside step 4's save: rank 0's files there, rank 1's half, no completion record
    reference = _losses(log)  # the SP=2 run, uninterrupted through step 4
    assert sorted(reference) == [1, 2, 3, 4]
    files = {p.name for p in (ckpt / "step4").iterdir()}
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in files and LAYOUT_FILE not in files
    assert complete_tags(ckpt) == ["step2"] and (ckpt / "latest").read_text() == "step2"
    print(f"\nkilled in step4's save after {time.perf_counter() - start:.0f} s; step4 holds "
          f"{sorted(files)}")

    # SP=4 on 4 ranks: the newest complete checkpoint, step2, needs its universal conversion;
    # without --convert-universal every rank refuses, naming the command and the flag (the
    # refusal on every rank is read in test_trainer_refuses_another_layout_on_every_rank)
    sp4 = ["--num_gpus", "4", *job, "--deepspeed_config", str(_config(tmp_path, 4)),
           "--resume", "--log-file", str(tmp_path / "sp4.jsonl")]
    refused = launch_pool.run(["deepspeed", *sp4], cwd=REPO, env=ENV)
    assert refused.returncode == 1, refused.stdout[-3000:]
    assert f"    {universal_command(ckpt, 'step2')}\n" in refused.stdout, refused.stdout[-3000:]
    assert "or resume with --convert-universal, which runs that command" in refused.stdout
    assert not (ckpt / "step2_universal").exists()

    # with it, rank 0 runs that command once, the others wait, and every rank loads it
    resumed = launch_pool.run(["deepspeed", *sp4, "--convert-universal"], cwd=REPO, env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    progress = f"converting {ckpt / 'step2'} to a universal checkpoint (ds_to_universal) ..."
    assert resumed.stdout.count(progress) == 1, resumed.stdout[-3000:]
    assert resumed.stdout.count("*** Done!") == 1  # the converter's last line: it ran once
    assert len(re.findall(r"^converted in \d+ s: ", resumed.stdout, flags=re.M)) == 1
    assert universal_converted(ckpt, "step2")
    assert f"resumed from {ckpt / 'step2_universal'} (step 2, universal" in resumed.stdout
    assert f"skipped {ckpt / 'step4'}: its save did not finish" in resumed.stdout
    losses = _losses(tmp_path / "sp4.jsonl")
    assert sorted(losses) == [3, 4]
    diffs = {step: abs(losses[step] - reference[step]) for step in losses}
    print(f"SP=2 {reference}\nSP=4 resumed {losses}\nmax abs diff {max(diffs.values()):.2e}; "
          f"{time.perf_counter() - start:.0f} s in all")
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=TOLERANCE, abs=0), step


# -- the HF Trainer under DeepSpeed, launched ------------------------------------------------

def _trainer(tmp_path: Path, name: str, nproc: int, config: Path, *extra: str,
             port: int, env: dict = ENV) -> tuple[subprocess.CompletedProcess, Path]:
    """``torchrun examples/hf_trainer.py`` (Adam: the universal converter carries Adam's
    state) with checkpoints every 3 steps; returns the run and its losses file."""
    out = tmp_path / name / "losses.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(nproc),
           "--master-port", str(port), str(REPO / "examples" / "hf_trainer.py"),
           "--deepspeed", str(config), "--train-samples", "4", "--max-steps", "6",
           "--save-steps", "3", "--shuffle", "--output-dir", str(out.parent),
           "--losses-out", str(out), *extra]
    return launch_pool.run(cmd, cwd=REPO, env=env), out


def _trainer_config(tmp_path: Path, sp: int) -> Path:
    ds = json.loads((REPO / "configs" / "cpu_trainer.json").read_text())
    ds["sequence_parallel_size"] = sp
    path = tmp_path / f"trainer_sp{sp}.json"
    path.write_text(json.dumps(ds))
    return path


def _trainer_written_at_sp2(tmp_path: Path, port: int) -> tuple[dict, Path]:
    """The Trainer's SP=2 run on 2 ranks, 6 steps; its losses and its checkpoint-3."""
    full, full_out = _trainer(tmp_path, "full", 2, _trainer_config(tmp_path, 2), port=port)
    assert full.returncode == 0, full.stdout[-3000:]
    return json.loads(full_out.read_text())["loss_by_step"], tmp_path / "full" / "checkpoint-3"


@pytest.mark.slow  # 23 s; the resume at SP=4 through the conversion, in the default run:
# test_killed_mid_write_then_resumed_at_sp4 (examples/train.py), and the Trainer's resume
# plan: test_another_layout_is_refused_with_the_command, test_a_finished_conversion_is_loaded
def test_trainer_checkpoint_resumes_at_sp4(tmp_path):
    """SequenceParallelTrainer under ZeRO-3: written at SP=2 on 2 ranks, resumed at SP=4 on
    4 ranks from checkpoint-3 through the conversion its resume plan names: steps 4-6 equal
    the uninterrupted SP=2 run's."""
    reference, checkpoint = _trainer_written_at_sp2(tmp_path, 29541)
    sp4 = CheckpointLayout(world_size=4, sequence_parallel_size=4, zero_stage=3, sp_mpu=False)
    with pytest.raises(ValueError, match="must be loaded from its universal checkpoint") as e:
        plan_resume(checkpoint, None, sp4)
    command = next(line.strip() for line in str(e.value).splitlines()
                   if line.strip().startswith("python -m deepspeed.checkpoint.ds_to_universal"))
    converted = launch_pool.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, env=ENV,
                                timeout=300)
    assert converted.returncode == 0, converted.stdout[-3000:]
    resumed, resumed_out = _trainer(tmp_path, "resumed", 4, _trainer_config(tmp_path, 4),
                                    "--resume-from", str(checkpoint), port=29543)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    losses = json.loads(resumed_out.read_text())["loss_by_step"]
    print(f"\nSP=2 {reference}\nSP=4 resumed {losses}")
    assert sorted(losses, key=int)[-3:] == ["4", "5", "6"]
    for step in ("4", "5", "6"):
        assert losses[step] == pytest.approx(reference[step], rel=TOLERANCE, abs=0), step


@pytest.mark.slow
def test_trainer_refuses_another_layout_on_every_rank(tmp_path):
    """Without the conversion, the resume at SP=4 on 4 ranks stops on every rank, before
    any collective, naming the checkpoint and the command."""
    _, checkpoint = _trainer_written_at_sp2(tmp_path, 29544)
    refused, _ = _trainer(tmp_path, "resumed", 4, _trainer_config(tmp_path, 4),
                          "--resume-from", str(checkpoint), port=29542,
                          env={**ENV, "ARCTIC_TRACEBACK": "1"})  # every rank's own refusal
    assert refused.returncode != 0
    for rank in range(4):
        assert f"[rank{rank}]: ValueError: cannot resume from {checkpoint / 'global_step3'}" \
            in refused.stdout, refused.stdout[-3000:]
    assert re.search(r"^(?:\[rank\d\]:)?\s+python -m deepspeed\.checkpoint\.ds_to_universal ",
                     refused.stdout, flags=re.M)


def test_convert_universal_needs_resume(tmp_path):
    proc = launch_pool.launch("examples/train.py", "--save-dir", str(tmp_path / "ckpt"),
                              "--convert-universal", nproc=1, cwd=REPO, env=ENV,
                              launcher="deepspeed")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert ("error: --convert-universal converts the checkpoint that --resume loads: pass "
            "--resume too") in proc.stdout
    assert not (tmp_path / "ckpt").exists()


def test_a_refused_resume_writes_nothing(tmp_path):
    """--resume with no complete checkpoint in --save-dir is refused before anything is
    written there (the model's config.json included), by both shipped scripts."""
    for script, launcher in (("examples/train.py", "deepspeed"),
                             ("examples/train_fsdp.py", "torchrun")):
        save = tmp_path / Path(script).stem
        save.mkdir()
        (save / "step4").mkdir()  # a save that did not finish: no layout record, no .metadata
        proc = launch_pool.launch(script, "--save-dir", str(save), "--resume", nproc=1,
                                  cwd=REPO, env=ENV, launcher=launcher)
        assert proc.returncode == 1 and "error: --resume: no " in proc.stdout, proc.stdout[-3000:]
        assert sorted(p.name for p in save.iterdir()) == ["step4"], script

