"""What the planner hands a user to launch the job it planned: the settings as a DeepSpeed
config's ``"ulysses"`` block, the command lines of ``examples/train.py`` and
``train_fsdp.py``, and the DeepSpeed JSON that ``--write-config`` writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from arctic.config import load_ds_config
from arctic.memory.placement import Placement, placement_from_ds_config


def ulysses_block(fields: dict) -> dict:
    """The settings as a DeepSpeed config's ``sequence_parallel_size`` and ``"ulysses"`` block."""
    block = {k: v for k, v in fields.items() if k != "sequence_parallel_size" and
             (k != "offload_dir" or v is not None)}
    return {"sequence_parallel_size": fields["sequence_parallel_size"], "ulysses": block}


def command_lines(args: argparse.Namespace, fields: dict, seq_len: int, config_path: str,
                  placement: Placement) -> list[str]:
    """How to launch the planned job: examples/train.py (DeepSpeed) and train_fsdp.py."""
    nodes = f" --num_nodes {args.nodes}" if args.nodes > 1 else ""
    model = f"--model {args.model} --seq-len {seq_len}"
    lines = [f"deepspeed --num_gpus {args.gpus}{nodes} examples/train.py "
             f"--deepspeed_config {config_path} {model}"]
    if placement.mode in ("none", "fsdp2"):
        nnodes = f" --nnodes {args.nodes}" if args.nodes > 1 else ""
        off = " --offload-params" if placement.mode == "fsdp2" else ""
        lines.append(f"torchrun --nproc-per-node {args.gpus}{nnodes} examples/train_fsdp.py "
                     f"--config {config_path} {model}{off}")
    return lines


def default_ds_config(mode: str) -> dict:
    """The DeepSpeed JSON written without --ds-config for the training state's placement
    ``mode``: ZeRO-3 with DeepSpeed's default sizes, the state offloaded as ``mode`` says."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if mode in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if mode == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if mode == "fsdp2":  # train_fsdp.py reads only the SP settings
        zero = {"stage": 0}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}


def written_placement(mode: str, sp_size: int) -> Placement:
    """The placement of the training state that the config written for ``mode`` gives
    (:func:`default_ds_config`): with the state offloaded, ZeRO-3's gradient bucket on the
    device (``device_fixed``) at DeepSpeed's default size, which a bare ``Placement(mode)``
    leaves out."""
    if mode in ("none", "fsdp2"):
        return Placement(mode)
    return placement_from_ds_config(dict(default_ds_config(mode),
                                         sequence_parallel_size=sp_size))


def write_config(path: Path, args: argparse.Namespace, fields: dict,
                 placement: Placement) -> None:
    """A DeepSpeed JSON with the settings: --ds-config's with its block replaced, or ZeRO-3."""
    ds = (load_ds_config(args.ds_config) if args.ds_config is not None
          else default_ds_config(placement.mode))
    ds.pop("activation_checkpointing", None)  # the block below says it
    block = ulysses_block(fields)  # over the config's own block: its other keys stay
    ds["sequence_parallel_size"] = block["sequence_parallel_size"]
    ds["ulysses"] = {**(ds.get("ulysses") or {}), **block["ulysses"]}
    path.write_text(json.dumps(ds, indent=2) + "\n")


__all__ = ["command_lines", "default_ds_config", "ulysses_block", "write_config",
           "written_placement"]
