"""CPU offload of saved activations: a reusable host buffer pool and ``saved_tensors_hooks``.

Autograd saves tensors for backward; a pack hook may replace each by anything, and the unpack
hook must give back an equal tensor. Here the pack hook copies a tensor into a host buffer of
a :class:`HostBufferPool` (pinned, on a side stream, when the tensor is on CUDA) and drops
the device tensor; the unpack hook copies it back. Saves are grouped (one group per
checkpointed layer call, or per :func:`offload_saved_activations` block): the first unpack
of a group, which in backward is the recompute of layer i, also starts the copy back of the
group saved just before it, layer i-1, so that copy overlaps layer i's recompute.

The pool reuses its buffers across steps and refuses with a ``ValueError`` when what it is
asked to hold would exceed its host limit, rather than let the OS kill the job
(ArcticTraining #263 reports exactly that CPU OOM from offload). Given a ``disk_dir``, it
spills what does not fit to files there instead (:mod:`offload.disk`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from offload.disk import DiskTier, check_offload_io, min_over_group
from ulysses.torch_internals import tensor_version, view_base
from ulysses.trace_shortcuts import is_traced

DEFAULT_MIN_OFFLOAD_BYTES = 64 << 10
"""Saved tensors smaller than this stay where they are: the copy would cost more than it frees."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def default_host_limit(group: dist.ProcessGroup | None = None) -> int:
    """80% of the host's available memory, split among the ranks on this node.

    ``MemAvailable`` (Linux) at call time, divided by ``LOCAL_WORLD_SIZE`` (torchrun and the
    ``deepspeed`` launcher set it). With a process group, the minimum over its ranks is
    returned, so every rank takes the same refuse-or-go decision and none hangs alone.
    """
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = int(0.8 * available) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min_over_group(limit, group)


@dataclass(kw_only=True, slots=True)
class OffloadStats:
    """What a :class:`HostBufferPool` did: bytes offloaded count the host and the disk tier
    together; ``host_bytes`` and ``reserved_bytes`` the host alone, ``disk_bytes`` the disk."""

    bytes_offloaded: int = 0
    """Total bytes moved off the device (to host or disk) since creation (or
    :meth:`HostBufferPool.reset_stats`)."""
    bytes_restored: int = 0
    """Total bytes copied back to the device."""
    tensors_offloaded: int = 0
    """Saved tensors moved off the device (a tensor saved by several layers counts once)."""
    prefetches: int = 0
    """Tensors copied back ahead of their unpack (the group before the one being unpacked)."""
    host_bytes: int = 0
    """Bytes of host buffers now holding saved tensors."""
    peak_host_bytes: int = 0
    """The most ``host_bytes`` has been."""
    reserved_bytes: int = 0
    """Bytes of host buffers the pool owns, in use or free (what it costs the host)."""
    bytes_spilled: int = 0
    """Of ``bytes_offloaded``, those written to the disk tier (counted, not written, for the
    planner's fake tensors)."""
    disk_bytes: int = 0
    """Bytes of disk-tier files now holding saved tensors."""
    peak_disk_bytes: int = 0
    """The most ``disk_bytes`` has been."""


