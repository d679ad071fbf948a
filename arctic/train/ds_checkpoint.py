"""DeepSpeed checkpoints that a killed run cannot leave half-written as the newest, and that
resume at another layout through DeepSpeed's universal checkpoint, or are refused by name.

Each checkpoint's tag directory holds ``arctic_layout.json``: the layout it was written at
(:class:`CheckpointLayout`) and the engine's global step. :func:`save_checkpoint` (the
``arctic.initialize`` path, ``examples/train.py``) writes it after every rank's files, so its
presence marks a complete checkpoint; ``latest`` is written after it. Under the HF Trainer the
Trainer's own last file marks completeness, and the trainer records the layout with
:func:`write_layout` before that file.

ZeRO partitions the optimizer state (and, at stage 3, the parameters) over every rank: the
dp x sp ranks under ``arctic.initialize``, all ranks under the Trainer. A checkpoint therefore
loads natively only at the world size and ZeRO stage it was written at; the sequence-parallel
degree alone does not matter to DeepSpeed. At another world size or stage the state is read
from a universal checkpoint, which ``python -m deepspeed.checkpoint.ds_to_universal`` converts
from the native one (:func:`plan_resume` finds it, or refuses with that command). Asked to,
:func:`load_checkpoint` runs that conversion first, on rank 0 (:mod:`arctic.train.ds_universal`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from arctic.config import zero_stage
from arctic.train.ds_universal import (UNIVERSAL_SUFFIX, convert_on_rank0, read_latest,
                                       universal_command, universal_converted)

LAYOUT_FILE = "arctic_layout.json"
"""In each tag directory: the layout and global step; for :func:`save_checkpoint`, also the
mark that every rank's files are written."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointLayout:
    """How a job is laid out, as far as its DeepSpeed checkpoint depends on it."""

    world_size: int
    """Ranks in the job; ZeRO partitions over all of them."""
    sequence_parallel_size: int
    """Ranks that share one sequence; ``world_size // sequence_parallel_size`` read
    different samples."""
    zero_stage: int
    """``zero_optimization.stage`` of the DeepSpeed config."""
    sp_mpu: bool
    """Whether DeepSpeed ran with the sequence-parallel ``mpu`` (``arctic.initialize``; not
    under the HF Trainer). DeepSpeed 0.19.8 records that mpu's size as the tensor-parallel
    degree of a ZeRO-1/2 checkpoint while writing one model file, which ``ds_to_universal``
    then refuses; ZeRO-3 checkpoints convert."""

    def __post_init__(self) -> None:
        if self.sequence_parallel_size < 1 or self.world_size % self.sequence_parallel_size:
            raise ValueError(f"sequence_parallel_size ({self.sequence_parallel_size}) must "
                             f"divide world_size ({self.world_size})")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def loads_natively(self, saved: CheckpointLayout) -> bool:
        """Whether DeepSpeed loads a checkpoint written at ``saved`` without conversion: the
        same ZeRO stage and, with ZeRO, the same number of partitions (the world size)."""
        return saved.zero_stage == self.zero_stage and (
            self.zero_stage == 0 or saved.world_size == self.world_size)

    def converts_to_universal(self) -> bool:
        """Whether ``ds_to_universal`` converts a checkpoint written at this layout."""
        return self.zero_stage == 3 or not self.sp_mpu or self.sequence_parallel_size == 1

    def describe(self) -> str:
        return (f"world_size={self.world_size}, sequence_parallel_size="
                f"{self.sequence_parallel_size}, data_parallel_size={self.data_parallel_size}, "
                f"zero_stage={self.zero_stage}")


def layout_of(ds_config: dict, *, world_size: int, sequence_parallel_size: int,
              sp_mpu: bool) -> CheckpointLayout:
    """The layout of a job running ``ds_config`` (its ZeRO stage) on ``world_size`` ranks;
    ``sp_mpu``: DeepSpeed is given the SP mpu (``arctic.initialize``), not under the
    Trainer."""
    return CheckpointLayout(world_size=world_size, sequence_parallel_size=sequence_parallel_size,
                            zero_stage=zero_stage(ds_config), sp_mpu=sp_mpu)


def _write_atomically(path: Path, text: str) -> None:
    # os.replace is atomic: a reader sees the old file or the new one, never a part.
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_layout(load_dir: str | os.PathLike, tag: str | None, layout: CheckpointLayout, *,
                 global_steps: int) -> None:
    """Record ``layout`` in ``load_dir/tag`` (``tag=None``: the one ``latest`` names). Call it
    on one rank, after every rank's files of the checkpoint are written."""
    tag = tag or read_latest(load_dir)
    if tag is None or not (Path(load_dir) / tag).is_dir():
        raise ValueError(f"write_layout: no checkpoint tag {tag!r} in {load_dir}")
    record = {**dataclasses.asdict(layout), "global_steps": global_steps}
    _write_atomically(Path(load_dir) / tag / LAYOUT_FILE, json.dumps(record, indent=1) + "\n")


