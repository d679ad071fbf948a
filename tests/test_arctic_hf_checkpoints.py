"""The HF Trainer's checkpoints under FSDP2 (``SequenceParallelTrainer``, launched with torchrun
as users launch it): the whole training state is written and read back.

- 6 steps uninterrupted, against a run killed while writing its checkpoint-6 and resumed with
  ``resume_from_checkpoint=True``: the resume takes checkpoint-3 (the newest complete one),
  and the losses of steps 4-6 and the final parameters equal the uninterrupted run's (fp32,
  1e-6), with AdamW and a linear schedule with warmup, shuffled, across an epoch boundary;
  ``save_total_limit=1`` kept checkpoint-3 while checkpoint-6 was being written, and leaves
  the new checkpoint-6 alone at the end.
- The checkpoint-3 of the SP=2 run on 2 ranks resumes at SP=4 on 4 ranks (DCP reshards):
  the losses of steps 4-6 and the final parameters equal the SP=2 run's within 1e-5.
- ``load_best_model_at_end`` loads the best checkpoint's sharded model back.
"""

from __future__ import annotations

import json
import os
import launch_pool
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

from test_arctic_hf_trainer import REPO, SCRIPT, _check_parameters, _finish  # noqa: E402

SP_JSON = REPO / "configs" / "cpu_trainer_fsdp.json"
# 4 samples, 4 steps an epoch: checkpoint-3 is mid-epoch 0, steps 5-6 are epoch 1's shuffle
RUN = ["--train-samples", "4", "--max-steps", "6", "--save-steps", "3", "--shuffle",
       "--optim", "adamw_torch", "--lr", "3e-3", "--lr-scheduler", "linear",
       "--warmup-steps", "2"]


def _launch(out_dir: Path, *args: str, nproc: int = 2, sp_json: Path = SP_JSON,
            script: str = SCRIPT, env: dict | None = None) -> launch_pool.Started:
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
           str(nproc), script, "--fsdp", str(sp_json), *RUN, *args,
           "--output-dir", str(out_dir), "--losses-out", str(out_dir / "run.json"),
           "--use-model", str(out_dir / "model")]
    return launch_pool.Started(cmd, cwd=REPO, env={**os.environ, **(env or {})})


def _run(out_dir: Path, *args: str, nproc: int = 2, sp_json: Path = SP_JSON) -> dict:
    return _finish(_launch(out_dir, *args, nproc=nproc, sp_json=sp_json), out_dir / "run.json")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The SP=2 run on 2 ranks, 6 steps, checkpoints at 3 and 6."""
    return _run(tmp_path_factory.mktemp("uninterrupted"))


def _steps_after_resume(run: dict, reference: dict, rel: float) -> None:
    print(f"\nuninterrupted {reference['loss_by_step']}\nresumed       {run['loss_by_step']}")
    assert run["global_step"] == reference["global_step"] == 6
    for step in ("4", "5", "6"):
        assert run["loss_by_step"][step] == pytest.approx(reference["loss_by_step"][step],
                                                          rel=rel, abs=0), step


@pytest.mark.hf_facing  # the Trainer's checkpoint methods, overridden
def test_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted):
    from transformers.trainer import TRAINER_STATE_NAME

    from arctic.export import TRAINER_STATE
    from arctic.train.trainer import resolve_checkpoint

    assert TRAINER_STATE == TRAINER_STATE_NAME  # the file the Trainer writes last

    out = tmp_path / "run"
    killed = _launch(out, "--save-total-limit", "1",
                     script=str(REPO / "tests" / "hf_trainer_killed_saving.py"),
                     env={"KILL_SAVING_STEP": "6"})
    log, _ = killed.communicate(timeout=300)
    assert killed.returncode != 0, log[-3000:]
    # checkpoint-6 was being written (its shards and weights are there, not its
    # trainer_state.json); checkpoint-3 was not rotated away
    partial = out / "checkpoint-6"
    assert (partial / "dcp" / ".metadata").is_file(), log[-3000:]
    assert not (partial / "trainer_state.json").exists()
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    assert resolve_checkpoint(True, str(out)) == str(out / "checkpoint-3")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_checkpoint(str(partial), str(out))

    resumed = _run(out, "--save-total-limit", "1", "--resume")
    _steps_after_resume(resumed, uninterrupted, 1e-6)
    _check_parameters(resumed, uninterrupted, 1e-6)
    # save_total_limit=1: the rewritten checkpoint-6 alone is left, complete
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())[
        "global_step"] == 6


def test_resumes_at_another_sp_degree_and_world_size(tmp_path, uninterrupted):
    sp4 = tmp_path / "sp4.json"
    sp4.write_text(json.dumps({**json.loads(SP_JSON.read_text()), "sequence_parallel_size": 4}))
    checkpoint = Path(uninterrupted["model_dir"]).parent / "checkpoint-3"
    resumed = _run(tmp_path / "sp4", "--resume-from", str(checkpoint), nproc=4, sp_json=sp4)
    _steps_after_resume(resumed, uninterrupted, 1e-5)
    _check_parameters(resumed, uninterrupted, 1e-5)


@pytest.mark.slow
def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, uninterrupted):
    """The eval loss counted best when highest: the best checkpoint is checkpoint-3 (the loss
    falls), which the trainer loads back at the end, so the final model is checkpoint-3's."""
    run = _run(tmp_path / "best", "--load-best", "highest")
    assert run["loss_by_step"] == uninterrupted["loss_by_step"]
    assert Path(run["best_model_checkpoint"]).name == "checkpoint-3"
    # the model after train() evaluates to the best checkpoint's eval loss, not the last's
    assert run["eval_loss"] == pytest.approx(run["best_metric"], rel=1e-6, abs=0)
    assert run["eval_loss"] > uninterrupted["eval_loss"] * 1.001
    _check_parameters(run, {"model_dir": tmp_path / "best" / "checkpoint-3"}, 1e-6)