class HostBufferPool:
    """Host buffers for offloaded activations, reused across layers and steps.

    Args:
        limit_bytes: the most host memory the pool may own; default :func:`default_host_limit`.
            Exceeding it raises ``ValueError``, or spills to ``disk_dir`` when given.
        pin_memory: page-locked buffers (needed for async copies); default: CUDA is available.
        group: with ``limit_bytes=None``, agree on the default limit over this group; with
            ``disk_dir``, on the disk budget too.
        disk_dir: an existing, writable directory (best on a local NVMe): past the host
            limit, saved tensors spill to files there instead of being refused, a whole
            group (layer) at a time, and are read back ahead of use in backward
            (:class:`offload.disk.DiskTier`, ``pool.disk``). Default: no disk tier.
        disk_limit_bytes: caps the disk budget, which is otherwise the directory's free space
            when the pool is made, split among the node's ranks. Needs ``disk_dir``.
        disk_io: how the disk tier reads and writes its files: ``"auto"`` (DeepSpeed's aio
            op where it is usable, else ``"threads"``), ``"aio"`` (a ``ValueError`` with the
            reason where it is not) or ``"threads"`` (plain file I/O); ``pool.disk.io`` is
            the one taken (:mod:`offload.disk`). Other than ``"auto"``, needs ``disk_dir``.
    """

    def __init__(self, *, limit_bytes: int | None = None, pin_memory: bool | None = None,
                 group: dist.ProcessGroup | None = None, disk_dir=None,
                 disk_limit_bytes: int | None = None, disk_io: str = "auto") -> None:
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        if disk_dir is None and disk_limit_bytes is not None:
            raise ValueError(f"disk_limit_bytes={disk_limit_bytes} needs disk_dir, the "
                             f"directory the disk tier writes to")
        if disk_dir is None and check_offload_io(disk_io, name="disk_io") != "auto":
            raise ValueError(f"disk_io={disk_io!r} needs disk_dir, the directory the disk tier "
                             f"writes to")
        # The tier first: it checks the directory and disk_io before its collective.
        self.disk = None if disk_dir is None else DiskTier(disk_dir, limit_bytes=disk_limit_bytes,
                                                           group=group, io=disk_io)
        self.limit_bytes = default_host_limit(group) if limit_bytes is None else int(limit_bytes)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.stats = OffloadStats()
        self._free: list[tuple[Tensor, object]] = []  # (uint8 buffer, last H2D event or None)
        self._streams: dict[torch.device, object] = {}

    # --- planning and buffers -----------------------------------------------------------

    def plan(self, nbytes: int, *, what: str = "offloading") -> None:
        """Refuse up front: ``ValueError`` if holding ``nbytes`` at once exceeds the limit (the
        host limit plus the disk budget, with a disk tier)."""
        if self.disk is not None:
            self.disk.check(nbytes, self.limit_bytes, what)
        elif nbytes > self.limit_bytes:
            raise ValueError(
                f"{what} needs {_gib(nbytes)} of host memory per rank, more than the offload "
                f"limit of {_gib(self.limit_bytes)} (limit_bytes / host_memory_limit, default "
                f"80% of MemAvailable per local rank). Fix: shorten the sequence, add ranks, "
                f"raise the limit if the host has the memory, or turn offload off")

    def _acquire(self, nbytes: int, *, virtual: bool = False,
                 spill: bool = False) -> Tensor | None:
        """A buffer of at least ``nbytes``; past the limit, ``None`` if ``spill`` else refused."""
        fits = [i for i, (b, _) in enumerate(self._free)
                if nbytes <= b.numel() <= 2 * nbytes and (b.device.type == "meta") == virtual]
        if fits:
            buf, event = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
            if event is not None:
                event.synchronize()  # an H2D copy out of this buffer may still be running
            return buf
        if self.stats.reserved_bytes + nbytes > self.limit_bytes and self._free:
            self.trim()  # give back buffers of the wrong size before refusing
        if self.stats.reserved_bytes + nbytes > self.limit_bytes:
            if spill:
                return None
            raise ValueError(
                f"offloading a {_gib(nbytes)} activation would make the host pool "
                f"{_gib(self.stats.reserved_bytes + nbytes)}, over its limit of "
                f"{_gib(self.limit_bytes)}; {_gib(self.stats.host_bytes)} are holding saved "
                f"activations. Fix: shorten the sequence, add ranks, raise limit_bytes if the "
                f"host has the memory, or turn offload off")
        self.stats.reserved_bytes += nbytes
        if virtual:  # the planner's fake tensors: bytes are counted, none are allocated
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _release(self, buf: Tensor, event) -> None:
        self.stats.host_bytes -= buf.numel()
        self._free.append((buf, event))

    def host_buffers(self) -> list[Tensor]:
        """The buffers not holding a saved tensor now (all of them between steps)."""
        return [buf for buf, _ in self._free]

    def trim(self) -> None:
        """Free the buffers not in use (they are kept for reuse otherwise)."""
        for buf, event in self._free:
            if event is not None:
                event.synchronize()
            self.stats.reserved_bytes -= buf.numel()
        self._free.clear()

    def reset_stats(self) -> None:
        """Zero the counters and peak; the host-bytes figures stay as they are."""
        self.stats = OffloadStats(host_bytes=self.stats.host_bytes,
                                  peak_host_bytes=self.stats.host_bytes,
                                  reserved_bytes=self.stats.reserved_bytes,
                                  disk_bytes=self.stats.disk_bytes,
                                  peak_disk_bytes=self.stats.disk_bytes)

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # --- offload and restore --------------------------------------------------------------

    def _offload(self, t: Tensor, group: "_Group"):
        """``t``'s handle: in a host buffer, or in a file once ``group`` spills to disk."""
        # Keep the layout of dense tensors (a permuted one too: empty_like preserves it) so
        # kernels see the same strides in backward; other views come back contiguous.
        stride = torch.empty_like(t, device="meta").stride()
        nbytes = t.numel() * t.element_size()
        virtual = is_traced(t)
        buf = None if group.on_disk else self._acquire(nbytes, virtual=virtual,
                                                       spill=self.disk is not None)
        if buf is None:  # past the host limit: this group and the ones after it go to disk
            group.on_disk = True
            return self.disk.spill(self, t, stride, virtual)
        host = buf[:nbytes].view(t.dtype).as_strided(t.shape, stride)
        event = None
        if virtual:
            pass  # a fake tensor has no data: the trace needs only its size and when it moves
        elif t.is_cuda:
            side = self._stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            t.record_stream(side)  # the allocator keeps t's memory until the copy is done
        else:
            host.copy_(t)
        s = self.stats
        s.host_bytes += buf.numel()
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        s.bytes_offloaded += nbytes
        s.tensors_offloaded += 1
        return _Offloaded(self, buf, host, t.device, event)


