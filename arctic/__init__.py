"""The training recipe around real models: HF attention, SP data, tiling, the SP loss.

The recipe (:mod:`arctic.recipe`) runs its stages in one order (:mod:`arctic.order`); the
parts of a HF model they act on are found in one place (:mod:`arctic.hf.anatomy`). The
packages by role: :mod:`arctic.hf` (HF integration), :mod:`arctic.data` (the data path),
:mod:`arctic.loss` (the losses), :mod:`arctic.tiling`, :mod:`arctic.memory` (checkpointing,
placement, allocator), :mod:`arctic.train` (DeepSpeed, FSDP2, the HF Trainer) and
:mod:`arctic.plan` (the planner); :mod:`arctic.config` is the schema and
:mod:`arctic.removal` takes SP off a model and puts it back. torch-only pieces import eagerly;
:func:`apply_sequence_parallel` (transformers) and :func:`initialize` (DeepSpeed) import their
framework on first use (``pip install ".[hf]"``).
"""

from arctic.config import SequenceParallelConfig
from arctic.data import SequenceParallelDataLoader, prepare_sp_batch, sp_sampler
from arctic.hf.vlm import vision_inputs
from arctic.loss import apply_sp_loss, sp_token_loss, tiled_logits_loss
from arctic.memory import StepMeter, apply_activation_checkpointing
from arctic.recipe import apply_sp_recipe
from arctic.removal import remove_sequence_parallel, restore_sequence_parallel
from arctic.tiling import TiledMLP, apply_tiled_layers, apply_tiled_mlp
from arctic.train.deepspeed import initialize
from arctic.train.fsdp import apply_fsdp

__all__ = [
    "SequenceParallelConfig",
    "SequenceParallelDataLoader",
    "StepMeter",
    "TiledMLP",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_sequence_parallel",
    "apply_sp_loss",
    "apply_sp_recipe",
    "apply_tiled_layers",
    "apply_tiled_mlp",
    "initialize",
    "prepare_sp_batch",
    "remove_sequence_parallel",
    "restore_sequence_parallel",
    "sp_sampler",
    "sp_token_loss",
    "tiled_logits_loss",
    "vision_inputs",
]


def __getattr__(name: str):
    if name == "apply_sequence_parallel":
        from arctic.hf.attention import apply_sequence_parallel

        return apply_sequence_parallel
    raise AttributeError(f"module 'arctic' has no attribute {name!r}")
