"""Activation checkpointing and CPU offload of checkpointed activations (torch only).

- :func:`apply_activation_checkpointing`: non-reentrant checkpointing of the layers it is
  given, one by one; with ``offload_to_cpu=True`` the layer inputs it keeps live in pinned
  host buffers, copied out on a side stream and prefetched back one layer ahead in backward.
  :func:`check_activation_checkpointing` is its argument check alone.
- :func:`offload_saved_activations`: the same offload for any block of code, as a context.
- :class:`HostBufferPool`: the reusable host buffers, their limit and their accounting;
  given a ``disk_dir``, what does not fit spills to files there (:class:`DiskTier`,
  :mod:`offload.disk`), read back ahead of use in backward, through plain file I/O or
  DeepSpeed's async I/O op (``disk_io``, :mod:`offload.disk_aio`).

Nothing here knows a model family: which modules are layers, and the order in which the
recipe's ``apply_*`` functions run, belong to ``arctic`` (``arctic.hf.anatomy``,
``arctic.order``, ``arctic.apply_activation_checkpointing``).
"""

from offload.activations import (
                                 DEFAULT_MIN_OFFLOAD_BYTES,
                                 HostBufferPool,
                                 OffloadSession,
                                 OffloadStats,
                                 default_host_limit,
                                 offload_saved_activations,
)
from offload.checkpoint import (
                                 apply_activation_checkpointing,
                                 check_activation_checkpointing,
)
from offload.disk import DiskTier

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DiskTier",
    "HostBufferPool",
    "OffloadSession",
    "OffloadStats",
    "apply_activation_checkpointing",
    "check_activation_checkpointing",
    "default_host_limit",
    "offload_saved_activations",
]
