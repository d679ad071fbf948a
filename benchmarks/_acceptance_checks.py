"""The check groups of ``gpu_acceptance.py``: the commands each step runs (the run and the dry
run build them alike), the CUDA test files, and the rows each step's output becomes (backend
grid, test files, disk tier and host blocks, the planner's fits, the hybrid layer). The
``step`` group, a measurement with verdicts, is ``_acceptance_step.py``."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable

import torch

from _acceptance_runner import REPO, Context, Ran, Row, pytest_row
from arctic.plan.units import parse_tokens
from ulysses.kernels import BACKENDS, check_supported

GiB = 1 << 30
MODEL, LAYERS, WORLD = "llama3-8b", 2, 8
"""The model shape of the fits and host-blocks runs: one rank of 8, as in the tables of
docs/benchmarks.md."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128)
LENGTHS = (45, 301, 1000)
"""Odd lengths: not multiples of the kernels' 32, 64 or 128 tiles."""
GRID_SHAPE = dict(batch=2, heads=8, kv_heads=2)
WINDOW_CASE = dict(seq_len=301, causal=True, window=37, sinks=True)
SOFTCAP_CASES = (dict(seq_len=301, causal=True, window=None, sinks=False, softcap=30.0),
                 dict(seq_len=301, causal=False, window=None, sinks=False, softcap=30.0),
                 dict(WINDOW_CASE, softcap=30.0))
"""Gemma2's logit cap (small enough to bind on these inputs): the kernel's own ``softcap``
where it takes one (flash_attn, fa3), else the blockwise capped kernel on the GPU."""
SYMMETRIC_CASE = dict(seq_len=301, causal=False, window=37, sinks=True)
"""A window without a causal mask (``|q - k| < window``, Gemma3's bidirectional sliding
layers): anticausal, full and offset-causal pieces."""
SEQ_CHUNK, SPILL_HOST_GIB = 4, 0.25
"""The host-blocks run: 4 sequence blocks, and a host limit under one layer's input (0.5 GiB
at 64K tokens), so the layer inputs spill to the disk tier."""
CAP_S = dict(install=120, grid=150, test_file=240, offload_disk=120, plan=150, scale=150,
             hybrid=180, calibrate=90)
"""Each kind of step's own timeout; the budget left cuts it further."""


# --- commands (the run and the dry run build them alike) --------------------------------------

_CUDA_ONLY = re.compile(r"skipif\(\s*not\s+[\w.]*cuda\.is_available\(\)")


def cuda_test_files(tests: Path = REPO / "tests") -> list[Path]:
    """The test files with CUDA-only tests: a ``skipif(not torch.cuda.is_available(), ...)``
    marker on a test or on the module."""
    return [p for p in sorted(tests.glob("test_*.py")) if _CUDA_ONLY.search(p.read_text())]


def pytest_cmd(path: Path, slow: bool) -> list[str]:
    marks = ["-m", "slow or not slow"] if slow else []
    return [sys.executable, "-m", "pytest", "-q", "-rs", *marks, str(path.relative_to(REPO))]


def grid_cmd(jsonl: Path) -> list[str]:
    return [sys.executable, "benchmarks/gpu_acceptance.py", "--grid-worker", str(jsonl)]


def plan_cmd(tokens: str, gpu_memory: str, out: Path) -> list[str]:
    seq = parse_tokens(tokens) * WORLD
    return [sys.executable, "-m", "arctic.plan", "--model", MODEL, "--layers", str(LAYERS),
            "--gpus", str(WORLD), "--seq-len", str(seq), "--stack", "ours",
            "--gpu-memory", gpu_memory, "--json", str(out)]


def scale_cmd(tokens: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "benchmarks/scale_gpu.py", "--model", MODEL, "--layers", str(LAYERS),
            "--world", str(WORLD), "--tokens-per-rank", tokens, "--stack", "ours", *extra,
            "--out", str(out)]


HYBRID_SHAPE = dict(seq=32768, hidden=4096, v_heads=32, k_heads=16, head_dim=128, documents=3)
"""The hybrid run: one gated delta net layer of Qwen3.5-9B's shapes at 32K tokens, in three
packed documents (each runs alone in the reference)."""
HYBRID_RANKS = 2
"""Ranks of the hybrid run: two, on one GPU where that is all there is (over gloo, the
exchanges through host memory), so that fla's context parallelism passes a state."""
HYBRID_TOL = 2e-2
"""bf16: the SP layer's output and input gradient against the unmodified layer's, relative
to the largest value."""


