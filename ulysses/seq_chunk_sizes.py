"""Sizes and settings of the sequence-chunked loop (:mod:`ulysses.seq_chunk`): the checks of
``seq_chunk``, how a piece is cut into blocks, the ``"auto"`` block count, and the mask of the
attention the blocks run. Pure arithmetic on shapes (no tensors, no process group), identical
on every rank.

Shape legend: B batch, s this rank's piece, U Ulysses ranks, N blocks per piece, c / ck query
/ kv heads of a chunk, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ulysses.band import WindowAttention, acc_dtype
from ulysses.chunk_schedule import DEFAULT_CHUNK_BUDGET_BYTES
from ulysses.kernels import LocalAttention
from ulysses.sharding import HeadLayout

__all__ = ["SeqChunking", "block_bounds", "block_buffer_bytes", "check_seq_chunk",
           "resolve_seq_chunk", "seq_chunking"]


def check_seq_chunk(seq_chunk, *, head_chunk_size, local_len: int | None, ring_degree: int,
                    segments=None, sinks=None, chunk_overlap: bool | None = None) -> None:
    """``ValueError`` unless ``seq_chunk`` is None, ``"auto"`` or an int in ``[1, local_len]``
    (``local_len`` None: not known yet) used with head chunking, without a ring, packed
    documents, sinks or ``chunk_overlap=True``; and unless ``chunk_overlap`` is None or a
    bool."""
    if chunk_overlap is not None and not isinstance(chunk_overlap, bool):
        raise ValueError(f"chunk_overlap must be None, True or False, got {chunk_overlap!r}")
    if seq_chunk is None:
        return
    if chunk_overlap:
        raise ValueError("chunk_overlap=True with seq_chunk: the sequence-chunked loop does "
                         "not overlap its block exchanges with compute yet; leave "
                         "chunk_overlap unset (None) or False")
    if seq_chunk != "auto" and (isinstance(seq_chunk, bool) or not isinstance(seq_chunk, int)
                                or seq_chunk < 1):
        raise ValueError(f"seq_chunk must be None, a positive int (blocks per rank's piece) or "
                         f"'auto', got {seq_chunk!r}")
    if head_chunk_size is None:
        raise ValueError("seq_chunk needs head_chunk_size (an int or 'auto'): sequence blocks "
                         "are cut inside a head chunk")
    if ring_degree > 1:
        raise ValueError(f"seq_chunk with a ring is not supported yet (ring_degree="
                         f"{ring_degree}); use ring_degree=1 or seq_chunk=None")
    if segments is not None:
        raise ValueError("seq_chunk with packed documents (segments) is not supported yet; "
                         "use seq_chunk=None")
    if sinks is not None:
        raise ValueError("seq_chunk with attention sinks is not supported yet; use "
                         "seq_chunk=None")
    if seq_chunk != "auto" and local_len is not None and seq_chunk > local_len:
        raise ValueError(f"seq_chunk={seq_chunk} is more blocks than this rank's {local_len} "
                         f"rows; use at most {local_len}")


def block_bounds(local_len: int, num_blocks: int) -> tuple[tuple[int, int], ...]:
    """``(first row, rows)`` of each block of a piece, as ``torch.tensor_split`` cuts it."""
    size, extra = divmod(local_len, num_blocks)
    bounds, start = [], 0
    for t in range(num_blocks):
        n = size + (t < extra)
        bounds.append((start, n))
        start += n
    return tuple(bounds)


def block_buffer_bytes(layout: HeadLayout, c: int, num_blocks: int, batch: int, local_len: int,
                       head_dim: int, dtype: torch.dtype) -> int:
    """Estimated device bytes of the block buffers alive at the backward peak.

    Per row of the largest exchange block: q, out, dout and their send buffers, dq's
    exchange (about 5c heads in the input dtype), k and v with the next block's in flight and
    the kernels' dk, dv (6ck); the dq sum and dk/dv sums with the next block's (c + 4ck, in
    float32 for half inputs)."""
    groups = min(h // k for h, k in zip(layout.q_sizes, layout.kv_sizes))
    ck = max(1, -(-c // groups))
    rows = len(layout.q_sizes) * -(-local_len // num_blocks)
    wide = torch.empty((), dtype=acc_dtype(dtype)).element_size()
    per_head = torch.empty((), dtype=dtype).element_size()
    return batch * rows * head_dim * ((5 * c + 6 * ck) * per_head + (c + 4 * ck) * wide)


def resolve_seq_chunk(seq_chunk, layout: HeadLayout, c: int, batch: int, local_len: int,
                      head_dim: int, dtype: torch.dtype,
                      budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int | None:
    """The number of blocks: ``seq_chunk`` itself (checked by :func:`check_seq_chunk`), or
    for ``"auto"`` the fewest whose :func:`block_buffer_bytes` fit ``budget_bytes`` (one row
    per block if none does). Pure arithmetic on shapes: every rank gets the same answer."""
    if seq_chunk != "auto":
        return seq_chunk
    one_row = block_buffer_bytes(layout, c, local_len, batch, local_len, head_dim, dtype)
    rows = budget_bytes // one_row  # rows per block that fit
    return local_len if rows < 1 else min(local_len, -(-local_len // rows))


@dataclass(frozen=True, slots=True)
class SeqChunking:
    """What the sequence-chunked loop needs besides a :class:`ChunkConfig`: blocks per piece,
    and the mask of the attention between the exchanges."""

    num_blocks: int
    causal: bool
    scale: float
    backend: str
    kv_len: int | None = None
    """Keys at global positions from ``kv_len`` on are padding (non-causal only)."""
    window: int | None = None
    """A causal sliding window (:mod:`ulysses.band`), or None."""


def seq_chunking(attn, num_blocks: int) -> SeqChunking:
    """The :class:`SeqChunking` of ``num_blocks`` blocks for the inner attention ``attn`` of
    :func:`ulysses.attention.between_exchanges`; ValueError for one it cannot cut (a ring, or
    documents)."""
    if isinstance(attn, WindowAttention):
        return SeqChunking(num_blocks, True, attn.scale, attn.backend, None, attn.window)
    if isinstance(attn, LocalAttention):
        return SeqChunking(num_blocks, attn.causal, attn.scale, attn.backend, attn.kv_len)
    raise ValueError(f"seq_chunk needs the local kernel between the exchanges, got "
                     f"{type(attn).__name__} (a ring or packed documents)")


