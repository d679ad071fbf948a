"""``python -m arctic.plan`` for the tests, answered by one long-lived process.

Each command line runs ``arctic.plan.cli.main`` in that process, with its stdout and stderr
captured and its exit status computed the way the interpreter computes it for ``SystemExit``.
The process is spawned, so the fake process group the planner initializes never reaches the
test process. It imports torch, transformers and the planner once, and its tracing fork
server keeps running between calls; a command then costs its traces, not the 8 s of imports
a fresh interpreter spends. Every command line still goes through the same ``main`` a shell
would run. A call that does not finish within its timeout kills the process (the next call
starts a fresh one).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile

_EXECUTOR: concurrent.futures.ProcessPoolExecutor | None = None
_ENV: dict[str, str] | None = None

CACHE = tempfile.mkdtemp(prefix="arctic-plan-cache-")
"""The trace cache of this pytest run, shared by the planner's test files: one planner
process serves them all (another environment would start another), and a trace one file made
is one the next need not make again (the keys hold the code, the settings and the shapes)."""
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
ENV = {"ARCTIC_PLAN_CACHE": CACHE}


def _start(env: dict[str, str]) -> None:
    os.environ.update(env)


def _main(argv: list[str]) -> tuple[int, str, str]:
    from arctic.plan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # as the interpreter exits: None 0, an int itself, else 1
            code = e.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        sys.stdout.flush()
    return code or 0, out.getvalue(), err.getvalue()


def _executor(env: dict[str, str]) -> concurrent.futures.ProcessPoolExecutor:
    global _EXECUTOR, _ENV
    if _EXECUTOR is not None and env != _ENV:
        shutdown()
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(env,))
        _ENV = dict(env)
    return _EXECUTOR


def call(fn, *args, env: dict[str, str], timeout: float = 300):
    """``fn(*args)`` (a module-level function) in the planner's process, with ``env`` added
    to its environment."""
    future = _executor(env).submit(fn, *args)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        shutdown(kill=True)
        raise TimeoutError(f"{fn.__name__} did not finish within {timeout}s") from None


def plan(argv: list[str], *, env: dict[str, str],
         timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m arctic.plan *argv`` with ``env`` added to the environment."""
    code, out, err = call(_main, list(argv), env=env, timeout=timeout)
    return subprocess.CompletedProcess(["-m", "arctic.plan", *argv], code, out, err)


def shutdown(kill: bool = False) -> None:
    global _EXECUTOR
    if _EXECUTOR is None:
        return
    executor, _EXECUTOR = _EXECUTOR, None
    if kill:
        for p in list(getattr(executor, "_processes", {}).values()):
            p.kill()
    executor.shutdown(wait=not kill, cancel_futures=True)
