"""A disk tier under the host pool: saved activations that do not fit it spill to files.

At millions of tokens the offloaded layer inputs outgrow host memory (issue 19: 174 of the
186 GiB a rank may use at 5.7M tokens of Llama-3-8B), while a node's NVMe holds tens of TB.
When a :class:`offload.HostBufferPool` given a ``disk_dir`` cannot hold a saved tensor
within its host limit, that tensor, the rest of its group (a checkpointed layer) and every
later group of the forward go to files instead, so a layer comes back from one place. In
backward the group prefetch of :mod:`offload.activations` (unpacking layer i starts the
copy back of layer i-1) starts, for a spilled tensor, a read from its file on an I/O thread
followed by the host-to-device copy (on CUDA on the pool's side stream, as the host path
does; on CPU the read fills the restored tensor itself).

I/O, chosen by ``io`` (``tier.io`` says which was taken): ``"threads"`` is plain buffered
file I/O on a small thread pool, what CI runs; ``"aio"`` is DeepSpeed's async I/O op
(``AsyncIOBuilder``, ZeRO-Infinity's NVMe engine: libaio, ``O_DIRECT``, no page cache) on
the same threads, where it builds (:mod:`offload.disk_aio`, which also says how it meets
the op's alignment rules); ``"auto"`` (the default) takes aio when it is usable (deepspeed
installed with the op pre-built, ``DS_BUILD_AIO=1``: only ``"aio"`` JIT-builds it; the
directory takes ``O_DIRECT``) and threads otherwise, with the reason in
``tier.io_reason``. Both write a tensor's exact bytes, so
gradients are bit-identical either way. Not used: ``torch.cuda.gds`` (GPUDirect Storage),
which could skip the host bounce on a GPU node with cuFile support but cannot be tested
without one, and a path nobody ran must not claim to work. On CUDA a spilled tensor passes
through a pinned staging copy on its way to and from the disk (at most ``IO_WORKERS``
writes queued, one staging copy per read in flight) and its write runs on an I/O thread; on
CPU the forward writes the tensor's own memory. The CUDA path mirrors the host path's
copies; its test (``tests/test_offload_disk.py``) needs a GPU, which CI does not have. With
threads, the kernel's page cache may keep what was written until the file is deleted; that
memory is reclaimable.

Files: a tier writes under its own subdirectory ``arctic-offload-<host>-<pid>-<hex>`` of the
directory, which exists only while it holds files. A file is deleted when autograd drops
the saved value (after backward, or when the graph of a failed forward is freed); the
subdirectory is removed when the tier is garbage collected and at interpreter exit
(``weakref.finalize``). A process that is killed cannot clean up: the subdirectories of
processes of this host that no longer run are removed when a tier is created in the same
directory, so a crash leaves nothing the next run trips on.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import threading
import uuid
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import Tensor

from offload import disk_aio

PREFIX = "arctic-offload-"
"""Start of the name of every tier's subdirectory (what stale-directory cleanup looks for)."""

IO_WORKERS = 2
"""Threads that read and write the files: two of a layer's tensors are read at once, or a
read beside a write (on CUDA); more would only compete for the same disk."""

