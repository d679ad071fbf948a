"""A small pool of flat scratch buffers, reused across chunks and layers.

Head-chunked attention needs the same few full-sequence chunk buffers at every chunk of every
layer. Allocating them once and handing them back keeps the peak at a fixed number of chunk
buffers, however many chunks or layers run. The pool is an ordinary object passed explicitly
(no module state): one per model, or one per call when none is given.

A request is served by the smallest free buffer of the same dtype and device that is large
enough (as a prefix view), so the different sizes a chunk step needs (q vs kv heads, send vs
receive) share buffers instead of each keeping their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses.torch_internals import view_base


@dataclass(slots=True)
class PoolStats:
    allocated: int = 0
    """Distinct buffers the pool has created (each is one allocation)."""
    allocated_bytes: int = 0
    """Bytes of those buffers."""
    reused: int = 0
    """acquire() calls served from a free buffer."""
    freed: int = 0
    """Buffers dropped, by clear() or because the free list was full."""
    host_bytes: int = 0
    """Host bytes the calls using this pool hold now: the sequence-chunked loop's parked
    blocks (:mod:`ulysses.host_blocks`)."""
    peak_host_bytes: int = 0
    """The most of :attr:`host_bytes` at any time (what the memory planner adds to the host)."""


class BufferPool:
    """Flat buffers, reused best-fit per ``(dtype, device)``.

    Args:
        max_free: most buffers kept while not in use; releasing beyond it frees the smallest,
            so the pool never grows without bound. Buffers in use are the caller's. The
            default covers head chunking's steady state with overlap.
        keep_between_calls: keep the free buffers when a head-chunked call (a forward or a
            backward) ends, for the next call (another layer). False frees them at the end of
            every call: chunks still share buffers within the call, but nothing is held while
            the rest of the model runs (the MLP, the loss, other layers' recompute), where a
            kept buffer would only add to the peak. The caching allocator on CUDA makes the
            re-allocation cheap.
        on_allocate: called with each buffer the pool creates (never with one it reuses), or
            None. An observer's hook on this one pool: the memory planner
            (:func:`arctic.plan.track_peak`) sets it on a model's pools to tell their chunk
            buffers apart from other allocations. It may be set or reset at any time.
    """

    def __init__(self, max_free: int = 32, *, keep_between_calls: bool = True,
                 on_allocate: Callable[[Tensor], None] | None = None) -> None:
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self.max_free = max_free
        self.keep_between_calls = keep_between_calls
        self.on_allocate = on_allocate
        self.stats = PoolStats()
        self._free: list[Tensor] = []  # base buffers, not in use

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D buffer of ``numel`` elements; its contents are undefined."""
        device = torch.device(device)
        fits = [i for i, b in enumerate(self._free)
                if b.dtype == dtype and b.device == device and b.numel() >= numel]
        if fits:
            base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            self.stats.reused += 1
        else:
            base = torch.empty(numel, dtype=dtype, device=device)
            self.stats.allocated += 1
            self.stats.allocated_bytes += base.numel() * base.element_size()
            if self.on_allocate is not None:
                self.on_allocate(base)
        return base[:numel]

    def release(self, buf: Tensor) -> None:
        """Return ``buf`` (from :meth:`acquire`); the caller must not use it afterwards."""
        base = view_base(buf)
        if any(b is base for b in self._free):
            raise ValueError("buffer released twice")
        self._free.append(base)
        if len(self._free) > self.max_free:
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
            self.stats.freed += 1

    def num_free(self) -> int:
        return len(self._free)

    def free_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._free)

    def clear(self) -> None:
        """Drop every free buffer (memory returns to the allocator)."""
        self.stats.freed += len(self._free)
        self._free.clear()

    def end_call(self) -> None:
        """Called when a forward or backward that used the pool ends."""
        if not self.keep_between_calls:
            self.clear()
