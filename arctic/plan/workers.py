"""The planner's tracing processes: started once, fed traces one at a time, memory first.

Apart from :mod:`arctic.plan.traces` because it knows nothing of what a trace is: it runs a
function of a job in a worker process and hands back its result. The workers live on from
trace to trace (a trace reads the same in a process that traced before: :func:`_pool`),
forked from multiprocessing's fork server, which imports :data:`PRELOAD` once, or, for the
command line, from the command line's own process (:func:`_forks_itself`). Jobs wait in
this process, not in the pool's queue, so that a memory trace queued after many work traces
runs next (:func:`submit`'s ``first``), and no more than :func:`workers` traces run at
once.
"""

from __future__ import annotations

import atexit
import heapq
import importlib
import itertools
import multiprocessing
import os
import threading

from arctic.plan.cache import cache_dir

PRELOAD = ["arctic.plan.estimate", "arctic.plan.traces", "arctic.train.deepspeed",
           "arctic.train.fsdp", "torch.distributed.fsdp", "torch.distributed._tools.mem_tracker",
           "torch._subclasses.fake_tensor", "torch.testing._internal.distributed.fake_pg",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3.modeling_qwen3"]
"""What every trace imports (about 4 s on a 2-core machine): a tracing process is forked
from a process that imported them once (:func:`start_workers`)."""

FORK_FROM_HERE: list = []
"""Set by ``python -m arctic.plan`` (before anything else runs): its tracing processes are
forks of itself, taken when the first traces are queued (:func:`_forks_itself`)."""

TRACED_HERE: list = []
"""Set once this process traced: a fork of it could hold what a trace left behind."""

IN_WORKER: list = []
"""Set in a tracing process: its traces run in it."""


def workers() -> int:
    """Processes that trace at once when several traces are needed (a trace is one Python
    thread): ``ARCTIC_PLAN_WORKERS`` as the environment has it now, else up to 4 cores."""
    return int(os.environ.get("ARCTIC_PLAN_WORKERS", "0")) or min(4, os.cpu_count() or 1)


def in_workers(jobs: int) -> bool:
    """Whether ``jobs`` traces run in worker processes: with two workers or more and the
    disk cache on (where they leave their traces), outside a tracing process, when there are
    several or the workers run already (a lone trace, as a plan of given settings may need
    first, starts no processes)."""
    return (workers() >= 2 and cache_dir() is not None and not IN_WORKER and
            (jobs >= 2 or _STATE.pool is not None))


def _forks_itself() -> bool:
    """Whether this process's tracing processes are its own forks: the command line's,
    while it has only imported and read the model (no trace, one thread), which the forks
    hold as a fork server's would, without waiting for one to import it all again (about
    2 s sooner on 2 cores)."""
    return bool(FORK_FROM_HERE) and not TRACED_HERE and threading.active_count() == 1


def _server():
    """The fork server's context: a fork of a process that only imported holds no lock (a
    fork of one that traced could), and each tracer starts in milliseconds instead of
    importing."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_workers() -> None:
    """Start the workers' fork server now, so that its imports overlap the caller's own
    work (the CLI calls this first); a no-op when traces run in this process."""
    if workers() >= 2 and cache_dir() is not None:
        from multiprocessing import forkserver

        _server()
        forkserver.ensure_running()


class _Job:
    """A queued or running job: its result once done."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class _State:
    def __init__(self) -> None:
        self.pool = None
        self.starting = threading.Lock()
        self.lock = threading.Lock()
        self.queue: list = []  # (0: first / 1, order, key, fn, arg)
        self.order = itertools.count()
        self.running = 0
        self.jobs: dict[str, _Job] = {}


_STATE = _State()
# A fork (a worker) starts with no jobs, queue or pool of its own: what it inherits is its
# parent's, whose jobs it would wait for forever.
os.register_at_fork(after_in_child=_STATE.__init__)


def submit(key: str, fn, arg, *, first: bool = False) -> None:
    """Queue ``fn(arg)`` (module-level, picklable) under ``key`` unless it is queued or
    running; ``first``: ahead of the jobs queued without it. :func:`wait` has its result."""
    with _STATE.lock:
        if key in _STATE.jobs:
            return
        _STATE.jobs[key] = _Job()
        heapq.heappush(_STATE.queue, (0 if first else 1, next(_STATE.order), key, fn, arg))
    _feed()


def wait(key: str):
    """The result of the job ``key`` (None if none was queued), once it is done; the job is
    forgotten. Raises what the job raised."""
    job = _STATE.jobs.get(key)
    if job is None:
        return None
    job.done.wait()
    with _STATE.lock:
        _STATE.jobs.pop(key, None)
    if job.error is not None:
        raise job.error
    return job.result


def _feed() -> None:
    """Hand queued jobs to idle workers (one each: the pool's own queue stays empty)."""
    pool = _pool()
    while True:
        with _STATE.lock:
            if _STATE.running >= workers() or not _STATE.queue:
                return
            _, _, key, fn, arg = heapq.heappop(_STATE.queue)
            _STATE.running += 1
            job = _STATE.jobs[key]

        def finished(result, job=job):
            job.result = result
            _done(job)

        def failed(error, job=job):
            job.error = error
            _done(job)

        pool.apply_async(fn, (arg,), callback=finished, error_callback=failed)


def _done(job: _Job) -> None:
    with _STATE.lock:
        _STATE.running -= 1
    job.done.set()
    _feed()


def start() -> None:
    """Start the workers now (before threads that queue traces: a lone trace of a thread
    would otherwise run in this process, :func:`in_workers`); a no-op where traces run in
    this process."""
    if in_workers(2):
        _pool()


def _pool():
    """The :func:`workers` tracing processes, started at the first job, which live on from
    trace to trace. A trace reads the same in them as in a fresh process (once, a process
    that traced before read more: the module tracking of the traces' MemTracker held dead
    parts of the graph until the garbage collector ran;
    :func:`ulysses.torch_internals.step_mem_tracker`), and keeps the fake tensors' dispatch
    cache that the traces before it filled (the settings of one model mostly hit it: a
    llama3-8b search's work traces took half the time). For the command line they are
    forks of its own process, where it only read the model (:func:`_forks_itself`)."""
    with _STATE.starting:
        return _STATE.pool or _start()


def _start():
    """Start :func:`_pool`'s workers (once: under ``_STATE.starting``)."""
    if _STATE.pool is None:
        atexit.register(close)
        if _forks_itself():
            for name in PRELOAD:
                importlib.import_module(name)
            _STATE.pool = multiprocessing.get_context("fork").Pool(workers())
        else:
            _STATE.pool = _server().Pool(workers())
    return _STATE.pool


def close() -> None:
    """Stop the workers and forget the jobs (a later job starts new workers)."""
    with _STATE.lock:
        pool, _STATE.pool = _STATE.pool, None
        _STATE.queue.clear()
        _STATE.jobs.clear()
        _STATE.running = 0
    if pool is not None:
        pool.terminate()
        pool.join()
