"""Launch a script on N ranks as ``torchrun`` or ``deepspeed`` would, without paying for a
fresh interpreter on every rank.

A launched example spends most of its time starting: each rank imports torch, transformers,
accelerate and deepspeed (about 6 s of CPU each on 2 cores) before a training step that takes
a fraction of a second. Here one long-lived process, spawned once per pytest session, imports
them once; every launch forks it once per rank. Each child is what the launcher would start:

- the environment the test gives (replacing the server's), plus what the launcher sets:
  ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE``,
  ``CROSS_RANK`` and ``CROSS_SIZE`` (deepspeed), ``MASTER_ADDR``, ``MASTER_PORT``, and
  torchrun's ``OMP_NUM_THREADS=1`` for more than one rank;
- torch's thread count as a fresh interpreter reads it (``OMP_NUM_THREADS``, else every core);
- ``sys.argv`` the script and its arguments (the deepspeed launcher appends
  ``--local_rank=R``), the script's folder first on ``sys.path``, the working directory the
  test gives, and the script run as ``__main__``;
- its stdout and stderr into one output, interleaved as the launcher's are.

As the launchers do, a rank that fails ends the others (its exit status is the launch's), and
a launch past its timeout is killed whole. The launcher itself, and a fresh interpreter's own
start-up (``sitecustomize``, import-time environment), are what this does not exercise: tests
of those launch the real command.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from dist_pool import WARM, freeze_heap

PRELOAD = (*WARM, "torch._dynamo", "transformers.trainer", "arctic.train.trainer",
           "arctic.train.deepspeed", "arctic.train.fsdp", "arctic.trainer", "arctic.plan", "trl",
           "torch.distributed.checkpoint.state_dict", "torch.utils.serialization")
"""What the server imports before its first fork (whatever is installed of it):
:data:`dist_pool.WARM`, and what the launched scripts import (the Trainer, TRL, the planner,
distributed checkpoints); a probe of every launched rank's ``sys.modules`` found each of
these in a tenth of them or more."""

_SERVER: tuple[multiprocessing.Process, object] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(script: str, args: list[str], env: dict, cwd: str, out_fd: int) -> int:
    """In the forked child: become the launched rank, run the script, return its exit code."""
    import runpy

    import multiprocessing.process as mp_process

    # A main process of its own, as a fresh interpreter is (not the server's daemonic child,
    # which multiprocessing would forbid to start processes, DeepSpeed's converter's pool).
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    mp_process.current_process()._config.pop("daemon", None)
    mp_process._children.clear()
    mp_process._parent_process = None
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    threads = env.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else (os.cpu_count() or 1))
    try:
        if script.startswith("-m "):  # python -m MODULE: the working directory on sys.path
            module = script[3:]
            sys.argv = [module, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(script)
            sys.argv = [path, *args]
            sys.path[0] = os.path.dirname(path)
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter exits: None 0, an int itself, else 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())  # torch.distributed's, once a group is up: [rankN]:
        code = 1
    return code


def _launch(request: dict) -> tuple[int, str, bool]:
    """In the server: fork the ranks, wait for them; ``(returncode, output, timed_out)``."""
    nproc, launcher = request["nproc"], request["launcher"]
    env = dict(request["env"])
    if launcher != "python":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"] or free_port()),
                   WORLD_SIZE=str(nproc))
    if launcher == "torchrun":
        env.update(LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0",
                   ROLE_WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE_ROLE=str(nproc))
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
    elif launcher == "deepspeed":
        env.update(LOCAL_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1")
    fd, out_path = tempfile.mkstemp(prefix="launch_pool_")
    os.close(fd)
    out_fd = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    pgid = 0
    for rank in range(nproc):
        args = list(request["args"])
        if launcher == "deepspeed":
            args.append(f"--local_rank={rank}")
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                os.setpgid(0, pgid)
                ranked = {} if launcher == "python" else {"RANK": str(rank),
                                                          "LOCAL_RANK": str(rank)}
                code = _rank_main(request["script"], args, {**env, **ranked}, request["cwd"],
                                  out_fd)
            finally:
                try:
                    import atexit

                    atexit._run_exitfuncs()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
        if rank == 0:
            pgid = pid
        try:
            os.setpgid(pid, pgid)
        except OSError:  # the child has set it already (or has exited)
            pass
        pids.append(pid)
    os.close(out_fd)

    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    timed_out = failed = False
    while len(codes) < nproc:
        pid, status = os.waitpid(-pgid, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and not failed:  # the launcher ends the other ranks
                failed = True
                first = codes[pid]
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    with open(out_path, errors="replace") as f:
        output = f.read()
    os.unlink(out_path)
    code = first if failed else 0
    return code, output, timed_out


def _serve(conn, env: dict) -> None:
    os.environ.update(env)
    import importlib

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
        conn.send(_launch(request))


def _server() -> tuple[multiprocessing.Process, object]:
    global _SERVER
    if _SERVER is None or not _SERVER[0].is_alive():
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, {"PYTHONUNBUFFERED": "1"}), daemon=True)
        proc.start()
        _SERVER = (proc, ours)
    return _SERVER


def launch(script: str, *args: str, nproc: int, cwd: str, env: dict | None = None,
           launcher: str = "torchrun", port: int | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` (or ``deepspeed --num_gpus NPROC ...``
    with ``launcher="deepspeed"``), forked from the warm server. Returns a
    ``CompletedProcess`` whose ``stdout`` holds every rank's stdout and stderr; raises
    ``subprocess.TimeoutExpired`` past ``timeout`` (the ranks killed)."""
    if launcher not in ("torchrun", "deepspeed", "python"):
        raise ValueError(f"launcher must be 'torchrun', 'deepspeed' or 'python', "
                         f"got {launcher!r}")
    if launcher == "python" and nproc != 1:
        raise ValueError("a plain python command runs one process")
    proc, conn = _server()
    request = dict(script=str(script), args=[str(a) for a in args], nproc=nproc, cwd=str(cwd),
                   env=dict(os.environ if env is None else env), launcher=launcher, port=port,
                   timeout=timeout)
    conn.send(request)
    # The server times the ranks out itself; this wait also covers its own imports.
    if not conn.poll(timeout + 120):
        shutdown()
        raise subprocess.TimeoutExpired([launcher, str(script), *args], timeout)
    code, output, timed_out = conn.recv()
    cmd = [launcher, f"--nproc={nproc}", str(script), *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=output)
    return subprocess.CompletedProcess(cmd, code, output, "")


