"""The disk tier's files through DeepSpeed's async I/O op (``io="aio"`` of :mod:`offload.disk`).

``AsyncIOBuilder`` is ZeRO-Infinity's NVMe engine: libaio requests on files opened with
``O_DIRECT`` (no page cache), several in flight per transfer. It is used where it builds:
deepspeed installed, libaio's headers and library present (``AsyncIOBuilder().is_compatible()``),
the op loads. :func:`unusable` says why not otherwise; ``io="auto"`` then falls back to plain
file I/O, and ``io="aio"`` refuses with that reason.

What the op requires, and how it is met here (DeepSpeed 0.19: ``ops/csrc/aio``):

- ``O_DIRECT``: buffer address, file offset and length multiples of the device's logical
  block. Every file is the tensor's bytes padded with zeros to :data:`ALIGN` (4 KiB, which
  covers 512-byte and 4Kn drives); every request starts at a multiple of it, from a
  page-aligned buffer. A read fills the tensor's own bytes only: the padding goes to a
  bounce buffer, never past the tensor.
- Buffers must be page-locked, or the op makes its own locked bounce copy of the whole
  tensor for each request (``cpu_op_desc_t``). A tensor that already is (torch-pinned, as
  the CUDA path's staging copies, or locked by DeepSpeed) and page-aligned moves its
  aligned bulk straight between its memory and the file, and only its tail (under 4 KiB)
  through a bounce buffer. Any other (a CPU activation itself) goes through a locked bounce
  buffer of :data:`CHUNK_BYTES`, a chunk at a time: one copy either way, as the op's own
  bounce would make, but with a fixed 16 MiB per lane instead of a locked copy of the
  whole (GiB-sized) tensor.
- The op does not report a failed request: ``sync_pwrite`` of a misaligned buffer returns
  success and writes nothing, and libaio's per-request results are not read
  (``deepspeed_aio_common.cpp``). So each write is followed by a check of the file's size
  (a short file is an ``OSError``, e.g. a full disk), and each read is preceded by one: the
  op aborts the process, by ``assert``, on a file shorter than the read. An I/O error that
  leaves the size right is not seen (the ``"threads"`` backend would report it).

Threads: the tier reads and writes on its ``IO_WORKERS`` threads and on the thread that
spills (the forward, on CPU) or restores without a prefetch. A DeepSpeed handle runs one
request at a time under its own mutex, and its ``wait()`` reaps every pending request of
the handle, so one shared handle would serialize the I/O threads and a lock around it would
add nothing. Instead :data:`LANES` lanes, each a handle with its own libaio context and its
own bounce buffer, are handed out one per transfer (a thread holds at most one, so none
waits on another forever). Op and lanes are made once per process and kept: the lanes'
page-locked memory, ``LANES * CHUNK_BYTES`` = 48 MiB, is checked against
``RLIMIT_MEMLOCK`` first, because the op aborts the process when locking fails.
``io="auto"`` never compiles: it takes the op only when DeepSpeed was installed with it
pre-built (``DS_BUILD_AIO=1``); ``io="aio"`` JIT-builds it when needed, as DeepSpeed's own
NVMe offload does (minutes on first use; torch waits on a lock file a killed build left in
its extension cache, ``~/.cache/torch_extensions``, until it is removed).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import queue
import resource
import threading
import uuid

import torch
from torch import Tensor

ALIGN = 4096
"""File sizes, file offsets and direct buffers' addresses are multiples of this (O_DIRECT)."""

CHUNK_BYTES = 16 << 20
"""Each lane's bounce buffer: 16 MiB per request; 1 and 4 MiB ran 3 to 5x slower per byte
here, the op's per-request cost dominating."""

LANES = 3
"""Handles (with bounce buffers) at once: the tier's two I/O threads and the caller."""

BLOCK_SIZE, QUEUE_DEPTH = 1 << 20, 8
"""DeepSpeed's defaults for its ``aio`` config block (``runtime/swap_tensor/constants.py``)."""

