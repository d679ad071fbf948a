"""Hybrid Ulysses x Ring (USP): which inner attention runs between the two all-to-alls.

On a mesh with ring degree R and Ulysses degree U, rank (ring r, ulysses u) holds a sequence
piece of ``s = S / (R U)`` rows. The Ulysses all-to-all inside its ulysses group gives it all
``L = U s`` rows of ring rank r for its ``h`` local heads: under zigzag, exactly chunks r and
2R-1-r, because :func:`ulysses.sharding.shard_sequence` splits that chunk pair among the U
ranks in order. Ring attention then runs across the R ranks that hold the same heads (the
``"ring"`` axis), and the reverse all-to-all returns ``out`` to the sequence layout. With
head chunking the same happens one chunk of heads at a time.

- R = 1: the inner attention is the single-rank kernel, i.e. exactly plain Ulysses.
- U = 1: the all-to-alls are skipped and this is pure ring attention.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ulysses.band import WindowAttention
from ulysses.kernels import LocalAttention
from ulysses.mesh import axis_group, axis_rank, axis_size, mesh_dims
from ulysses.ring import RingAttention, check_ring_rows
from ulysses.segments import SegmentedAttention


def check_hybrid(local_rows: int, mesh: DeviceMesh) -> None:
    """Raise ``ValueError`` if ``local_rows`` (the sequence piece ``s``) does not fit the
    mesh's ring layout: zigzag needs the ring rank's ``U s`` rows to form two equal chunks."""
    check_ring_rows(local_rows * axis_size(mesh, "ulysses"), axis_size(mesh, "ring"),
                    mesh_dims(mesh).zigzag)


def inner_attention(mesh: DeviceMesh, *, causal: bool, scale: float, backend: str,
                    kv_len: int | None, window: int | None = None,
                    comm_dtype: torch.dtype | None = None, softcap: float = 0.0,
                    starts: tuple[tuple[int, ...], ...] | None = None,
                    layout: tuple[tuple[int, ...], ...] | None = None
                    ) -> LocalAttention | WindowAttention | SegmentedAttention | RingAttention:
    """The attention to run on full-ring-rank, local-head tensors.

    ``kv_len`` (non-causal padding) counts keys of the whole sequence; the ring trims each
    block to its real keys, the local kernel trims its one block. The ring's row layout is
    the mesh's (:func:`ulysses.mesh.mesh_dims`). ``window``: a sliding window
    (:mod:`ulysses.band`; symmetric when not causal), over the whole sequence on a ring too.
    ``comm_dtype``: what the ring's hops carry (:class:`RingAttention`). ``softcap``: logit
    softcapping inside the softmax (0: none). ``starts``: packed documents (per batch row,
    the full-sequence first position of each): one attention per document on one ring rank
    (:class:`ulysses.segments.SegmentedAttention`), per-document pieces on a ring.
    ``layout``: a ring's rows were cut document by document, by these documents (a mesh
    built with ``per_document``; :class:`RingAttention`).
    """
    R = axis_size(mesh, "ring")
    if R == 1:
        if starts is not None:
            return SegmentedAttention(causal=causal, scale=scale, backend=backend, starts=starts,
                                      window=window, softcap=softcap)
        if window is not None:
            return WindowAttention(window=window, scale=scale, backend=backend, softcap=softcap,
                                   causal=causal, kv_len=kv_len)
        return LocalAttention(causal=causal, scale=scale, backend=backend, kv_len=kv_len,
                              softcap=softcap)
    return RingAttention(group=axis_group(mesh, "ring"), rank=axis_rank(mesh, "ring"), size=R,
                         causal=causal, scale=scale, backend=backend,
                         zigzag=mesh_dims(mesh).zigzag, kv_len=kv_len, window=window,
                         comm_dtype=comm_dtype, softcap=softcap, starts=starts, layout=layout)
