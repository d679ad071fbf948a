"""Run a function on W gloo ranks, with a pool of worker processes kept per W.

Spawning W processes and importing torch costs seconds, so each world size gets one pool for
the whole pytest session. ``run(fn, *args, world_size=W)`` sends ``fn`` (a module-level,
picklable function) to every rank, waits for all of them, and returns the per-rank results in
rank order. A rank that raises fails the call with every failing rank's traceback; a call that
does not finish within ``timeout`` (a hang) kills the pool and fails, and the next call starts
a fresh one.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
_POOLS: dict[int, "_Pool"] = {}
# Collectives fail (instead of hanging forever) after this long.
GLOO_TIMEOUT_S = 45


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What torchrun would set; DeepSpeed reads LOCAL_RANK.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent verbatim
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        fd, self._init_file = tempfile.mkstemp(prefix="gloo_init_")
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [_CTX.Queue() for _ in range(world_size)]
        self._results = _CTX.Queue()
        self._procs = [
            _CTX.Process(target=_worker, args=(r, world_size, self._init_file, self._tasks[r],
                                               self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, args, kwargs, timeout: float) -> list:
        for q in self._tasks:
            q.put((fn, args, kwargs))
        got: dict[int, tuple[bool, object]] = {}
        while len(got) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(got))
                self.close(kill=True)
                raise TimeoutError(f"ranks {missing} of {self.world_size} did not finish "
                                   f"{fn.__name__} within {timeout}s (hang?)") from None
            got[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failed)}:\n{report}")
        return [got[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        _POOLS.pop(self.world_size, None)
        for p, q in zip(self._procs, self._tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


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
    pools, with nothing left to do)."""
    for pool in list(_POOLS.values()):
        pool.close(kill=True)
