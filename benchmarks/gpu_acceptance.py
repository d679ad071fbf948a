"""One command that checks this package on one lent GPU, inside one wall-clock budget.

Every step runs in a subprocess whose timeout is cut from ``--budget-s`` (default 540 s; the
device tool stops a command at 600 s). A step that runs past its timeout is killed with its
process group and recorded as "timed out"; a step with too little budget left is "not run".
In order:

- ``install``: the carried wheels (``--install-wheels``, default ``.whl``) go into a
  temporary ``--target`` directory on the children's ``PYTHONPATH`` (the GPU image has torch,
  transformers and accelerate, but not deepspeed, hjson or pydantic); the repository itself
  goes on ``PYTHONPATH`` too, so nothing is installed into the image. Then, when the ``step``
  group is chosen, its planner runs start in the background (CPU; they overlap the GPU work);
- ``backends``: every CUDA attention backend against the float64 reference
  (``ulysses.self_check.compare_with_reference``): bf16 and fp16, head dims 64 and 128, odd
  lengths 45, 301 and 1000, causal and not, plus a sliding window with sinks; a backend that
  ``check_supported`` refuses is "skipped" with its reason (e.g. fa3 not installed);
- ``step``: the real-model verdict (``_acceptance_step.py``): the planner's pick for
  Llama-3-8B on 8 GPUs at 128K, 64K, 16K, 8K and 4K tokens per rank, timed by
  ``benchmarks/step_gpu.py`` on this GPU (one rank of 8 on torch's fake process group) at 1
  and 2 layers and extended to 32, beside ALST's stack (64K, 128K) and plain Ulysses (4K to
  16K; our ``ulysses`` stack, DeepSpeed's ``DistributedAttention`` in effect: step_gpu's
  build has no place for DeepSpeed's module-global SP groups), FlashAttention-4 where it
  imports; verdict rows: ours' 32-layer MFU at 128K >= 40%,
  ours at least as fast as ALST and as plain Ulysses. It comes before the long checks since
  its verdict is what one call must give; it takes at most 400 s, the most important
  lengths first (what the budget leaves out is "not run"); then ``python -m arctic.plan
  --calibrate`` measures the planner's rates on this GPU, reported in its row;
- ``tests``: each test file with CUDA-only tests (found at run time: a
  ``skipif(not torch.cuda.is_available(), ...)`` marker), one pytest run per file, so that a
  timeout costs one file. The
  default selection: no CUDA-only test is marked slow (the slow cases in these files are CPU
  and DeepSpeed-aio variants that CI's slow run covers); ``--slow`` adds them;
- ``disk``: ``benchmarks/offload_disk.py --device cuda`` (the disk tier against host offload,
  gradients bit for bit; threads I/O, since the aio op would JIT-build for minutes) and
  ``benchmarks/scale_gpu.py --seq-chunk --offload-dir``: the sequence-chunk loop's host
  blocks (pinned copies on a side stream) and the disk tier inside a real step (their values
  are checked by the ``tests`` group: ``tests/test_ulysses_host_blocks.py`` on CUDA);
- ``fits``: the planner's peak at ``--fits-tokens`` (``python -m arctic.plan``), then
  ``scale_gpu.py --cap-gib`` at the smallest cap the planner says fits (the step must run) and
  at 0.9 x the predicted peak (the planner says no; the step must run out of memory);
- ``hybrid``: ``benchmarks/hybrid_layer.py``, two ranks (sharing one GPU over gloo where
  that is all there is, the exchanges through host memory): a gated delta net layer of
  Qwen3.5-9B's shapes, 32K tokens in three packed documents, by the all-to-all over heads and
  by state passing (flash-linear-attention's own context parallelism, ``fla.ops.cp``, where
  the carried ``fla-core`` wheel is installed) against the unmodified layer run document by
  document; time, peak memory, and the values within bf16's tolerance.

One 540 s call holds install, backends, step and the first test files; the checks it leaves
"not run" go in a second call (``--only tests disk fits hybrid``).

Writes ``benchmarks/results/gpu_acceptance_<gpu>.json`` (``--out``), a markdown table with the
same stem and the subprocesses' full output (``.log``); with ``$OUT`` set (the device tool),
copies of the three go there. ``--dry-run`` prints every command, the step group's schedule
and the backend grid, and runs nothing. Exits 1 if a step failed or timed out, 2 without a
CUDA device.

The wheels, once, where pip reaches PyPI (``.whl/`` is ignored by git)::

    python benchmarks/gpu_acceptance.py --make-wheels .whl

Then on the device tool: carry ``[".whl"]``, command::

    python3 benchmarks/gpu_acceptance.py --install-wheels .whl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable

import torch

# benchmarks/, on sys.path as the script's directory
from _acceptance_checks import (CAP_S, DTYPES, GRID_SHAPE, HEAD_DIMS, LENGTHS, SEQ_CHUNK,
                                SPILL_HOST_GIB, WINDOW_CASE, GiB, backend_rows, calibrate_cmd,
                                calibrate_rows, cuda_test_files,
                                disk_rows, fits_rows, grid_backends, grid_cases, grid_cmd,
                                hybrid_cmd, hybrid_rows, offload_disk_cmd, plan_cmd, pytest_cmd,
                                pytest_file_rows, run_grid_worker, scale_cmd)
from _acceptance_runner import (REPO, Budget, Context, Row, Runner, markdown, slug,
                                write_report)
from _acceptance_step import (STEP_CAP_S, PlannerQueue, plan_jobs, plan_workers, rates_of,
                              schedule, step_cmd, step_rows)
from ulysses.kernels import check_supported

RESULTS = REPO / "benchmarks" / "results"
GROUPS = ("backends", "step", "tests", "disk", "fits", "hybrid")
WHEELS = {"deepspeed": "deepspeed", "hjson": "hjson", "pydantic": "pydantic",
          "pydantic_core": "pydantic_core", "annotated_types": "annotated_types",
          "typing_inspection": "typing_inspection", "typing_extensions": "typing_extensions",
          "fla-core": "fla", "einops": "einops", "flash-attn-4": "flash_attn.cute",
          "quack-kernels": "quack", "apache-tvm-ffi": "tvm_ffi",
          "torch-c-dlpack-ext": "torch_c_dlpack_ext"}
"""Distribution -> the module it gives: what the GPU image lacks (deepspeed's and pydantic's
needs the image does not hold, flash-linear-attention's kernels for the ``hybrid`` group:
pure Python on Triton, with einops; FlashAttention-4 for the ``step`` group's fa4 runs, pure
Python, and its small needs), pinned by constraints.txt; typing_extensions because pydantic
needs a newer one than the image's."""
NOT_CARRIED = {"nvidia-cutlass-dsl": "cutlass", "cuda-bindings": "cuda.bindings"}
"""FlashAttention-4's other needs, which no carry can hold: CUTLASS's DSL ships its compiled
MLIR library as a wheel of 92 MiB for CUDA 12 or 13 (4.6 on; 58 to 74 MiB in one wheel
before, too old for flash-attn-4). Where the image lacks them, fa4 is skipped: it does not
import."""
CARRY_MIB = 64
"""What the device tool carries with the working tree, in all."""