IO_CHOICES = ("auto", "aio", "threads")
"""The disk tier's I/O backends (``io``); see the module docstring."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def min_over_group(value: int, group: dist.ProcessGroup | None) -> int:
    """``value``'s minimum over ``group`` (``value`` itself without one): a limit every rank
    then checks alike, so that all of them refuse a plan or none does and none hangs alone."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def check_offload_dir(directory, *, name: str = "offload_dir") -> str:
    """``ValueError`` unless ``directory`` is an existing directory this process may create
    files in; returns its absolute path. No collective: callable before any."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ValueError(f"{name} must be a directory path (a string), got {directory!r}")
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise ValueError(f"{name}={os.fspath(directory)!r} is not an existing directory; create "
                         f"it (on a fast local disk, e.g. NVMe) or leave {name} unset")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={os.fspath(directory)!r} is not writable by this process; "
                         f"pick a directory it can create files in")
    return path


def check_offload_io(io, *, name: str = "disk_io") -> str:
    """``ValueError`` unless ``io`` is one of :data:`IO_CHOICES`; returns it."""
    if not isinstance(io, str) or io not in IO_CHOICES:
        raise ValueError(f"{name} must be one of {IO_CHOICES}, got {io!r}: 'auto' takes "
                         f"DeepSpeed's aio where it is usable, 'threads' is plain file I/O")
    return io


def _resolve_io(io: str, scratch: str) -> tuple[str, str | None]:
    """The backend ``io`` comes to, and why aio was not taken (``None`` when it was)."""
    if io == "threads":
        return "threads", None
    reason = disk_aio.unusable(scratch, build=io == "aio")
    if reason is not None and io == "aio":
        raise ValueError(f"disk_io='aio' (offload_io, ulysses.offload_io) cannot be used: "
                         f"{reason}. Fix that, or set it to 'threads' (plain file I/O) or "
                         f"'auto' (aio where it works)")
    return ("threads", reason) if reason is not None else ("aio", None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Remove the tier subdirectories that processes of this host which no longer run left in
    ``directory`` (killed before their exit handlers ran); returns their names. Those named
    after another host (a shared file system) stay: whether their process runs cannot be
    told from here."""
    host, removed = socket.gethostname(), []
    for entry in sorted(os.listdir(directory)):
        if not entry.startswith(PREFIX):
            continue
        parts = entry[len(PREFIX):].rsplit("-", 2)  # host names may hold "-"; pid and hex not
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
        removed.append(entry)
    return removed