def read_layout(tag_dir: str | os.PathLike) -> tuple[CheckpointLayout, int] | None:
    """``(layout, global_steps)`` recorded in ``tag_dir``; ``None`` if none is (the checkpoint
    is incomplete, or was written without a record)."""
    try:
        record = json.loads((Path(tag_dir) / LAYOUT_FILE).read_text())
        steps = record.pop("global_steps")
        return CheckpointLayout(**record), steps
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_tags(save_dir: str | os.PathLike) -> list[str]:
    """The tags in ``save_dir`` whose checkpoint is complete (holds its layout record),
    oldest first by global step."""
    found = []
    for child in Path(save_dir).iterdir() if Path(save_dir).is_dir() else ():
        if child.is_dir() and (record := read_layout(child)) is not None:
            found.append((record[1], child.name))
    return [tag for _, tag in sorted(found)]


def unfinished_tags(save_dir: str | os.PathLike) -> list[str]:
    """The checkpoint directories in ``save_dir`` that a resume skips: those without their
    layout record, which is written after every rank's files (a save that did not finish).
    Universal conversions, which hold none, are not among them."""
    return sorted(child.name for child in (Path(save_dir).iterdir()
                                           if Path(save_dir).is_dir() else ())
                  if child.is_dir() and not child.name.endswith(UNIVERSAL_SUFFIX)
                  and read_layout(child) is None)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ResumePlan:
    """What :func:`plan_resume` decided."""

    tag: str
    """The tag to load: the checkpoint's own, or its universal conversion's."""
    universal: bool
    """Whether DeepSpeed must load it as a universal checkpoint (``load_universal``)."""
    saved: CheckpointLayout
    """The layout the checkpoint was written at."""
    convert_from: str | None = None
    """The native tag to convert into ``tag`` before the load (``plan_resume(...,
    convert=True)`` and no finished conversion); ``None``: nothing to convert."""


def plan_resume(load_dir: str | os.PathLike, tag: str | None, layout: CheckpointLayout, *,
                load_universal: bool = False, convert: bool = False,
                convert_flag: str | None = None) -> ResumePlan:
    """How to load checkpoint ``load_dir/tag`` (``tag=None``: the one ``latest`` names) into a
    job laid out as ``layout``. It reads files only, the same on every rank, so every rank
    returns the same plan or raises the same ``ValueError``, before any collective.

    Args:
        load_dir: DeepSpeed's ``save_dir`` (the Trainer's ``checkpoint-N``).
        tag: the checkpoint's tag.
        layout: the resuming job's layout.
        load_universal: the DeepSpeed config's ``checkpoint.load_universal``; when set, the
            universal conversion is loaded at any layout.
        convert: when the universal checkpoint is needed and not converted yet, plan its
            conversion (``convert_from``) instead of refusing.
        convert_flag: the caller's option that sets ``convert`` (``--convert-universal``),
            named in the refusal beside the command.

    Returns:
        The native tag when it loads at ``layout``; its universal conversion when the layout
        differs (or ``load_universal`` is set) and the conversion exists, or ``convert`` is
        set (then with ``convert_from``).

    Raises:
        ValueError: no layout record in the checkpoint, or a universal checkpoint is needed
            and not converted yet: the message names both layouts and the command.
    """
    tag = tag or read_latest(load_dir)
    if tag is None:
        raise ValueError(f"no checkpoint to resume in {load_dir}: it has no 'latest' file")
    record = read_layout(Path(load_dir) / tag)
    if record is None:
        raise ValueError(f"checkpoint {Path(load_dir) / tag} holds no {LAYOUT_FILE}: its "
                         f"writing was interrupted, or it was not written by arctic's "
                         f"checkpointing, so the layout it was saved at is unknown")
    saved = record[0]
    native = layout.loads_natively(saved)
    if native and not load_universal:
        return ResumePlan(tag=tag, universal=False, saved=saved)
    if universal_converted(load_dir, tag):
        return ResumePlan(tag=f"{tag}{UNIVERSAL_SUFFIX}", universal=True, saved=saved)
    if not saved.converts_to_universal():
        raise ValueError(
            f"cannot resume from {Path(load_dir) / tag} at {layout.describe()}: it was saved "
            f"at {saved.describe()} under arctic.initialize, and DeepSpeed's ds_to_universal "
            f"cannot convert a ZeRO-{saved.zero_stage} checkpoint written with the "
            f"sequence-parallel mpu (it reads the SP degree as a tensor-parallel degree). "
            f"Resume at world_size={saved.world_size} with zero_stage={saved.zero_stage}, or "
            f"train with ZeRO-3, whose checkpoints convert")
    if convert:
        return ResumePlan(tag=f"{tag}{UNIVERSAL_SUFFIX}", universal=True, saved=saved,
                          convert_from=tag)
    why = ("the DeepSpeed config sets checkpoint.load_universal, and" if native else
           f"it was saved at {saved.describe()} and this job runs at {layout.describe()}: "
           f"ZeRO's shards depend on the world size and stage, so")
    raise ValueError(
        f"cannot resume from {Path(load_dir) / tag}: {why} it must be loaded from its "
        f"universal checkpoint, which does not exist yet. Convert it once (on one host, no "
        f"GPU needed):\n    {universal_command(load_dir, tag)}\nthen resume again: the "
        f"conversion is found and loaded"
        + ("" if native else " (no config change needed)")
        + (f"; or resume with {convert_flag}, which runs that command on rank 0 first"
           if convert_flag else "")
        + (". Or resume at the saved layout" if not native else
           ". Or remove checkpoint.load_universal from the config"))