class _Offloaded:
    """One saved tensor living in a host buffer; the buffer returns to the pool when autograd
    drops the saved value (after backward), so a ``retain_graph`` backward can unpack again."""

    __slots__ = ("pool", "buf", "host", "device", "event", "ready", "h2d_event", "__weakref__")

    def __init__(self, pool, buf, host, device, event) -> None:
        self.pool, self.buf, self.host, self.device, self.event = pool, buf, host, device, event
        self.ready: tuple[Tensor, object] | None = None  # a prefetched device copy
        self.h2d_event = None

    def _copy_back(self, stream) -> tuple[Tensor, object]:
        out = torch.empty_strided(self.host.shape, self.host.stride(), dtype=self.host.dtype,
                                  device=self.device)
        if self.host.device.type == "meta":  # planned, not real: allocate, nothing to copy
            return out, None
        if stream is None:
            out.copy_(self.host)
            return out, None
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            out.copy_(self.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.h2d_event = done
        return out, done

    def stage(self) -> None:
        """Nothing: the tensor is in host memory already (a disk-tier handle reads its file
        here)."""

    def prefetch(self) -> None:
        if self.ready is None:
            side = self.pool._stream(self.device) if self.device.type == "cuda" else None
            if side is not None:
                with torch.cuda.stream(side):
                    self.ready = self._copy_back(side)
            else:
                self.ready = self._copy_back(None)
            self.pool.stats.prefetches += 1
            self.pool.stats.bytes_restored += self.host.numel() * self.host.element_size()

    def restore(self) -> Tensor:
        if self.ready is not None:
            out, done = self.ready
            self.ready = None
            if done is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)
                out.record_stream(current)
            return out
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.pool.stats.bytes_restored += self.host.numel() * self.host.element_size()
        return self._copy_back(stream)[0]

    def __del__(self) -> None:
        self.pool._release(self.buf, self.h2d_event)  # the pool outlives its handles


class _Group:
    """The saves of one checkpointed layer call (or one offload block)."""

    def __init__(self, prev: "_Group | None") -> None:
        self.prev = weakref.ref(prev) if prev is not None else None
        self.saved: list[weakref.ref] = []
        self.unpacked = False
        self.on_disk = prev is not None and prev.on_disk  # spill: see HostBufferPool._offload

    def previous(self) -> "_Group | None":
        return self.prev() if self.prev is not None else None


def _stays(t: Tensor, min_bytes: int) -> bool:
    """Saved tensors not worth moving: small ones, and parameters and other leaves that need
    a gradient, or views of them (``linear`` saves ``weight.t()``): they stay alive anyway,
    so a host copy would only add memory. Tensor subclasses (DTensor) too, except fake
    tensors: the memory planner (:mod:`arctic.plan`) traces the offload with them, and the
    pool counts their host bytes on a meta buffer without copying anything."""
    base = view_base(t)
    return (t.numel() * t.element_size() < min_bytes or
            (type(t) is not Tensor and not is_traced(t)) or
            t.device.type not in ("cpu", "cuda") or isinstance(base, nn.Parameter) or
            (base.is_leaf and base.requires_grad))


