"""A small pool of flat scratch buffers, reused across chunks and layers.

Head-chunked attention needs the same few full-sequence chunk buffers at every chunk of every
layer. Allocating them once and handing them back keeps the peak at a fixed number of chunk
buffers, however many chunks or layers run. The pool is an ordinary object passed explicitly
(no module state): one per model, or one per call when none is given.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class PoolStats:
    allocated: int = 0
    """Distinct buffers the pool has created (each is one allocation)."""
    reused: int = 0
    """acquire() calls served from a free buffer."""
    freed: int = 0
    """Buffers dropped, by clear() or because the free list was full."""


class BufferPool:
    """Flat buffers keyed by ``(numel, dtype, device)``.

    Args:
        max_free: most buffers kept while not in use; releasing beyond it frees the oldest,
            so the pool never grows without bound. Buffers in use are the caller's. The
            default covers head chunking's steady state with overlap (the next step's five
            exchanges in flight while this step's inputs and gradient exchanges are live).
    """

    def __init__(self, max_free: int = 32) -> None:
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self.max_free = max_free
        self.stats = PoolStats()
        self._free: dict[tuple, deque[Tensor]] = defaultdict(deque)
        self._order: deque[tuple] = deque()  # keys of free buffers, oldest first

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D buffer of ``numel`` elements; its contents are undefined."""
        key = (numel, dtype, torch.device(device))
        if self._free[key]:
            self.stats.reused += 1
            self._order.remove(key)
            return self._free[key].pop()
        self.stats.allocated += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, buf: Tensor) -> None:
        """Return ``buf`` (from :meth:`acquire`); the caller must not use it afterwards."""
        key = (buf.numel(), buf.dtype, buf.device)
        self._free[key].append(buf)
        self._order.append(key)
        while len(self._order) > self.max_free:
            self._free[self._order.popleft()].popleft()
            self.stats.freed += 1

    def num_free(self) -> int:
        return len(self._order)

    def free_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for q in self._free.values() for b in q)

    def clear(self) -> None:
        """Drop every free buffer (memory returns to the allocator)."""
        self.stats.freed += len(self._order)
        self._free.clear()
        self._order.clear()