def set_load_universal(engine, universal: bool) -> bool:
    """Set the engine's ``checkpoint.load_universal`` switch; returns what it was. DeepSpeed
    reads it only while loading (``engine.load_checkpoint`` and the optimizers'
    ``load_state_dict``), so it can be set for one load: a later checkpoint written at this
    layout loads natively without editing the config. (The engine keeps it in its private
    ``_config``; 0.19.8 has no public setter.)"""
    before = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = universal
    return before


def untie_optimizer_steps(engine) -> int:
    """After a universal load: give each optimizer state its own ``step`` tensor; returns how
    many were shared. DeepSpeed 0.19.8's ZeRO-3 universal load
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) sets one ``step`` tensor into
    the state of every sub-group, and torch's Adam increments it in place, once per sub-group
    and step: with two sub-groups (the HF Trainer's decay and no-decay groups) every resumed
    step would count twice in Adam's bias correction."""
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is None:
        return 0
    seen, shared = set(), 0
    for state in inner.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(step))
    return shared


@contextmanager
def _universal_load(engine, universal: bool):
    before = set_load_universal(engine, universal)
    try:
        yield
    finally:
        set_load_universal(engine, before)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(engine, save_dir: str | os.PathLike, *, tag: str, client_state: dict,
                    layout: CheckpointLayout) -> None:
    """``engine.save_checkpoint`` that a killed run cannot leave as the newest checkpoint.

    A leftover ``save_dir/tag`` (a killed write) is removed first; then every rank writes its
    files; after a barrier rank 0 writes the layout record, the mark of a complete
    checkpoint, and then DeepSpeed's ``latest``. DeepSpeed itself writes ``latest`` on rank 0
    without waiting for the other ranks' shards, so it is not asked to. All ranks call it.
    """
    if engine.checkpoint_engine.is_decoupled():
        raise ValueError(f"save_checkpoint: the DeepSpeed config's checkpoint engine "
                         f"({type(engine.checkpoint_engine).__name__}) is decoupled: it writes "
                         f"after save_checkpoint returns, so a complete checkpoint cannot be "
                         f"marked; use DeepSpeed's default checkpoint engine")
    save_dir = Path(save_dir)
    if _rank() == 0:
        shutil.rmtree(save_dir / tag, ignore_errors=True)
        save_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state,
                           save_latest=False)
    barrier()  # every rank's files are written
    if _rank() == 0:
        write_layout(save_dir, tag, layout, global_steps=engine.global_steps)
        _write_atomically(save_dir / "latest", tag)
    barrier()


def load_checkpoint(engine, save_dir: str | os.PathLike, *, layout: CheckpointLayout,
                    tag: str | None = None, convert: bool = False,
                    convert_flag: str | None = None) -> tuple[ResumePlan, dict]:
    """Load the newest complete checkpoint in ``save_dir`` (or ``tag``) into ``engine``, at
    ``layout``: natively, or from its universal conversion (:func:`plan_resume`). Returns the
    plan (which tag was loaded, how) and the client state it was saved with. ``ValueError``
    on every rank, before the load's first collective, when there is none or it needs a
    conversion that was not made. With ``convert``, a missing conversion is made first, by
    rank 0 while the others wait (:func:`~arctic.train.ds_universal.convert_on_rank0`);
    ``convert_flag`` is named in the refusal without it (:func:`plan_resume`)."""
    if tag is None:
        tags = complete_tags(save_dir)
        if not tags:
            raise ValueError(f"no complete checkpoint in {save_dir} (a complete one holds "
                             f"{LAYOUT_FILE}, written after every rank's files)")
        tag = tags[-1]
    plan = plan_resume(save_dir, tag, layout, load_universal=engine.load_universal_checkpoint(),
                       convert=convert, convert_flag=convert_flag)
    if plan.convert_from is not None:
        convert_on_rank0(save_dir, plan.convert_from)
    with _universal_load(engine, plan.universal):
        path, client = engine.load_checkpoint(str(save_dir), tag=plan.tag)
    if plan.universal or engine.load_universal_checkpoint():
        untie_optimizer_steps(engine)
    if path is None:
        raise ValueError(f"DeepSpeed could not load {Path(save_dir) / plan.tag}")
    return plan, client


__all__ = ["LAYOUT_FILE", "CheckpointLayout", "ResumePlan", "complete_tags", "layout_of",
           "load_checkpoint", "plan_resume", "read_latest", "read_layout", "save_checkpoint",
           "set_load_universal", "unfinished_tags", "universal_command", "universal_converted",
           "untie_optimizer_steps", "write_layout"]