class _Hooks:
    """pack/unpack for one group. Tensors that :func:`_stays` picks stay as they are; a
    tensor saved again (RoPE's cos/sin, shared by all layers) reuses its first host copy."""

    def __init__(self, pool: HostBufferPool, group: _Group, min_bytes: int,
                 seen: WeakIdKeyDictionary, ahead: bool = True) -> None:
        self.pool, self.group, self.min_bytes, self.seen = pool, group, min_bytes, seen
        self.ahead = ahead  # prefetch (see OffloadSession)

    def pack(self, t: Tensor, *, with_group: bool = True):
        """``with_group=False``: not prefetched with the group (when the group before it is
        unpacked); the caller prefetches it (:meth:`prefetch`) when it knows better."""
        if _stays(t, self.min_bytes):
            return t
        hit = self.seen.get(t)
        if hit is not None and hit[0] == tensor_version(t) and hit[1]() is not None:
            handle = hit[1]()
        else:
            handle = self.pool._offload(t, self.group)
            self.seen[t] = (tensor_version(t), weakref.ref(handle))
        if with_group:
            self.group.saved.append(weakref.ref(handle))
        return (self.group, handle)

    def prefetch(self, packed) -> None:
        """Start copying a packed tensor back (on the side stream on CUDA); when the session
        does not prefetch, only its read from the disk tier, if it is there (``stage``)."""
        if not isinstance(packed, Tensor):
            self._ahead_of_unpack(packed[1])

    def unpack(self, packed):
        if isinstance(packed, Tensor):
            return packed
        group, handle = packed
        out = handle.restore()
        if not group.unpacked:
            group.unpacked = True
            prev = group.previous()
            if prev is not None and not prev.unpacked:
                for ref in prev.saved:
                    h = ref()
                    if h is not None:
                        self._ahead_of_unpack(h)
        return out

    def _ahead_of_unpack(self, handle) -> None:
        """The copy back (prefetch), or without prefetch the disk tier's read alone."""
        if self.ahead:
            handle.prefetch()
        else:
            handle.stage()


class OffloadSession:
    """Opens groups on a pool; each group links to the one opened before it (for prefetch).

    ``prefetch``: in backward, the first unpack of a group starts the copy back of the group
    before it (on CUDA on a side stream: the copy hides behind this group's recompute and
    backward, and one group's tensors more are on the device meanwhile). False: each tensor
    is copied back when it is unpacked, on the current stream (DeepSpeed's
    ``cpu_checkpointing`` restores so), holding one group less at the backward's peak; the
    reads of the disk tier's files still start a group ahead, into host memory."""

    def __init__(self, pool: HostBufferPool, min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES, *,
                 prefetch: bool = True) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
        self.pool, self.min_bytes, self.prefetch = pool, min_bytes, prefetch
        self._seen = WeakIdKeyDictionary()
        self._last: weakref.ref | None = None

    def starts_new_pass(self) -> bool:
        """True when no group of an earlier, unfinished forward is alive (the next group is a
        forward's first)."""
        return self._last is None or self._last() is None

    @contextlib.contextmanager
    def group(self):
        """Open a group; autograd's saves inside go to the host. Yields the group's hooks:
        their ``pack``/``unpack`` take what the group's code keeps outside autograd (the
        attention results of a checkpointed layer, :mod:`offload.checkpoint`) the same way."""
        prev = self._last() if self._last is not None else None
        g = _Group(prev)
        self._last = weakref.ref(g)
        hooks = _Hooks(self.pool, g, self.min_bytes, self._seen, self.prefetch)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            yield hooks


@contextlib.contextmanager
def offload_saved_activations(pool: HostBufferPool | None = None, *,
                              min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
                              session: OffloadSession | None = None):
    """Inside this block, every tensor autograd saves (of at least ``min_bytes``, parameters
    excepted) moves to a host buffer and comes back in backward.

    For code outside the checkpointed layers (a custom block, a loss head). Consecutive blocks that
    share a ``session`` prefetch each other in backward as checkpointed layers do. Yields the
    pool, whose :attr:`HostBufferPool.stats` report bytes offloaded and peak host bytes.
    """
    if session is None:
        session = OffloadSession(pool if pool is not None else HostBufferPool(), min_bytes)
    elif pool is not None and pool is not session.pool:
        raise ValueError("pass a pool or a session, not a session with another pool")
    with session.group():
        yield session.pool


__all__ = ["DEFAULT_MIN_OFFLOAD_BYTES", "HostBufferPool", "OffloadSession", "OffloadStats",
           "default_host_limit", "offload_saved_activations"]