_NPROC = {"torchrun": ("--nproc-per-node", "--nproc_per_node"), "deepspeed": ("--num_gpus",)}
_PORT = {"torchrun": ("--master-port", "--master_port"), "deepspeed": ("--master_port",)}


def run(cmd: list[str], *, cwd, env: dict | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """A command line as a test would give ``subprocess.run``, run through :func:`launch`:
    ``torchrun [--standalone] --nproc-per-node N [--master-port P] SCRIPT ARGS`` (or
    ``python -m torch.distributed.run ...``), ``deepspeed --num_gpus N
    [--master_port P] SCRIPT ARGS``, or ``python SCRIPT ARGS`` / ``python -m MODULE ARGS``
    (``sys.executable``). Any other launcher option is refused: run that command for real."""
    cmd = [str(c) for c in cmd]
    name = os.path.basename(cmd[0])
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        cmd, name = ["torchrun", *cmd[3:]], "torchrun"
    if cmd[0] == sys.executable or name.startswith("python"):
        if cmd[1] == "-m":
            return launch(f"-m {cmd[2]}", *cmd[3:], nproc=1, cwd=cwd, env=env,
                          launcher="python", timeout=timeout)
        return launch(cmd[1], *cmd[2:], nproc=1, cwd=cwd, env=env, launcher="python",
                      timeout=timeout)
    if name not in _NPROC:
        raise ValueError(f"launch_pool.run runs torchrun, deepspeed or python, not {cmd[0]}")
    rest, nproc, port = cmd[1:], 1, None
    while rest and rest[0].startswith("-"):
        if name == "torchrun" and rest[0] == "--standalone":  # one node, a free port: ours
            rest = rest[1:]
            continue
        option, _, value = rest[0].partition("=")
        if not value:
            value, rest = rest[1], rest[1:]
        rest = rest[1:]
        if option in _NPROC[name]:
            nproc = int(value)
        elif option in _PORT[name]:
            port = int(value)
        else:
            raise ValueError(f"launch_pool.run does not emulate {name}'s {option}")
    return launch(rest[0], *rest[1:], nproc=nproc, cwd=cwd, env=env, launcher=name, port=port,
                  timeout=timeout)


class Started:
    """A stand-in for ``subprocess.Popen(cmd, stdout=PIPE, stderr=STDOUT, text=True)`` in
    tests that start a run and wait on it later: the command runs through :func:`run` when
    ``communicate`` is called (the server runs one launch at a time)."""

    def __init__(self, cmd: list[str], *, cwd, env: dict | None = None) -> None:
        self.args, self.cwd, self.env = [str(c) for c in cmd], cwd, env
        self.returncode: int | None = None
        self.stdout_text = ""

    def communicate(self, timeout: float = 600) -> tuple[str, None]:
        if self.returncode is None:
            done = run(self.args, cwd=self.cwd, env=self.env, timeout=timeout)
            self.returncode, self.stdout_text = done.returncode, done.stdout
        return self.stdout_text, None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """Nothing runs between calls."""


def shutdown() -> None:
    """End the server (at the end of the session, or after it stopped answering)."""
    global _SERVER
    if _SERVER is None:
        return
    proc, conn = _SERVER
    _SERVER = None
    proc.kill()
    proc.join(timeout=10)
