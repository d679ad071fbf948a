"""Blocks parked in host memory, brought back to the device one ahead of their use.

The sequence-chunked loop (:mod:`ulysses.seq_chunk`) keeps a kv chunk's exchanged blocks, and
in backward their float32 dk/dv sums, on the host, and copies one block to the device while
the block before it computes. On CUDA the host tensors are pinned and every copy runs on one
side stream, in issue order, so a block's write-back always lands before its next fetch.
Lifetimes across the two streams:

- a fetched block is allocated on the compute stream and written on the side stream after
  the side stream waited for all compute issued so far (its memory may be a freed block that
  compute still reads); compute waits for the copy's event before the first read, and the
  block is marked used by the side stream, so dropped unread its memory waits for the copy;
- a written-back device block is marked used by the side stream (``record_stream``), so the
  caching allocator does not hand its memory out before the copy has read it;
- a parked device block may be a pool buffer reused right after (an exchange's receive
  buffer): the compute stream waits for the park's copy, and NCCL's stream waits for the
  compute stream before any later exchange;
- host tensors and their last copy's event are kept until the event has completed, however
  early the caller drops them.

On CPU "host" is ordinary CPU memory and the copies are plain ``copy_`` calls: the same code
runs, without pinning or streams. In a memory trace (fake tensors, the planner) the host
tensors are on the meta device and nothing is copied: they are host bytes, not the device's,
counted in the pool's :attr:`ulysses.buffer_pool.PoolStats.host_bytes` while they live (as
the activation offload pool plans its host buffers).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ulysses.trace_shortcuts import is_traced


def _uncount(stats, nbytes: int) -> None:
    stats.host_bytes -= nbytes


class Fetched:
    """A host -> device copy in flight; :meth:`get` makes compute wait for it."""

    def __init__(self, dev: Tensor, event) -> None:
        self._dev, self._event = dev, event

    def get(self) -> Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self._dev.device).wait_event(self._event)
            self._event = None
        return self._dev


class HostBlocks:
    """Host copies of device blocks for one call of the sequence-chunked loop.

    Args:
        like: a device tensor of the call: its device is where blocks are fetched to.
        stats: where the host bytes alive are counted (the call's buffer pool's), or None.
    """

    def __init__(self, like: Tensor, stats=None) -> None:
        self.device = like.device
        self._planned = is_traced(like)
        self._stats = stats
        self._cuda = like.is_cuda and not self._planned
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._inflight: list[tuple[object, Tensor]] = []  # (event, host tensor) pairs

    # --- CUDA bookkeeping -------------------------------------------------------------------

    def _start(self):
        """Enter the side stream after everything compute issued so far."""
        self._inflight = [(e, h) for e, h in self._inflight if not e.query()]
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._side)

    def _done(self, host: Tensor):
        event = self._side.record_event()
        self._inflight.append((event, host))
        return event

    # --- the three copies -------------------------------------------------------------------

    def empty(self, like: Tensor, dtype: torch.dtype | None = None, zero: bool = False) -> Tensor:
        """A host tensor shaped (and strided) like ``like``; zero-filled when ``zero``."""
        host = torch.empty_like(like, dtype=dtype, device="meta" if self._planned else "cpu",
                                pin_memory=self._cuda)
        if self._stats is not None:
            nbytes = host.numel() * host.element_size()
            self._stats.host_bytes += nbytes
            self._stats.peak_host_bytes = max(self._stats.peak_host_bytes,
                                              self._stats.host_bytes)
            weakref.finalize(host, _uncount, self._stats, nbytes)
        return host.zero_() if zero and not self._planned else host

    def park(self, x: Tensor) -> Tensor:
        """A host copy of device block ``x``; ``x`` may be reused as soon as this returns."""
        host = self.empty(x)
        if self._planned:
            return host
        if not self._cuda:
            host.copy_(x)
            return host
        with self._start():
            host.copy_(x, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_event(self._done(host))
        return host

    def fetch(self, host: Tensor) -> Fetched:
        """Start copying ``host`` to a new device tensor; :meth:`Fetched.get` returns it."""
        dev = torch.empty_like(host, device=self.device)
        if self._planned:
            return Fetched(dev, None)
        if not self._cuda:
            dev.copy_(host)
            return Fetched(dev, None)
        with self._start():
            dev.copy_(host, non_blocking=True)
        # The copy writes dev on the side stream: if the caller drops it before get() (an
        # exception), its memory must not be handed out again until the copy has run.
        dev.record_stream(self._side)
        return Fetched(dev, self._done(host))

    def store(self, host: Tensor, x: Tensor) -> None:
        """Write device block ``x`` back into ``host`` (asynchronously on CUDA); the caller may
        drop ``x`` at once."""
        if self._planned:
            return
        if not self._cuda:
            host.copy_(x)
            return
        with self._start():
            host.copy_(x, non_blocking=True)
        x.record_stream(self._side)
        self._done(host)

    def close(self) -> None:
        """Wait for every copy still in flight (the host tensors may then be freed)."""
        for event, _ in self._inflight:
            event.synchronize()
        self._inflight = []
