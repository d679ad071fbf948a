"""Ulysses sequence parallelism: the model-agnostic engine (torch only).

Public API::

    from ulysses import SequenceParallelDims, ulysses_attention, DistributedAttention
    from ulysses import shard_sequence, gather_sequence, ring_attention
"""

from ulysses.all_to_all import all_to_all, all_to_all_async
from ulysses.attention import local_attention, ulysses_attention
from ulysses.buffer_pool import BufferPool
from ulysses.kernels import BACKENDS, select_backend
from ulysses.layer import DistributedAttention
from ulysses.mesh import DeepSpeedMPU, SequenceParallelDims, flat_mesh, mesh_dims
from ulysses.ring import ring_attention
from ulysses.sharding import gather_sequence, head_layout, padded_len, shard_sequence

__all__ = [
    "BACKENDS",
    "BufferPool",
    "DeepSpeedMPU",
    "DistributedAttention",
    "SequenceParallelDims",
    "all_to_all",
    "all_to_all_async",
    "gather_sequence",
    "head_layout",
    "local_attention",
    "flat_mesh",
    "mesh_dims",
    "padded_len",
    "ring_attention",
    "select_backend",
    "shard_sequence",
    "ulysses_attention",
]