def hybrid_cmd(out: Path) -> list[str]:
    shape = [a for k, v in HYBRID_SHAPE.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(HYBRID_RANKS), "benchmarks/hybrid_layer.py", *shape, "--iters", "3",
            "--out", str(out)]


def hybrid_rows(ctx: Context) -> list[Row]:
    """hybrid_layer.py on the GPU, two ranks: the all-to-all path and state passing (fla's own
    context parallelism where fla's kernel is resolved) against the unmodified layer, time
    and peak memory; fails when the values differ, when flash-linear-attention is importable
    but the torch fallback ran, or when fla's CP did not run for ``state``."""
    out, name = ctx.tmp / "hybrid_layer.json", "hybrid_layer.py (gated delta net), 32K, 2 ranks"
    ran = ctx.runner.run(hybrid_cmd(out), CAP_S["hybrid"])
    early = ran.early_row("hybrid", name)
    if early or ran.rc != 0 or not out.exists():
        return [early or ran.failed_row("hybrid", name, f"rc {ran.rc}")]
    r = json.loads(out.read_text())
    diffs = {f"{mode} {what}": d for mode, pair in r["max_rel_diff"].items()
             for what, d in pair.items()}
    problems = [f"{k} max rel diff {d:.2e} > {HYBRID_TOL}" for k, d in diffs.items()
                if d > HYBRID_TOL]
    if r["kernels"]["fla_importable"] and not r["kernels"]["fla"]:
        problems.append("flash-linear-attention is importable, but the torch fallback ran")
    if r["kernels"]["fla_importable"] and not r["kernels"]["fla_cp"]:
        problems.append("flash-linear-attention is importable, but its CP did not run")
    median, peak = r["median_s"], r["peak_bytes"]
    return [Row(group="hybrid", name=name, status="failed" if problems else "passed",
                reason="; ".join(problems), seconds=ran.seconds, command=ran.command,
                figures={"kernels": ", ".join(f"{k}={v}" for k, v in r["kernels"].items()),
                         "ranks share a GPU": r.get("ranks_share_a_gpu"),
                         **{f"{m} s": round(median[m], 3) for m in median},
                         **{f"{m} GiB": round(peak[m] / GiB, 2) for m in peak},
                         "state / all_to_all time": round(median["state"] /
                                                          median["all_to_all"], 3),
                         "max rel diff": f"{max(diffs.values()):.2e}"})]


def calibrate_cmd(out: Path) -> list[str]:
    """The planner's rates, measured on this GPU (one rank: no collective)."""
    return [sys.executable, "-m", "arctic.plan", "--calibrate", str(out),
            "--calibrate-world", "1"]


def calibrate_rows(ctx: Context) -> list[Row]:
    """``python -m arctic.plan --calibrate`` on the GPU: the rates its speed model would use
    in place of the h100/h200 defaults (matrix products, the attention kernel the runtime
    picks, memory, host copies, the cost of one op), all in the report's row."""
    out, name = ctx.tmp / "rates.json", "planner rates (--calibrate, one GPU)"
    ran = ctx.runner.run(calibrate_cmd(out), CAP_S["calibrate"])
    early = ran.early_row("step", name)
    if early or ran.rc != 0 or not out.exists():
        return [early or ran.failed_row("step", name, f"rc {ran.rc}")]
    r = json.loads(out.read_text())
    return [Row(group="step", name=name, status="passed", seconds=ran.seconds,
                command=ran.command,
                figures={"GEMM TFLOP/s": round(r["gemm_flops"] / 1e12, 1),
                         "attention fwd TFLOP/s": round(r["attention_fwd_flops"] / 1e12, 1),
                         "attention bwd TFLOP/s": round(r["attention_bwd_flops"] / 1e12, 1),
                         "memory GB/s": round(r["memory_bytes"] / 1e9),
                         "host copy GB/s": round(r["host_copy_bytes"] / 1e9, 1),
                         "us per op": round(r["op_seconds"] * 1e6, 1),
                         "backend": r["measured"]["attention_backend"],
                         "rates": json.dumps(r)})]