def _span(t: Tensor) -> memoryview:
    """The bytes of a dense CPU tensor (no gaps, no overlap) in memory order, sharing its
    memory: any dtype (bf16 too), so the file holds exactly the tensor's bits. Through ctypes,
    not numpy (``offload`` needs torch only); the view does not keep ``t`` alive, the
    caller does."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr()))


def _write_file(path: str, src: Tensor, copied, aio: bool) -> None:
    if copied is not None:
        copied.synchronize()  # the device-to-host copy into src, on the side stream
    if aio:
        disk_aio.write(path, src)
        return
    with open(path, "wb") as f:
        f.write(_span(src))


def _read_file(path: str, out: Tensor) -> Tensor:
    data = _span(out)
    with open(path, "rb") as f:
        got = f.readinto(data)
    if got != data.nbytes:
        raise OSError(f"{path}: read {got} of {data.nbytes} bytes (the offload file was "
                      f"truncated or replaced while in use)")
    return out


def _read_host(path, write, spec, pin: bool, aio: bool) -> Tensor:
    """The saved tensor read from its file into a host tensor (pinned where ``pin``). A
    module function: the I/O thread must hold no handle (its release waits on this very
    read)."""
    if write is not None:
        write.result()  # this file's own write first (and its error, if it failed)
    shape, stride, dtype = spec
    read = disk_aio.read if aio else _read_file  # looked up now: tests wrap them
    return read(path, torch.empty_strided(shape, stride, dtype=dtype, pin_memory=pin))


def _to_device(host: Tensor, device, stream) -> tuple[Tensor, object]:
    """``host`` copied to ``device`` (CUDA) on ``stream``, with an event marking the copy's
    end; ``host`` itself on the CPU."""
    if device.type != "cuda":
        return host, None
    with torch.cuda.device(device), torch.cuda.stream(stream):
        shape, stride, dtype = host.shape, host.stride(), host.dtype
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        out.copy_(host, non_blocking=True)  # the pinned host block is freed after the copy
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def _load(path, write, spec, device, stream, pin: bool, aio: bool) -> tuple[Tensor, object]:
    """The saved tensor back on ``device``: the file read into a host tensor, then (CUDA)
    copied to the device on ``stream`` (:func:`_to_device`)."""
    return _to_device(_read_host(path, write, spec, pin and device.type == "cuda", aio),
                      device, stream)


def _close(executor: ThreadPoolExecutor, path: str) -> None:
    executor.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(path, ignore_errors=True)


class DiskTier:
    """Files under ``directory`` for the saved tensors a :class:`offload.HostBufferPool`
    cannot hold; made by the pool from its ``disk_dir`` and ``disk_limit_bytes``.

    Args:
        directory: an existing directory this process can write to, best on a local NVMe.
        limit_bytes: the most bytes of files the tier may hold at once. The budget is the
            directory's free space when the tier is made (``shutil.disk_usage``), split among
            the node's ranks (``LOCAL_WORLD_SIZE``), which all write there; ``limit_bytes``
            caps it.
        group: agree on the budget (its minimum) over this group's ranks.
        io: ``"auto"``, ``"aio"`` or ``"threads"`` (module docstring). ``"aio"`` where it
            cannot be used is a ``ValueError`` with the reason, before any file or collective.
    """

    def __init__(self, directory, *, limit_bytes: int | None = None,
                 group: dist.ProcessGroup | None = None, io: str = "auto") -> None:
        self.directory = check_offload_dir(directory, name="disk_dir")
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or
                                        not isinstance(limit_bytes, int) or limit_bytes <= 0):
            raise ValueError(f"disk_limit_bytes must be a positive int, got {limit_bytes!r}")
        check_offload_io(io)
        remove_stale(self.directory)
        self.path = os.path.join(self.directory, f"{PREFIX}{socket.gethostname()}-"
                                                 f"{os.getpid()}-{uuid.uuid4().hex}")
        """This tier's subdirectory, present while it holds files."""
        self.io, self.io_reason = _resolve_io(io, self.path)  # aio's probe file goes there
        """The backend taken, ``"aio"`` or ``"threads"``; and, when ``"auto"`` fell back to
        threads, why aio was not usable (``None`` otherwise)."""
        self._aio = self.io == "aio"
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        free = shutil.disk_usage(self.directory).free // ranks
        self._capped = limit_bytes is not None and limit_bytes < free
        self.limit_bytes = min_over_group(min(free, limit_bytes or free), group)
        """The most bytes of files at once, what :meth:`check` plans against."""
        self._executor = ThreadPoolExecutor(IO_WORKERS, thread_name_prefix="arctic-offload-io")
        self._lock = threading.Lock()  # handles may be released on autograd's device threads
        self._files = self._serial = 0
        self._writes: deque[Future] = deque()
        self._finalizer = weakref.finalize(self, _close, self._executor, self.path)

    def check(self, nbytes: int, host_limit: int, what: str) -> None:
        """``ValueError`` if ``nbytes`` exceeds ``host_limit`` plus the disk budget."""
        if nbytes <= host_limit + self.limit_bytes:
            return
        source = ("disk_limit_bytes" if self._capped else
                  "the directory's free space at start, split among LOCAL_WORLD_SIZE ranks")
        raise ValueError(
            f"{what} needs {_size(nbytes)} per rank, more than the host limit of "
            f"{_size(host_limit)} plus the disk budget of {_size(self.limit_bytes)} in "
            f"{self.directory!r} ({source}). Fix: free space there or use a larger disk "
            f"(offload_dir / disk_dir), raise the host limit if the host has the memory, "
            f"shorten the sequence or add ranks")

    def spill(self, pool, t: Tensor, stride: tuple[int, ...], virtual: bool) -> "_Spilled":
        """Write ``t`` to a new file (nothing for the planner's fake tensors, whose bytes are
        only counted) and return its handle."""
        nbytes = t.numel() * t.element_size()
        s = pool.stats
        if s.disk_bytes + nbytes > self.limit_bytes:
            raise ValueError(
                f"spilling a {_size(nbytes)} activation to {self.directory!r} would make the "
                f"offload files {_size(s.disk_bytes + nbytes)}, over the disk budget of "
                f"{_size(self.limit_bytes)}. Fix: free space there or use a larger disk, raise "
                f"the host limit if the host has the memory, or shorten the sequence")
        path = write = None
        if not virtual:
            path = self._new_file()
            try:
                write = self._write(pool, t, stride, path)
            except BaseException:
                self._remove(path)
                raise
        s.disk_bytes += nbytes
        s.peak_disk_bytes = max(s.peak_disk_bytes, s.disk_bytes)
        s.bytes_spilled += nbytes
        s.bytes_offloaded += nbytes
        s.tensors_offloaded += 1
        return _Spilled(self, pool, path, write, (t.shape, stride, t.dtype), t.device, nbytes)

    def _write(self, pool, t: Tensor, stride, path: str) -> Future | None:
        """CPU: written now, from ``t`` itself when dense. CUDA: copied to pinned staging on
        the side stream, written by an I/O thread once the copy is done."""
        if not t.is_cuda:
            dense = t.stride() == stride and not (t.is_conj() or t.is_neg())
            src = t if dense else torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
            _write_file(path, src, None, self._aio)
            return None
        side = pool._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            staging = torch.empty_strided(t.shape, stride, dtype=t.dtype,
                                          pin_memory=pool.pin_memory)
            staging.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        t.record_stream(side)  # the allocator keeps t's memory until the copy is done
        # Each queued write holds a staging copy: wait for the oldest past IO_WORKERS.
        while self._writes and (self._writes[0].done() or len(self._writes) >= IO_WORKERS):
            done = self._writes.popleft()
            if not done.cancelled():
                done.result()  # a failed write (disk full) is reported in the forward
        future = self._executor.submit(_write_file, path, staging, copied, self._aio)
        self._writes.append(future)
        return future

    def _new_file(self) -> str:
        with self._lock:
            if self._files == 0:
                os.makedirs(self.path, exist_ok=True)
            self._files += 1
            self._serial += 1
            return os.path.join(self.path, f"{self._serial}.bin")

    def _remove(self, path: str) -> None:
        with self._lock:
            try:
                os.remove(path)
            except FileNotFoundError:  # never written (cancelled), or removed at exit
                pass
            self._files -= 1
            if self._files == 0:
                shutil.rmtree(self.path, ignore_errors=True)