_state: dict = {}  # "op", "lanes" once loaded; "reason" once loading failed for good
_lock = threading.Lock()


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _prebuilt() -> bool:
    """Whether DeepSpeed was installed with the op compiled in (``DS_BUILD_AIO=1``): the only
    case ``io="auto"`` takes. A JIT-built copy in torch's extension cache is not enough:
    torch checks it against the sources and flags of *this* DeepSpeed install and rebuilds
    on any difference (another virtualenv is one), and a build killed half-way leaves a lock
    file that every later load waits on forever. Read from the install's
    ``git_version_info_installed.py`` (literals written by its setup.py) without importing
    deepspeed, which takes seconds and logs: ``"auto"`` costs nothing where it falls back."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return False
    path = os.path.join(os.path.dirname(spec.origin), "git_version_info_installed.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "installed_ops"
                                                    for t in node.targets):
                return bool(ast.literal_eval(node.value).get("async_io", False))
    except (OSError, SyntaxError, ValueError, AttributeError):
        pass
    return False


def _memlock_problem(nbytes: int, status: dict[str, str] | None = None) -> str | None:
    """Why ``nbytes`` more could not be page-locked (``RLIMIT_MEMLOCK``), or ``None``.
    ``status``: ``/proc/self/status`` as a dict (read when not given)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        if status is None:
            with open("/proc/self/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        if int(status["CapEff"], 16) >> 14 & 1:  # CAP_IPC_LOCK: no limit applies
            return None
        locked = int(status["VmLck"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux's /proc: the limit alone decides
        locked = 0
    if locked + nbytes <= soft:
        return None
    return (f"its bounce buffers need {nbytes >> 20} MiB of page-locked memory, over "
            f"RLIMIT_MEMLOCK ({soft >> 10} KiB, `ulimit -l`, {locked >> 10} KiB locked "
            f"already); raise the limit or run with CAP_IPC_LOCK")


def _load(build: bool) -> str | None:
    """Load the op and make the lanes, once per process; the reason when that cannot be."""
    with _lock:
        if "lanes" in _state or "reason" in _state:
            return _state.get("reason")
        if not build and importlib.util.find_spec("deepspeed") is not None and not _prebuilt():
            # Not remembered: a later io="aio" may build it.
            return ("DeepSpeed was installed without its async_io op compiled in "
                    "(DS_BUILD_AIO=1 pip install deepspeed), and io='auto' does not JIT-build "
                    "it (minutes, and torch's build lock); io='aio' builds it")
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder
        except ImportError as e:
            _state["reason"] = f"deepspeed is not installed ({e}); pip install deepspeed"
            return _state["reason"]
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            _state["reason"] = ("DeepSpeed's AsyncIOBuilder is not compatible here: libaio's "
                                "headers and library were not found (apt-get install "
                                "libaio-dev, or set CFLAGS/LDFLAGS to where they are)")
            return _state["reason"]
        problem = _memlock_problem(LANES * CHUNK_BYTES)
        if problem is not None:
            _state["reason"] = problem
            return problem
        try:
            op = builder.load(verbose=False)
        except Exception as e:  # a compiler or linker error: reported, not swallowed
            _state["reason"] = f"building or loading DeepSpeed's async_io op failed: {e}"
            return _state["reason"]
        lanes: queue.SimpleQueue = queue.SimpleQueue()
        example = torch.empty(0, dtype=torch.uint8)
        for _ in range(LANES):
            handle = op.aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, True, 1)
            lanes.put((handle, handle.new_cpu_locked_tensor(CHUNK_BYTES, example)))
        _state.update(op=op, lanes=lanes)
        return None


@contextlib.contextmanager
def _lane():
    lanes = _state["lanes"]
    lane = lanes.get()  # blocks while LANES transfers run; each ends without another lane
    try:
        yield lane
    finally:
        lanes.put(lane)


def _probe(scratch: str) -> str | None:
    """Write a block to a file in ``scratch`` (made, then removed) and read it back."""
    os.makedirs(scratch, exist_ok=True)
    path = os.path.join(scratch, f"probe-{uuid.uuid4().hex}")
    try:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600))
        except OSError as e:
            return (f"files in {os.path.dirname(scratch)!r} cannot be opened with O_DIRECT "
                    f"({e.strerror}): its file system (tmpfs, some network file systems) does "
                    f"no direct I/O; use a directory on a local disk")
        want = torch.arange(ALIGN, dtype=torch.int64).to(torch.uint8)
        got = torch.zeros(ALIGN, dtype=torch.uint8)
        write(path, want)
        read(path, got)
        if not torch.equal(got, want):
            return f"a block written to {scratch!r} with DeepSpeed's aio op read back different"
        return None
    except OSError as e:
        return f"writing a block to {scratch!r} with DeepSpeed's aio op failed: {e}"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)