def offload_disk_cmd(out: Path) -> list[str]:
    return [sys.executable, "benchmarks/offload_disk.py", "--device", "cuda", "--io", "threads",
            "--out", str(out)]


# --- steps ------------------------------------------------------------------------------------

def pytest_file_rows(ctx: Context, path: Path) -> list[Row]:
    name = str(path.relative_to(REPO))
    ran = ctx.runner.run(pytest_cmd(path, ctx.args.slow), CAP_S["test_file"])
    return [ran.early_row("tests", name) or pytest_row(name, ran)]


def grid_backends() -> list[str]:
    """The CUDA backends: all but the CPU kernel and the float64 reference."""
    return [b for b in BACKENDS if b not in ("math", "cpu_flash")]


def grid_cases() -> list[dict]:
    """Backend x dtype x head dim, each over length x causal, a window with sinks, softcap, and
    a symmetric (non-causal) window."""
    cases = []
    for backend in grid_backends():
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                base = dict(backend=backend, dtype=dtype, head_dim=head_dim)
                cases += [dict(base, seq_len=n, causal=c, window=None, sinks=False)
                          for n in LENGTHS for c in (True, False)]
                cases.append(dict(base, **WINDOW_CASE))
                cases += [dict(base, **c) for c in SOFTCAP_CASES]
                cases.append(dict(base, **SYMMETRIC_CASE))
    return cases


def grid_case(case: dict, device: torch.device, compare: Callable[..., dict]) -> dict:
    """One case's outcome: skipped where the backend cannot run it (``check_supported``, or
    a ``ValueError`` from ``compare``), failed on a mismatch or any other error."""
    dtype = DTYPES[case["dtype"]]
    try:
        check_supported(case["backend"], device, dtype, case["head_dim"])
        result = compare(case["backend"], device, dtype, case["head_dim"],
                         seq_len=case["seq_len"], causal=case["causal"],
                         window=case["window"], sinks=case["sinks"],
                         softcap=case.get("softcap", 0.0), **GRID_SHAPE)
    except ValueError as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:  # a crashing kernel is a result too; the other cases go on
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    return {"status": "passed" if result["ok"] else "failed", "errors": result["errors"],
            "tolerance": result["tolerance"], "seconds": result["seconds"]}


def run_grid_worker(path: Path) -> None:
    """``--grid-worker``: every grid case on this GPU, one JSON line as each ends, so that a
    timeout keeps the cases before it."""
    from ulysses.self_check import compare_with_reference

    device = torch.device("cuda", 0)
    with path.open("a") as f:
        for case in grid_cases():
            f.write(json.dumps({**case, **grid_case(case, device, compare_with_reference)}) + "\n")
            f.flush()


def _case_text(c: dict) -> str:
    window = f", window {c['window']}" if c["window"] else ""
    sinks = ", sinks" if c["sinks"] else ""
    cap = f", softcap {c['softcap']:g}" if c.get("softcap") else ""
    return f"S={c['seq_len']} {'causal' if c['causal'] else 'full'}{window}{sinks}{cap}"


def grid_rows(results: list[dict], ran: Ran) -> list[Row]:
    """One row per (backend, dtype, head dim) from the worker's lines, in grid order."""
    keyed: dict[tuple, list[dict]] = {}
    for c in grid_cases():
        keyed.setdefault((c["backend"], c["dtype"], c["head_dim"]), [])
    for r in results:
        keyed[(r["backend"], r["dtype"], r["head_dim"])].append(r)
    per_key = len(grid_cases()) // len(keyed)
    return [_grid_row(key, got, per_key, ran) for key, got in keyed.items()]


