"""Run a function on W gloo ranks, with a pool of worker processes kept per W.

Starting W processes that import torch, transformers and DeepSpeed costs seconds of CPU per
process, so the ranks are forked from one long-lived server process that imported them once
(:data:`PRELOAD`), and each world size keeps its ranks for the whole pytest session.
``run(fn, *args, world_size=W)`` sends ``fn`` (a module-level, picklable function) to every
rank, waits for all of them, and returns the per-rank results in rank order. A rank that
raises fails the call with every failing rank's traceback; a call that does not finish within
``timeout`` (a hang) kills the pool and fails, and the next call starts a fresh one.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
_POOLS: dict[int, "_Pool"] = {}
_SERVER: list = []  # [(process, connection)] while the fork server runs
# Collectives fail (instead of hanging forever) after this long.
GLOO_TIMEOUT_S = 45
MAX_THREADS = 40
"""A pool whose ranks hold more threads than this after a call is replaced before the next
one. Every process group a test makes (meshes, DeepSpeed's and FSDP's groups) keeps gloo
threads that wake while idle: after the block-model tests a 2-rank pool's ranks held 84
threads each and spent 11% of a core each doing nothing, and later in the run 25%, taken
from every test after them. A fresh pool costs a fork from the warm server."""
WARM = ("torch", "torch.distributed", "numpy", "transformers", "accelerate", "deepspeed",
        "deepspeed.comm", "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.engine",
        "transformers.models.llama.modeling_llama", "arctic",
        # what the ranks went on to import, each in a third of them or more (a probe of every
        # rank's sys.modules over the default run): fake tensors, DeepSpeed's op loader (the
        # shared-memory all-reduce) and its expert-parallel modules, the profiler
        "torch._subclasses.fake_tensor", "torch._subclasses.schema_check_mode", "torch.profiler",
        "torch.utils.cpp_extension", "deepspeed.ops.op_builder.all_ops",
        "deepspeed.module_inject.auto_ep_layer", "deepspeed.runtime.superoffload",
        "transformers.models.auto.processing_auto")
"""What both fork servers (this one and tests/launch_pool.py's) import before their first
fork, whatever is installed of it. A process forked without them imports them itself:
``transformers.modeling_utils`` alone is 2 s of CPU. A pool is replaced whenever its ranks
hold too many threads (about 25 times a run), and each replacement's ranks would pay again.
The muon module is what ``deepspeed.initialize`` imports to check a ZeRO optimizer, inductor
with it."""
PRELOAD = (*WARM, "ulysses", "offload", "helpers", "pytest", "arctic.hf.mixers",
           "arctic.hf.attention", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3_5.modeling_qwen3_5",
           "transformers.models.mistral.modeling_mistral")
"""What this fork server imports: :data:`WARM`, and what the tests' functions import (their
modules, pytest with them, and the families most tests build)."""


def _rank_main(rank: int, world_size: int, init_file: str, address: str) -> None:
    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's setting: subprocesses wait
    torch.set_num_threads(1)
    # What torchrun would set; DeepSpeed reads LOCAL_RANK.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    conn = Connection(sock.detach())
    conn.send(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the test process is gone
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent verbatim
            result = (False, traceback.format_exc())
        conn.send((*result, _threads() > MAX_THREADS))
    dist.destroy_process_group()


def _threads() -> int:
    """This process's threads, native ones included (gloo's); 0 where /proc does not list
    them (not Linux): the pool is then never replaced for its threads."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def freeze_heap() -> None:
    """Move what the imports made out of the collector's reach: a forked rank's
    ``gc.collect()`` (DeepSpeed's ZeRO-3 calls it while it partitions, the Trainer between
    steps) then walks the rank's own objects, not the whole preloaded heap (0.9 s a call),
    and its pages stay shared with the server's."""
    import gc

    gc.collect()
    gc.freeze()


def _serve(conn) -> None:
    """The fork server: imports :data:`PRELOAD`, then forks a pool's ranks on request."""
    import importlib

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked ranks are reaped as they exit
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    freeze_heap()
    while True:
        request = conn.recv()
        if request is None:
            return
        world_size, init_file, address = request
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    conn.close()
                    _rank_main(rank, world_size, init_file, address)
                except BaseException:  # noqa: BLE001 - the pool sees the connection close
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            pids.append(pid)
        conn.send(pids)


def _server():
    if not _SERVER or not _SERVER[0][0].is_alive():
        ours, theirs = _CTX.Pipe()
        proc = _CTX.Process(target=_serve, args=(theirs,), daemon=True)
        proc.start()
        _SERVER[:] = [(proc, ours)]
    return _SERVER[0][1]


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size, self._closed = world_size, False
        self._dir = tempfile.mkdtemp(prefix="dist_pool_")
        init_file = os.path.join(self._dir, "gloo_init")
        address = os.path.join(self._dir, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(world_size)
        listener.settimeout(300)  # the server's first imports, then the forks
        server = _server()
        server.send((world_size, init_file, address))
        self._pids = server.recv()
        self._conns: list[Connection | None] = [None] * world_size
        try:
            for _ in range(world_size):
                sock, _ = listener.accept()
                sock.setblocking(True)
                conn = Connection(sock.detach())
                self._conns[conn.recv()] = conn
        except OSError:
            self.close(kill=True)
            raise
        finally:
            listener.close()

    def run(self, fn, args, kwargs, timeout: float) -> list:
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        got: dict[int, tuple[bool, object, bool]] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(pending.values())
                self.close(kill=True)
                raise TimeoutError(f"ranks {missing} of {self.world_size} did not finish "
                                   f"{fn.__name__} within {timeout}s (hang?)")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    got[rank] = conn.recv()
                except EOFError:
                    got[rank] = (False, f"rank {rank} exited while running {fn.__name__}",
                                 True)
        if any(retire for _, _, retire in got.values()):
            self.close(kill=True)  # idle ranks: nothing to wait for
        failed = {r: v for r, (ok, v, _) in got.items() if not ok}
        if failed:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failed)}:\n{report}")
        return [got[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if _POOLS.get(self.world_size) is self:
            _POOLS.pop(self.world_size)
        for conn in self._conns:
            if conn is not None and not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else 10)
        for pid in self._pids:
            while not kill and time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for name in ("gloo_init", "sock"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        os.rmdir(self._dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(fn, *args, world_size: int, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group.

    Returns the list of per-rank return values. If a rank raised, the pool is replaced (its
    process group may be mid-collective) and an AssertionError carries the tracebacks.
    """
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except AssertionError:
        pool.close(kill=True)
        raise


def shutdown() -> None:
    """End every pool at the end of the session: the workers are killed (each would spend
    about a second of CPU exiting torch, a dozen seconds over the 1-, 2-, 4- and 8-rank
    pools, with nothing left to do), and the fork server with them."""
    for pool in list(_POOLS.values()):
        pool.close(kill=True)
    if _SERVER:
        proc, conn = _SERVER.pop()
        if proc.is_alive():
            conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
