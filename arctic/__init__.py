"""The training recipe around real models: HF attention, SP data, tiling, the SP loss.

The recipe's stages run in one order (:mod:`arctic.order`), and the parts of a HF model they
act on are found in one place (:mod:`arctic.anatomy`). torch-only pieces import eagerly;
:func:`apply_sequence_parallel` (transformers) and :func:`initialize` (DeepSpeed) import their
framework on first use (``pip install ".[hf]"``).
"""

from arctic.checkpointing import apply_activation_checkpointing
from arctic.config import SequenceParallelConfig
from arctic.data import SequenceParallelDataLoader, prepare_sp_batch
from arctic.fsdp import apply_fsdp
from arctic.loss import apply_sp_loss, sp_token_loss
from arctic.removal import remove_sequence_parallel, restore_sequence_parallel
from arctic.tiled_layer import apply_tiled_layers
from arctic.tiling import TiledMLP, apply_tiled_mlp, tiled_logits_loss
from arctic.vlm import vision_inputs

__all__ = [
    "SequenceParallelConfig",
    "SequenceParallelDataLoader",
    "TiledMLP",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_sequence_parallel",
    "apply_sp_loss",
    "apply_tiled_layers",
    "apply_tiled_mlp",
    "initialize",
    "prepare_sp_batch",
    "remove_sequence_parallel",
    "restore_sequence_parallel",
    "sp_token_loss",
    "tiled_logits_loss",
    "vision_inputs",
]


def __getattr__(name: str):
    if name == "apply_sequence_parallel":
        from arctic.hf_attention import apply_sequence_parallel

        return apply_sequence_parallel
    if name == "initialize":
        from arctic.engine import initialize

        return initialize
    raise AttributeError(f"module 'arctic' has no attribute {name!r}")