def _grid_row(key: tuple, got: list[dict], per_key: int, ran: Ran) -> Row:
    """Failed if a case failed; cases the worker did not reach take its fate (timed out, not
    run, or crashed); skipped when every case was."""
    backend, dtype, head_dim = key
    row = Row(group="backends", name=f"{backend} {dtype} d{head_dim}", status="passed",
              seconds=round(sum(r.get("seconds", 0.0) for r in got), 3))
    skips = sorted({r["reason"] for r in got if r["status"] == "skipped"})
    failures: dict[str, list[str]] = {}  # one message, the cases that gave it
    for r in got:
        if r["status"] == "failed":
            why = r.get("reason") or ", ".join(f"{k} {v:.2e} > {r['tolerance']:g}"
                                               for k, v in r["errors"].items()
                                               if not v <= r["tolerance"])
            failures.setdefault(why, []).append(_case_text(r))
    if len(got) < per_key:
        row.status = "timed out" if ran.timed_out else "not run" if ran.not_run else "failed"
        worker = f"killed at {ran.limit_s:.0f} s" if ran.timed_out else f"worker rc {ran.rc}"
        row.reason = ran.not_run or f"{per_key - len(got)} of {per_key} cases not reached " \
                                    f"({worker})"
        row.tail = ran.output[-2000:]
    elif failures:
        row.status = "failed"
        row.reason = "; ".join(f"{why} ({', '.join(cases)})" for why, cases in failures.items())
    elif got and all(r["status"] == "skipped" for r in got):
        row.status, row.reason = "skipped", "; ".join(skips)
        return row
    row.figures = {"cases": f"{sum(r['status'] == 'passed' for r in got)}/{per_key} passed"}
    measured = [r for r in got if "errors" in r]
    if measured:
        worst = {k: max(r["errors"][k] for r in measured) for k in measured[0]["errors"]}
        row.figures["worst rel. error"] = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
        row.figures["tolerance"] = measured[0]["tolerance"]
    if skips:
        row.figures["skipped"] = "; ".join(skips)
    return row


def backend_rows(ctx: Context) -> list[Row]:
    jsonl = ctx.tmp / "grid.jsonl"
    ran = ctx.runner.run(grid_cmd(jsonl), CAP_S["grid"])
    results = [json.loads(line) for line in jsonl.read_text().splitlines()] \
        if jsonl.exists() else []
    rows = grid_rows(results, ran)
    rows[0].command = ran.command
    return rows


def caps(peak: int, gpu_memory: int, device_budget: int) -> tuple[float, float]:
    """(GiB, GiB): the smallest cap, to 0.25 GiB, at which the planner says ``peak`` fits (its
    budget is the GPU less the reserve over the allocator headroom, so the cap scales by
    ``gpu_memory / device_budget``), and 0.9 x the peak, to 0.25 GiB below."""
    fit = math.ceil(peak * gpu_memory / device_budget / GiB * 4) / 4
    return fit, math.floor(0.9 * peak / GiB * 4) / 4


def _plan(ctx: Context, tokens: str, gpu_memory: str) -> tuple[Ran, dict | None]:
    """The planner's estimate at ``gpu_memory`` (after the first, its traces come from its
    cache)."""
    out = ctx.tmp / f"plan_{gpu_memory}.json"
    ran = ctx.runner.run(plan_cmd(tokens, gpu_memory, out), CAP_S["plan"])
    if ran.rc != 0 or not out.exists():
        return ran, None
    return ran, json.loads(out.read_text())["estimate"]


def capped_row(ctx: Context, tokens: str, cap: float) -> Row:
    """scale_gpu.py under ``cap`` GiB: passes when it runs where the planner says it fits and
    runs out of memory where the planner says it does not."""
    name = f"cap {cap:g} GiB, {tokens}/rank"
    planned, est = _plan(ctx, tokens, f"{cap}GiB")
    if est is None:
        return planned.early_row("fits", name) or planned.failed_row(
            "fits", name, f"planner rc {planned.rc}")
    out = ctx.tmp / f"scale_{cap:g}.json"
    ran = ctx.runner.run(scale_cmd(tokens, out, "--cap-gib", f"{cap:g}"), CAP_S["scale"])
    early = ran.early_row("fits", name)
    if early or ran.rc != 0 or not out.exists():
        return early or ran.failed_row("fits", name, f"scale_gpu rc {ran.rc}")
    run = json.loads(out.read_text())["runs"][-1]
    fits = run["oom"] is None
    said = "fits" if est["fits"] else f"does not fit ({est['limit']})"
    figures = {"planner": said, "step": "ran" if fits else "out of memory",
               "predicted GiB": round(est["device_peak_bytes"] / GiB, 2)}
    if fits:
        figures["measured GiB"] = round(run["max_memory_allocated"] / GiB, 2)
        figures["predicted/measured"] = round(est["device_peak_bytes"] /
                                              run["max_memory_allocated"], 3)
        figures["max reserved GiB"] = round(run["max_memory_reserved"] / GiB, 2)
    ok = fits == est["fits"]
    return Row(group="fits", name=name, status="passed" if ok else "failed",
               reason="" if ok else f"the planner says it {said}, the step "
                                    f"{'ran' if fits else 'ran out of memory: ' + run['oom']}",
               seconds=planned.seconds + ran.seconds, figures=figures,
               command=ran.command, tail="" if ok else ran.output[-2000:])


