"""Activation checkpointing and CPU offload of checkpointed activations (torch only).

- :func:`apply_activation_checkpointing`: per-decoder-layer non-reentrant checkpointing; with
  ``offload_to_cpu=True`` the layer inputs it keeps live in pinned host buffers, copied out on
  a side stream and prefetched back one layer ahead in backward.
- :func:`offload_saved_activations`: the same offload for any block of code, as a context.
- :class:`HostBufferPool`: the reusable host buffers, their limit and their accounting.
- :mod:`offload.order`: the fixed order of all ``apply_*`` functions.
"""

from offload.activations import (DEFAULT_MIN_OFFLOAD_BYTES, HostBufferPool, OffloadSession,
                                 OffloadStats, default_host_limit, offload_saved_activations)
from offload.checkpoint import apply_activation_checkpointing, decoder_layers

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "HostBufferPool",
    "OffloadSession",
    "OffloadStats",
    "apply_activation_checkpointing",
    "decoder_layers",
    "default_host_limit",
    "offload_saved_activations",
]
