"""Memory around the recipe: activation checkpointing with the layer inputs offloaded
(:mod:`~arctic.memory.checkpointing`, over :mod:`offload`), where the training state lives
and what host memory that leaves (:mod:`~arctic.memory.placement`), and the CUDA allocator's
settings (:mod:`~arctic.memory.allocator`).
"""

from arctic.memory.checkpointing import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing"]