class _Spilled:
    """One saved tensor in a file of a :class:`DiskTier`, with the host handles' interface
    (``prefetch``, ``restore``). The file is deleted when autograd drops the saved value, so
    a ``retain_graph`` backward can read it again."""

    __slots__ = ("tier", "pool", "path", "write", "spec", "device", "nbytes", "ready",
                 "staged", "__weakref__")

    def __init__(self, tier, pool, path, write, spec, device, nbytes) -> None:
        self.tier, self.pool, self.path, self.write = tier, pool, path, write
        self.spec, self.device, self.nbytes = spec, device, nbytes
        self.ready: Future | tuple[Tensor, object] | None = None  # a prefetched device copy
        self.staged: Future | None = None  # a host copy being read (:meth:`stage`)

    def _virtual(self) -> Tensor:  # planned, not real: allocate (a fake tensor), read nothing
        shape, stride, dtype = self.spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def prefetch(self) -> None:
        if self.ready is None:
            if self.path is None:
                self.ready = (self._virtual(), None)
            else:
                side = self.pool._stream(self.device) if self.device.type == "cuda" else None
                self.ready = self.tier._executor.submit(
                    _load, self.path, self.write, self.spec, self.device, side,
                    self.pool.pin_memory, self.tier._aio)
            self.pool.stats.prefetches += 1
            self.pool.stats.bytes_restored += self.nbytes

    def stage(self) -> None:
        """Start reading the file into host memory, with no device copy: where the layer
        inputs are copied back without prefetch (``prefetch=False``), the slow read still
        runs a layer ahead, and only the host-to-device copy waits for the step."""
        if self.ready is None and self.staged is None and self.path is not None:
            self.staged = self.tier._executor.submit(
                _read_host, self.path, self.write, self.spec,
                self.pool.pin_memory and self.device.type == "cuda", self.tier._aio)

    def restore(self) -> Tensor:
        if self.ready is not None:
            ready, self.ready = self.ready, None
            out, done = ready.result() if isinstance(ready, Future) else ready
            if done is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)
                out.record_stream(current)
            return out
        self.pool.stats.bytes_restored += self.nbytes
        if self.path is None:
            return self._virtual()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self.staged is not None:
            staged, self.staged = self.staged, None
            return _to_device(staged.result(), self.device, stream)[0]
        return _load(self.path, self.write, self.spec, self.device, stream,
                     self.pool.pin_memory, self.tier._aio)[0]

    def __del__(self) -> None:
        self.pool.stats.disk_bytes -= self.nbytes
        if self.path is None:
            return
        for io in (self.ready, self.staged, self.write):
            if isinstance(io, Future) and not io.cancel():
                io.exception()  # a running read or write ends before its file goes
        self.tier._remove(self.path)


__all__ = ["IO_CHOICES", "DiskTier", "check_offload_dir", "check_offload_io", "min_over_group",
           "remove_stale"]