def fits_rows(ctx: Context) -> list[Row]:
    tokens = ctx.args.fits_tokens
    name = f"planner, {tokens}/rank on this card"
    ran, est = _plan(ctx, tokens, str(ctx.gpu_memory))
    if est is None:
        why = "the planner did not answer"
        first = ran.early_row("fits", name) or ran.failed_row("fits", name, f"rc {ran.rc}")
        return [first] + [Row(group="fits", name=f"cap {what}", status="not run", reason=why)
                          for what in ("at the planned fit", "at 0.9 x the predicted peak")]
    fit, oom = caps(est["device_peak_bytes"], ctx.gpu_memory, est["device_budget"])
    first = Row(group="fits", name=name, status="passed", seconds=ran.seconds,
                command=ran.command,
                figures={"predicted GiB": round(est["device_peak_bytes"] / GiB, 2),
                         "budget GiB": round(est["device_budget"] / GiB, 2),
                         "fits": est["fits"], "how": est["method"]})
    return [first, capped_row(ctx, tokens, fit), capped_row(ctx, tokens, oom)]


def offload_disk_row(ctx: Context) -> Row:
    out, name = ctx.tmp / "offload_disk.json", "offload_disk.py --device cuda (disk tier)"
    ran = ctx.runner.run(offload_disk_cmd(out), CAP_S["offload_disk"])
    early = ran.early_row("disk", name)
    if early or ran.rc != 0 or not out.exists():
        return early or ran.failed_row("disk", name, f"rc {ran.rc} (a gradient that differs "
                                                     f"from host offload exits 1)")
    record = json.loads(out.read_text())
    figures = {r["variant"]: f"{r['median_s']:.3f} s ({r['vs_host']:.2f}x host), "
                             f"{r['max_allocated_mib']:.0f} MiB" for r in record["rows"]}
    disk = next(r for r in record["rows"] if r["variant"] == "disk_threads")
    figures["spilled MiB"] = disk["spilled_mib"]
    ok = record["gradients_bit_identical"] and disk["spilled_mib"] > 0
    return Row(group="disk", name=name, status="passed" if ok else "failed",
               reason="" if ok else "nothing spilled, or gradients differ from host offload",
               seconds=ran.seconds, figures=figures, command=ran.command)


def host_blocks_row(ctx: Context) -> Row:
    tokens = ctx.args.fits_tokens
    out, name = ctx.tmp / "scale_seq_chunk.json", f"host blocks + disk tier, {tokens}/rank"
    cmd = scale_cmd(tokens, out, "--seq-chunk", str(SEQ_CHUNK), "--offload-dir",
                    str(ctx.tmp / "spill"), "--host-limit-gib", str(SPILL_HOST_GIB))
    ran = ctx.runner.run(cmd, CAP_S["scale"])
    early = ran.early_row("disk", name)
    if early or ran.rc != 0 or not out.exists():
        return early or ran.failed_row("disk", name, f"scale_gpu rc {ran.rc}")
    run = json.loads(out.read_text())["runs"][-1]
    ok = run["oom"] is None and run.get("disk_peak_bytes", 0) > 0
    return Row(group="disk", name=name, status="passed" if ok else "failed",
               reason="" if ok else (run["oom"] or "nothing reached the disk tier"),
               seconds=ran.seconds, command=ran.command,
               figures={"max alloc GiB": round(run["max_memory_allocated"] / GiB, 2),
                        "host peak GiB": round(run.get("host_peak_bytes", 0) / GiB, 2),
                        "disk peak GiB": round(run.get("disk_peak_bytes", 0) / GiB, 2),
                        "step s": round(run["step_s"], 1),
                        "note": "runs only: values unchecked (fake process group)"})


def disk_rows(ctx: Context) -> list[Row]:
    return [offload_disk_row(ctx), host_blocks_row(ctx)]