# --- wheels -----------------------------------------------------------------------------------

def install_cmd(wheels: list[Path], target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--target", str(target), *map(str, wheels)]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def importable(module: str) -> bool:
    """Whether ``module`` (dotted: its parent is imported to look) can be found."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def carry_problem(wheel_bytes: int, tree_bytes: int, limit_mib: float = CARRY_MIB) -> str:
    """Why the wheels and the working tree cannot travel together ("" if they can)."""
    total = (wheel_bytes + tree_bytes) / (1 << 20)
    if total <= limit_mib:
        return ""
    return (f"the wheels ({wheel_bytes / (1 << 20):.1f} MiB) and the tree "
            f"({tree_bytes / (1 << 20):.1f} MiB) make {total:.1f} MiB, over the "
            f"{limit_mib:g} MiB the device tool carries")


def tree_bytes() -> int:
    """The size of the tracked files (what the device tool copies besides the carried paths)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           text=True).stdout.split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def constraint_pins(path: Path = REPO / "constraints.txt") -> dict[str, str]:
    """constraints.txt's ``name==version`` lines, by normalized name."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def make_wheels(where: Path, python_version: str) -> int:
    """``--make-wheels``: the wheels of :data:`WHEELS` at constraints.txt's pins for the GPU
    image's CPython on x86-64 Linux. deepspeed is an sdist on PyPI: built here as a pure
    Python wheel (no ops; they JIT-build where they run) with this environment's torch."""
    pins = constraint_pins()
    missing = [n for n in WHEELS if _norm(n) not in pins]
    if missing:
        raise ValueError(f"constraints.txt pins none of {missing}; pin them there first")
    specs = {n: f"{n}=={pins[_norm(n)]}" for n in WHEELS}
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                             "manylinux2014_x86_64") for a in ("--platform", p)]
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", python_version, "--implementation", "cp", *platforms,
                "-d", str(where), *(s for n, s in specs.items() if n != "deepspeed")]
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "-w", str(where), specs["deepspeed"]]
    for cmd in (download, build):
        print(f"$ {shlex.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            return rc
    wheels = sorted(where.glob("*.whl"))
    size, tree = sum(p.stat().st_size for p in wheels), tree_bytes()
    print("\n".join(f"{p.stat().st_size / (1 << 20):7.2f} MiB  {p.name}" for p in wheels))
    problem = carry_problem(size, tree)
    if problem:
        print(f"{problem}: leave some out", file=sys.stderr)
        return 1
    print(f"{size / (1 << 20):.1f} MiB of wheels, {tree / (1 << 20):.1f} MiB of tree (the "
          f"device tool carries {CARRY_MIB} MiB in all): carry {where.name!r}")
    return 0


def install_rows(ctx: Context, where: Path) -> list[Row]:
    """Installs the carried wheels into a ``--target`` on the children's PYTHONPATH."""
    missing = [m for m in WHEELS.values() if not importable(m)]
    wheels = sorted(where.glob("*.whl")) if where.is_dir() else []
    name = f"install wheels from {where}"
    if not wheels:
        return [Row(group="install", name=name, status="skipped",
                    reason=f"no wheels there (make them where pip reaches PyPI: "
                           f"--make-wheels {where})",
                    figures={"missing here": ", ".join(missing) or "none"})]
    site = ctx.tmp / "site"
    ran = ctx.runner.run(install_cmd(wheels, site), CAP_S["install"])
    early = ran.early_row("install", name)
    if early or ran.rc != 0:
        return [early or ran.failed_row("install", name, f"pip rc {ran.rc}")]
    ctx.runner.env["PYTHONPATH"] = os.pathsep.join([str(site), ctx.runner.env["PYTHONPATH"]])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = [m for m in WHEELS.values() if not importable(m)]
    image = [f"{m} ({d})" for d, m in NOT_CARRIED.items() if not importable(m)]
    return [Row(group="install", name=name, status="passed", seconds=ran.seconds,
                command=ran.command,
                figures={"missing before": ", ".join(missing) or "none",
                         "installed": ", ".join(p.name.split("-")[0] for p in wheels),
                         "still missing": ", ".join(still) or "none",
                         "fa4's needs not carried, missing in the image": ", ".join(image)
                         or "none"})]


# --- run --------------------------------------------------------------------------------------

def _header(args: argparse.Namespace) -> dict:
    """The card and the versions the run saw (after the install, so deepspeed's is there)."""
    props = torch.cuda.get_device_properties(0)
    versions = {}
    for dist in ("transformers", "accelerate", "deepspeed", "flash-attn-4",
                 "nvidia-cutlass-dsl"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    try:  # the device tool's copy of the tree may have no .git, or no git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        # The device tool's copy carries the working tree, with a .git that may be older.
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=REPO, capture_output=True, text=True).stdout.strip()
        if commit and changed:
            commit += " (the tree differs from it)"
    except OSError:
        commit = ""
    return {"device": props.name, "capability": f"{props.major}.{props.minor}",
            "memory GiB": round(props.total_memory / GiB, 2), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": sys.version.split()[0], **versions, "commit": commit or "unknown",
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "budget s": args.budget_s, "command": shlex.join(sys.argv)}


def steps(args: argparse.Namespace,
          groups: list[str]) -> list[tuple[str, Callable[[Context], list[Row]]]]:
    """(group, step) of the chosen groups in run order: the checks before the measurements."""
    chosen = {
        "backends": [backend_rows],
        "tests": [partial(pytest_file_rows, path=p) for p in cuda_test_files()],
        "disk": [disk_rows],
        "fits": [fits_rows],
        "hybrid": [hybrid_rows],
        "step": [step_rows, calibrate_rows],
    }
    return [(g, step) for g in GROUPS if g in groups for step in chosen[g]]


def run_step(group: str, step: Callable[[Context], list[Row]], ctx: Context) -> list[Row]:
    """The step's rows; a failed row if reading its output raised (a bug here must not lose
    the report of the steps that ran)."""
    try:
        return step(ctx)
    except Exception as e:
        name = getattr(step, "func", step).__name__
        return [Row(group=group, name=name, status="failed",
                    reason=f"gpu_acceptance.py raised {type(e).__name__}: {e}",
                    tail=traceback.format_exc()[-2000:])]


def run_all(args: argparse.Namespace, groups: list[str]) -> int:
    budget = Budget(args.budget_s)
    out = args.out or RESULTS / f"gpu_acceptance_{slug(torch.cuda.get_device_name(0))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # the children's JSONs stay out
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    rows: list[Row] = []

    def show(new: list[Row]) -> None:
        for r in new:
            print(f"[{budget.elapsed():5.0f} s] {r.group:<8} {r.name:<48} {r.status}"
                  f"{': ' + r.reason[:150] if r.reason else ''}", flush=True)
        rows.extend(new)

    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_") as tmp:
        ctx = Context(args=args, runner=Runner(budget, env, log), tmp=Path(tmp),
                      gpu_memory=torch.cuda.get_device_properties(0).total_memory)
        show(install_rows(ctx, args.install_wheels))
        header = _header(args)
        if "step" in groups:  # CPU work that overlaps the GPU's until the step group needs it
            rates = rates_of(torch.cuda.get_device_name(0))
            env = dict(ctx.runner.env, ARCTIC_PLAN_WORKERS=str(plan_workers(os.cpu_count())))
            ctx.planners = PlannerQueue(plan_jobs(ctx.tmp, str(ctx.gpu_memory), rates), env,
                                        REPO).start()
        show([Row(group=g, name=g, status="not run", reason="not chosen with --only")
              for g in GROUPS if g not in groups])
        try:
            for group, step in steps(args, groups):
                show(run_step(group, step, ctx))
        finally:
            if ctx.planners is not None:
                ctx.planners.stop()
    header["elapsed s"] = round(budget.elapsed(), 1)
    written = write_report(out, header, rows)
    print("\n" + markdown(header, rows) + "wrote " + ", ".join(map(str, written)))
    return 1 if any(r.status in ("failed", "timed out") for r in rows) else 0


def dry_run(args: argparse.Namespace, groups: list[str]) -> str:
    """What a run would do, command by command; nothing runs and nothing is written."""
    tmp = Path("$TMP")
    wheels = sorted(args.install_wheels.glob("*.whl")) if args.install_wheels.is_dir() else []
    missing = [m for m in WHEELS.values() if not importable(m)]
    lines = [f"dry run: one GPU, {args.budget_s:g} s budget; step timeouts {CAP_S} s, cut to "
             f"what is left; $TMP is a temporary directory", "",
             f"== install: {len(wheels)} wheel(s) in {args.install_wheels}; missing here: "
             f"{', '.join(missing) or 'none'}",
             "  " + shlex.join(install_cmd(wheels, tmp / "site")) if wheels else
             f"  skipped: none there (--make-wheels {args.install_wheels})"]
    cases = grid_cases()
    detail = {
        "backends": [f"  {shlex.join(grid_cmd(tmp / 'grid.jsonl'))}",
                     f"  {len(cases)} cases: {', '.join(grid_backends())} x "
                     f"{', '.join(DTYPES)} x head dims {HEAD_DIMS} x (lengths {LENGTHS} x "
                     f"causal/full + S={WINDOW_CASE['seq_len']} causal, window "
                     f"{WINDOW_CASE['window']}, sinks + softcap 30 causal, full, windowed + full, "
                     f"symmetric window 37, sinks); "
                     f"batch {GRID_SHAPE['batch']}, "
                     f"{GRID_SHAPE['heads']} heads on {GRID_SHAPE['kv_heads']} kv heads",
                     *_known_skips()],
        "tests": [f"  {shlex.join(pytest_cmd(p, args.slow))}" for p in cuda_test_files()],
        "disk": [f"  {shlex.join(offload_disk_cmd(tmp / 'offload_disk.json'))}",
                 "  " + shlex.join(scale_cmd(args.fits_tokens, tmp / "scale_seq_chunk.json",
                                             "--seq-chunk", str(SEQ_CHUNK), "--offload-dir",
                                             str(tmp / "spill"), "--host-limit-gib",
                                             str(SPILL_HOST_GIB)))],
        "fits": [f"  {shlex.join(plan_cmd(args.fits_tokens, 'CARD_BYTES', tmp / 'plan.json'))}",
                 "  then, for CAP in FIT_GIB and OOM_GIB (the planner's trace is cached):",
                 f"  {shlex.join(plan_cmd(args.fits_tokens, 'CAPGiB', tmp / 'plan_CAP.json'))}",
                 "  " + shlex.join(scale_cmd(args.fits_tokens, tmp / "scale_CAP.json",
                                             "--cap-gib", "CAP")),
                 "  FIT_GIB: predicted peak x card / planner budget, up to 0.25 GiB (must run); "
                 "OOM_GIB: 0.9 x predicted peak, down to 0.25 GiB (must run out of memory)"],
        "hybrid": [f"  {shlex.join(hybrid_cmd(tmp / 'hybrid_layer.json'))}"],
        "step": [*_step_lines(args, tmp),
                 f"  then the planner's rates on this GPU: "
                 f"{shlex.join(calibrate_cmd(tmp / 'rates.json'))}"],
    }
    for g in GROUPS:
        lines += ["", f"== {g}" + ("" if g in groups else ": not chosen with --only")]
        lines += detail[g] if g in groups else []
    return "\n".join(lines)


def _step_lines(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The planner runs (in the background from the start), the schedule, step_gpu.py."""
    lines = ["  planner runs, one after another from the start (CARD_BYTES: this card's "
             "memory; RATES: h100 or h200 by its name), each writing its JSON and JSON.rc:"]
    lines += [f"  {shlex.join(cmd)}" for cmd, _ in plan_jobs(tmp, "CARD_BYTES", "RATES")]
    lines.append(f"  then, within {STEP_CAP_S} s, the phases of {tmp / 'step_schedule.json'} "
                 f"in order (ours: the planner's pick, waited for; if it failed, the named "
                 f"'ours' stack):")
    for p in schedule(tmp):
        runs = ", ".join(r.label + ("" if r.backend == "auto" else f" ({r.backend})")
                         for r in p.runs)
        lines.append(f"    {p.tokens}/rank: {runs}" + (" + kernels alone" if p.kernels else ""))
    lines.append("  " + shlex.join(step_cmd(tmp / "step_schedule.json", tmp / "step.json",
                                            args.step_iters, STEP_CAP_S - 30)))
    return lines


def _known_skips() -> list[str]:
    """What this install already rules out on CUDA (packages, cuDNN); the GPU decides the rest."""
    seen = {}
    for c in grid_cases():
        try:
            check_supported(c["backend"], torch.device("cuda"), DTYPES[c["dtype"]], c["head_dim"])
        except ValueError as e:
            seen.setdefault(str(e), None)
    return [f"  would skip (this install): {reason}" for reason in seen]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="print every step's command and the backend grid; run nothing")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget of the whole run (the device tool allows 600 s)")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON (default benchmarks/results/gpu_acceptance_<gpu>.json); the "
                        "markdown table and the log take the same stem")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=None,
                   help="run these groups only (e.g. the ones a first run had no time for)")
    p.add_argument("--install-wheels", type=Path, default=REPO / ".whl", metavar="DIR",
                   help="install DIR/*.whl (no index, no deps) for the children; default .whl")
    p.add_argument("--make-wheels", type=Path, default=None, metavar="DIR",
                   help=f"download/build the wheels of {', '.join(WHEELS)} for the GPU image "
                        f"into DIR (needs PyPI) and exit")
    p.add_argument("--wheel-python", default="3.12",
                   help="the GPU image's Python version, for --make-wheels (default 3.12)")
    p.add_argument("--slow", action="store_true",
                   help="run the test files with -m 'slow or not slow' (default: the default "
                        "selection, which holds every CUDA-only test)")
    p.add_argument("--step-iters", type=int, default=3,
                   help="step_gpu.py --iters: timed steps per run and depth (median)")
    p.add_argument("--fits-tokens", default="64K",
                   help="tokens per rank of the capped fits check and the host-blocks run")
    p.add_argument("--grid-worker", type=Path, default=None, metavar="JSONL",
                   help="internal: run the backend grid here, appending results to JSONL")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_wheels is not None:
        return make_wheels(args.make_wheels, args.wheel_python)
    if args.grid_worker is not None:
        run_grid_worker(args.grid_worker)
        return 0
    groups = args.only or list(GROUPS)
    if args.dry_run:
        print(dry_run(args, groups))
        return 0
    if not torch.cuda.is_available():
        print("gpu_acceptance.py needs a CUDA device and this machine has none; "
              "--dry-run shows what it would run", file=sys.stderr)
        return 2
    return run_all(args, groups)


if __name__ == "__main__":
    sys.exit(main())
