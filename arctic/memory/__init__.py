"""Memory around the recipe: activation checkpointing with the layer inputs offloaded
(:mod:`~arctic.memory.checkpointing`, over :mod:`offload`), where the training state lives
and what host memory that leaves (:mod:`~arctic.memory.placement`), and the CUDA allocator's
settings (:mod:`~arctic.memory.allocator`), and per-step tokens/s and peaks for a loop of
one's own (:mod:`~arctic.memory.meter`).
"""

from arctic.memory.checkpointing import apply_activation_checkpointing
from arctic.memory.meter import StepMeter, gather_peak_memory_mib, peak_memory_mib

__all__ = ["StepMeter", "apply_activation_checkpointing", "gather_peak_memory_mib",
           "peak_memory_mib"]