def unusable(scratch: str, *, build: bool = True) -> str | None:
    """Why the aio backend cannot serve files in ``scratch`` (a directory this call makes and
    removes again), or ``None`` when it can. Loads the op and makes the lanes on first use;
    ``build=False`` (``io="auto"``) takes only a pre-built op, never a JIT build."""
    return _load(build) or _probe(scratch)


def _bytes(t: Tensor) -> Tensor:
    """The bytes of a dense CPU tensor in memory order, as a uint8 tensor sharing its memory
    (any dtype: the file holds exactly the tensor's bits)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, t.data_ptr() - storage.data_ptr(),
                                                  (t.numel() * t.element_size(),))


def _size(path: str, want: int, what: str) -> None:
    got = os.stat(path).st_size
    if got != want:
        raise OSError(f"{path}: {got} bytes {what}, expected {want} (the disk is full, or the "
                      f"offload file was truncated or replaced while in use)")


def _done(ret: int, path: str, what: str) -> None:
    if ret < 0:
        raise OSError(f"{path}: DeepSpeed aio {what} failed (returned {ret}; its message is on "
                      f"stderr)")


def _transfer(data: Tensor, path: str, reading: bool) -> None:
    """Move ``data`` (uint8) to or from ``path``, whose size is ``data``'s padded to ALIGN."""
    n = data.numel()
    with _lane() as (handle, bounce):
        off = 0
        if data.data_ptr() % ALIGN == 0 and handle.is_pinned(data):
            off = n - n % ALIGN  # the aligned bulk, straight from or into the tensor itself
            if off and reading:
                _done(handle.sync_pread(data[:off], path, 0), path, "read")
            elif off:
                _done(handle.sync_pwrite(data[:off], path, 0), path, "write")
                _size(path, off, "after a write")
        while off < n:
            k = min(n - off, bounce.numel())
            window = bounce[:_padded(k)]
            if reading:
                _done(handle.sync_pread(window, path, off), path, "read")
                data[off:off + k].copy_(bounce[:k])  # the padding stays in the bounce buffer
            else:
                bounce[:k].copy_(data[off:off + k])
                bounce[k:window.numel()].zero_()
                _done(handle.sync_pwrite(window, path, off), path, "write")
                _size(path, off + window.numel(), "after a write")
            off += k


def write(path: str, t: Tensor) -> None:
    """Write dense CPU tensor ``t``'s bytes to a new file ``path`` (padded to ALIGN)."""
    data = _bytes(t)
    if data.numel() == 0:
        open(path, "wb").close()
        return
    _transfer(data, path, reading=False)


def read(path: str, out: Tensor) -> Tensor:
    """Fill dense CPU tensor ``out`` from ``path`` (written by :func:`write`); returns it."""
    data = _bytes(out)
    _size(path, _padded(data.numel()), "before a read")
    if data.numel():
        _transfer(data, path, reading=True)
    return out


__all__ = ["ALIGN", "CHUNK_BYTES", "LANES", "read", "unusable", "write"]
