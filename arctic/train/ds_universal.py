"""DeepSpeed's universal checkpoint: the copy of a checkpoint that loads at any layout.

``python -m deepspeed.checkpoint.ds_to_universal`` converts the native checkpoint
``load_dir/T`` into ``load_dir/T_universal``, which DeepSpeed loads at any world size and ZeRO
stage, and points ``load_dir/latest_universal`` at it as its very last step. This module names
that command (:func:`universal_command`), tells a finished conversion from an interrupted one
(:func:`universal_converted`), and runs it: from one process (:func:`convert_to_universal`),
or inside a job (:func:`convert_on_rank0`), where rank 0 runs it while the other ranks wait.

The conversion reads every rank's shards on one host (all the optimizer state in host memory)
and writes a second copy of the checkpoint, which at scale takes longer than DeepSpeed's
collective timeout (``DEEPSPEED_TIMEOUT``, 10 minutes by default). The waiting ranks therefore
wait on a gloo group of their own, whose timeout is the conversion's. The converter runs as a
subprocess: its memory is returned when it ends, and its worker pools are not forked from a
process that runs the job's communication threads.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

UNIVERSAL_SUFFIX = "_universal"
"""The universal conversion of tag ``T`` is the tag ``T_universal`` beside it."""
CONVERTER = "deepspeed.checkpoint.ds_to_universal"
"""DeepSpeed's converter, run as ``python -m``."""
CONVERSION_TIMEOUT = timedelta(hours=12)
"""How long the other ranks wait for rank 0's conversion (:func:`convert_on_rank0`)."""


def read_latest(load_dir: str | os.PathLike, name: str = "latest") -> str | None:
    """The tag DeepSpeed's ``latest`` (or ``latest_universal``) file in ``load_dir`` names."""
    try:
        return (Path(load_dir) / name).read_text().strip() or None
    except OSError:
        return None


def _converter_args(load_dir: str | os.PathLike, tag: str) -> list[str]:
    src, dst = Path(load_dir) / tag, Path(load_dir) / f"{tag}{UNIVERSAL_SUFFIX}"
    return ["--input_folder", str(src), "--output_folder", str(dst), "--inject_missing_state"]


def universal_command(load_dir: str | os.PathLike, tag: str) -> str:
    """The shell command that converts ``load_dir/tag`` into the universal checkpoint
    ``load_dir/tag_universal`` (and points ``load_dir/latest_universal`` at it)."""
    return shlex.join(["python", "-m", CONVERTER, *_converter_args(load_dir, tag)])


def universal_converted(load_dir: str | os.PathLike, tag: str) -> bool:
    """Whether the conversion of ``load_dir/tag`` finished: ``ds_to_universal`` points
    ``latest_universal`` at its output last of all."""
    converted = f"{tag}{UNIVERSAL_SUFFIX}"
    return read_latest(load_dir, "latest_universal") == converted and \
        (Path(load_dir) / converted / "zero" / "optimizer_state.pt").is_file()


def convert_to_universal(load_dir: str | os.PathLike, tag: str) -> float:
    """Run :func:`universal_command` for ``load_dir/tag`` and wait for it; returns the
    seconds it took. What an interrupted conversion of the tag left is removed first
    (``latest_universal`` too, if it names it), so the output counts as converted
    (:func:`universal_converted`) only once this run has finished. The converter's output
    goes to this process's stdout and stderr.

    Raises:
        RuntimeError: the converter failed, or exited without finishing the conversion.
    """
    load_dir = Path(load_dir)
    out = load_dir / f"{tag}{UNIVERSAL_SUFFIX}"
    if read_latest(load_dir, "latest_universal") == out.name:
        (load_dir / "latest_universal").unlink()
    shutil.rmtree(out, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", CONVERTER, *_converter_args(load_dir, tag)],
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the universal conversion of {load_dir / tag} failed: "
                           f"{universal_command(load_dir, tag)} exited with status "
                           f"{done.returncode} (its output is above)")
    if not universal_converted(load_dir, tag):
        raise RuntimeError(f"{universal_command(load_dir, tag)} exited without finishing: "
                           f"latest_universal does not name {out.name}, or {out}/zero holds "
                           f"no optimizer_state.pt")
    return time.perf_counter() - start


def convert_on_rank0(load_dir: str | os.PathLike, tag: str, *,
                     timeout: timedelta = CONVERSION_TIMEOUT) -> None:
    """Convert ``load_dir/tag`` to its universal checkpoint once, on rank 0, while the other
    ranks wait. Every rank calls it (it makes a process group). Rank 0 prints
    ``converting <load_dir>/<tag> to a universal checkpoint (ds_to_universal) ...`` and then
    ``converted in N s``. ``load_dir`` must be a directory every rank reads (as it is for
    the load that follows).

    Args:
        load_dir: DeepSpeed's ``save_dir``.
        tag: the native checkpoint's tag.
        timeout: how long the other ranks wait, on a gloo group of their own (DeepSpeed's
            collective timeout is far shorter than a large model's conversion).

    Raises:
        RuntimeError: on every rank, when rank 0's conversion failed.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None
    try:
        failure: BaseException | None = None
        if rank == 0:
            print(f"converting {Path(load_dir) / tag} to a universal checkpoint "
                  f"(ds_to_universal) ...", flush=True)
            try:
                seconds = convert_to_universal(load_dir, tag)
                print(f"converted in {seconds:.0f} s: {Path(load_dir) / tag}{UNIVERSAL_SUFFIX}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others learn
                failure = e
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        if group is not None:
            dist.broadcast_object_list(outcome, src=0, group=group)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise RuntimeError(f"rank 0 could not convert {Path(load_dir) / tag}: {outcome[0]}")
    finally:
        if group is not None:
            dist.destroy_process_group(group)


__all__ = ["CONVERSION_TIMEOUT", "UNIVERSAL_SUFFIX", "convert_on_rank0", "convert_to_universal",
           "read_latest", "universal_command", "universal_converted"]
