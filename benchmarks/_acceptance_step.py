"""The ``step`` group of ``gpu_acceptance.py``: the planner's pick per length, timed on the
GPU against the peers, extended to the full 32-layer model, and the verdicts.

- The planner (``python -m arctic.plan --gpus 8 --seq-len 8 x T --gpu-memory <this card>
  --rates h100|h200 --quick --json F``) picks ours at each length T per rank, for the real
  8-GPU job; ``--no-search --stack alst`` and ``--stack ulysses`` predict the peers. These
  CPU runs go one after another in a background thread (:class:`PlannerQueue`), started
  before the checks so that they overlap the GPU's work; each writes ``F.rc`` when it ends.
- ``step_gpu.py --schedule`` then runs the phases in order (the verdicts' first, since the
  budget may end the group): ALST at 128K, plain Ulysses at 16K, 8K and 4K (the attention
  kernels alone once, at 16K), ours at 128K, 16K, 8K and 4K, ALST then ours at 64K, ours with
  FlashAttention-4 at 64K and 128K, plain Ulysses at 64K and 128K. The peers come first so
  that the GPU measures them while the planner searches. Each run is one rank of 8 on
  torch's fake process group (no communication), timed at 1 and 2 layers (3 steps each after
  a warm-up that counts the work), extended to 32 layers. Ours waits for its plan; if the
  planner failed it runs as the named ``ours`` stack, and its planner row says why.
- The plain Ulysses peer is our ``ulysses`` stack (SP attention alone, the full logits), the
  equivalent of DeepSpeed's ``DistributedAttention`` with HF's loss: step_gpu's build (our
  FSDP2 and data path) has no place for DeepSpeed's module-global SP groups, and
  ``benchmarks/attention.py`` shows the two attentions at the same speed. ALST is the
  ``alst`` stack, built from our code, as in ``benchmarks/memory.py``'s tables.

Verdicts (rows of their own): ours' 32-layer MFU at 128K is at least :data:`MFU_TARGET`;
ours at least as fast as ALST at 64K and 128K and as plain Ulysses at 4K, 8K and 16K, in
tokens per second per rank of the 32-layer step, within :data:`NOISE`. A peer that runs out
of memory loses; ours running out of memory fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from _acceptance_runner import Context, Row, kill_group
from _step_specs import Phase, RunSpec, write_schedule
from arctic.plan.units import parse_tokens

GiB = 1 << 30
MODEL, WORLD, FULL_LAYERS = "llama3-8b", 8, 32
DEPTHS = (1, 2)
"""The depths each run is timed at: the cheapest pair (4 x (2 fixed + 3 layers) steps per run)."""
LONG, SHORT = ("128K", "64K"), ("16K", "8K", "4K")
"""Tokens per rank: ours vs ALST (and plain Ulysses, which may not fit), ours vs plain Ulysses."""
MFU_TARGET = 0.40
NOISE = 0.02
"""Ours passes "at least as fast" at a throughput ratio of ``1 - NOISE`` or more: the spread of
medians of 3 steps on one GPU."""
PLAN_CAP_S = 300
"""Each planner run's own limit."""
PLAN_FREE_CORES = 4
"""Cores the planner's tracing workers leave to step_gpu.py and the rest
(``ARCTIC_PLAN_WORKERS`` = the machine's cores less these, at least 2)."""
PEERS = {"128K": "alst", "64K": "alst", "16K": "ulysses", "8K": "ulysses", "4K": "ulysses"}


def rates_of(device_name: str) -> str:
    """The planner's ``--rates`` for this card."""
    return "h200" if "h200" in device_name.lower() else "h100"


def plan_workers(cores: int | None) -> int:
    """The planner's tracing processes: the cores less :data:`PLAN_FREE_CORES`, at least 2."""
    return max(2, (cores or 1) - PLAN_FREE_CORES)


def plan_path(tmp: Path, stack: str, tokens: str) -> Path:
    return tmp / f"plan_{stack}_{tokens}.json"


def planner_cmd(tokens: str, stack: str, gpu_memory: str, rates: str, out: Path) -> list[str]:
    """The planner at ``tokens`` per rank of the 8-GPU job: its search for ours, the named
    stack otherwise."""
    fixed = [] if stack == "ours" else ["--no-search", "--stack", stack]
    return [sys.executable, "-m", "arctic.plan", "--model", MODEL, "--gpus", str(WORLD),
            "--seq-len", str(parse_tokens(tokens) * WORLD), "--gpu-memory", gpu_memory,
            "--rates", rates, "--quick", *fixed, "--json", str(out)]


def plan_jobs(tmp: Path, gpu_memory: str, rates: str) -> list[tuple[list[str], Path]]:
    """(command, JSON) of every planner run: ours at each length in the schedule's order (its
    phases wait for them), then the peers' predictions (figures only)."""
    order = [("ours", t) for t in ("128K", *SHORT, "64K")]
    order += [("alst", "128K"), *(("ulysses", t) for t in SHORT), ("alst", "64K"),
              ("ulysses", "64K"), ("ulysses", "128K")]
    return [(planner_cmd(t, s, gpu_memory, rates, plan_path(tmp, s, t)), plan_path(tmp, s, t))
            for s, t in order]


def schedule(tmp: Path) -> list[Phase]:
    """The phases step_gpu.py runs, the verdicts' first: each peer before ours at its
    lengths, so that the GPU measures the peers while the planner searches (its first search,
    on a cold cache, takes minutes; the next ones reuse its traces). A phase's two depths
    alternate; ours and its peer run in one process, one after the other."""
    def ours(tokens: str, backend: str = "auto") -> RunSpec:
        path = plan_path(tmp, "ours", tokens)
        return RunSpec(label="ours", plan=str(path), plan_done=f"{path}.rc", fallback="ours",
                       backend=backend)

    def peer(tokens: str, stack: str) -> RunSpec:
        return RunSpec(label=stack, stack=stack)

    phases = [Phase(tokens="128K", runs=[peer("128K", "alst")])]
    phases += [Phase(tokens=t, runs=[peer(t, "ulysses")], kernels=t == SHORT[0]) for t in SHORT]
    phases.append(Phase(tokens="128K", runs=[ours("128K")]))
    phases += [Phase(tokens=t, runs=[ours(t)]) for t in SHORT]
    phases += [Phase(tokens="64K", runs=[peer("64K", "alst")]), Phase(tokens="64K",
                                                                      runs=[ours("64K")])]
    phases += [Phase(tokens=t, runs=[ours(t, "fa4")]) for t in ("64K", "128K")]
    phases += [Phase(tokens=t, runs=[peer(t, "ulysses")]) for t in ("64K", "128K")]
    return phases


def step_cmd(schedule_path: Path, out: Path, iters: int, budget_s: float) -> list[str]:
    return [sys.executable, "benchmarks/step_gpu.py", "--model", MODEL, "--world", str(WORLD),
            "--depths", *map(str, DEPTHS), "--full-layers", str(FULL_LAYERS),
            "--schedule", str(schedule_path), "--iters", str(iters),
            "--budget-s", f"{budget_s:.0f}", "--out", str(out)]


class PlannerQueue:
    """Runs the planner commands one after another in a thread, each under ``cap_s``; after
    each writes ``<json>.rc`` (its exit code, or "timeout"), its output to ``<json>.log``."""

    def __init__(self, jobs: list[tuple[list[str], Path]], env: dict, cwd: Path,
                 cap_s: float = PLAN_CAP_S) -> None:
        self.jobs, self.env, self.cwd, self.cap_s = jobs, env, cwd, cap_s
        self.seconds: dict[Path, float] = {}
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PlannerQueue:
        self._thread.start()
        return self

    def _run(self) -> None:
        for cmd, out in self.jobs:
            if self._stop.is_set():
                return
            start = time.monotonic()
            with open(f"{out}.log", "wb") as log:
                self._proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc = str(self._proc.wait(timeout=self.cap_s))
                except subprocess.TimeoutExpired:
                    kill_group(self._proc)
                    rc = "timeout"
            self.seconds[out] = round(time.monotonic() - start, 1)
            Path(f"{out}.rc").write_text(rc)

    def stop(self) -> None:
        """Stops the queue; kills the planner that runs (its JSON then has no ``.rc``)."""
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            kill_group(self._proc)
        self._thread.join(timeout=30)


# --- rows -------------------------------------------------------------------------------------

def _plan_outcome(path: Path) -> tuple[dict | None, str]:
    """(the planner's estimate, "") or (None, why not)."""
    rc_file = Path(f"{path}.rc")
    if not rc_file.exists():
        return None, "the planner had not ended when the group did"
    rc = rc_file.read_text().strip()
    if rc != "0":
        log = Path(f"{path}.log")
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return None, f"planner rc {rc}" + (f": {tail[0][:200]}" if tail else "")
    try:
        estimate = json.loads(path.read_text())["estimate"]
    except (OSError, ValueError, KeyError) as e:
        return None, f"the planner's JSON: {e!r}"
    if "predicted" not in estimate:
        return None, "the planner's JSON has no estimate.predicted"
    return estimate, ""


_SHOWN = ("sequence_parallel_size", "ring_degree", "head_chunk_size", "seq_chunk",
          "fuse_projections", "tiled_mlp", "tiled_layer", "loss_tiles",
          "activation_checkpointing", "offload_activations", "recompute_attention",
          "attention_backend")


def _predicted(estimate: dict) -> str:
    p = estimate["predicted"]
    collective = (p.get("by_class_s") or {}).get("collective", 0.0)
    fits = "" if estimate.get("fits", True) else ", does not fit"
    return f"{p['step_s']:.2f} s ({p['step_s'] - collective:.2f} s without communication{fits})"


def planner_rows(tmp: Path, seconds: dict) -> list[Row]:
    """One row per length: ours' pick and predicted step (failed when the planner gave none),
    the peer's prediction beside it."""
    rows = []
    for tokens in (*LONG[:1], *SHORT, *LONG[1:]):
        ours = plan_path(tmp, "ours", tokens)
        estimate, why = _plan_outcome(ours)
        row = Row(group="step", name=f"planner: ours at {tokens}/rank on 8 GPUs",
                  status="passed" if estimate else "failed", reason=why,
                  seconds=seconds.get(ours, 0.0))
        if estimate:
            sp = estimate.get("sp", {})
            row.figures["settings"] = ", ".join(f"{k}={sp[k]}" for k in _SHOWN if k in sp)
            row.figures["predicted ours"] = _predicted(estimate)
        peer = PEERS[tokens]
        peer_estimate, peer_why = _plan_outcome(plan_path(tmp, peer, tokens))
        row.figures[f"predicted {peer}"] = _predicted(peer_estimate) if peer_estimate else \
            peer_why
        rows.append(row)
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _missing_reason(record: dict, tokens: int, label: str, backend: str = "auto") -> tuple:
    """(status, reason) of a (label, kernel) without full-depth figures: its runs' fates."""
    runs = [r for r in record["runs"] if r["label"] == label and r["backend"] == backend
            and r["seq_len"] == tokens * WORLD]
    if not runs:
        return "not run", "not reached (budget or an earlier failure)"
    bad = [r for r in runs if r["status"] != "timed"]
    if not bad:
        return "failed", "timed, but no full-depth figures"
    r = bad[0]
    status = {"oom": "failed", "skipped": "skipped", "not run": "not run"}.get(r["status"],
                                                                             "failed")
    what = "out of memory" if r["status"] == "oom" else r["status"]
    return status, f"{what} at {r['layers']} layer(s): {r.get('reason', '')}"[:300]


def measurement_rows(record: dict) -> list[Row]:
    """One row per (label, kernel, length) timed at both depths, extended to 32 layers."""
    rows = []
    for d in record.get("depth", []):
        tokens = f"{d['tokens_per_rank'] // 1024}K"
        backend = "" if d["backend"] == "auto" else f" {d['backend']}"
        figures = {"per layer s": round(d["per_layer_s"], 3), "fixed s": round(d["fixed_s"], 3),
                   f"{d['full_layers']}-layer step s": round(d["step_s"], 2),
                   "tok/s/rank": round(d["tokens_per_s_per_rank"]),
                   "MFU": _pct(d.get("mfu")), "MFU executed": _pct(d.get("mfu_executed")),
                   "settings": d["source"]}
        if d.get("plan_error"):
            figures["settings"] += f" ({d['plan_error']})"
        if d.get("predicted"):
            figures["predicted s"] = round(d["predicted"]["step_s"], 2)
            figures["predicted less collective s"] = round(d["predicted"]["less_collective_s"],
                                                           2)
        if "max_memory_allocated" in d:
            figures[f"max alloc GiB at {d['layers'][1]} layers"] = round(
                d["max_memory_allocated"] / GiB, 2)
        rows.append(Row(group="step", name=f"{d['label']}{backend} ({d['kernel']}), {tokens}/rank, "
                                           f"{d['full_layers']} layers",
                        status="passed", seconds=round(d["step_s"], 2), figures=figures))
    have = {(d["label"], d["backend"], d["seq_len"]) for d in record.get("depth", [])}
    missing = dict.fromkeys((r["label"], r["backend"], r["seq_len"])
                            for r in record.get("runs", []))
    for label, backend, seq in (k for k in missing if k not in have):  # why not
        status, why = _missing_reason(record, seq // WORLD, label, backend)
        peer_oom = label != "ours" and why.startswith("out of memory")
        rows.append(Row(group="step", name=f"{label}{'' if backend == 'auto' else ' ' + backend}"
                                           f", {seq // WORLD // 1024}K/rank",
                        status="skipped" if peer_oom else status, reason=why))
    return rows


def _depth(record: dict, label: str, tokens: str) -> dict | None:
    seq = parse_tokens(tokens) * WORLD
    return next((d for d in record.get("depth", []) if d["label"] == label
                 and d["backend"] == "auto" and d["seq_len"] == seq), None)


def mfu_verdict(record: dict, tokens: str = "128K", target: float = MFU_TARGET) -> Row:
    name = f"verdict: ours' MFU at {tokens}/rank, {FULL_LAYERS} layers >= {target:.0%}"
    ours = _depth(record, "ours", tokens)
    if ours is None or ours.get("mfu") is None:
        status, why = _missing_reason(record, parse_tokens(tokens), "ours")
        return Row(group="step", name=name, status=status if ours is None else "failed",
                   reason=why if ours is None else "no MFU (no peak, or a step <= 0 s)")
    ok = ours["mfu"] >= target
    return Row(group="step", name=name, status="passed" if ok else "failed",
               reason="" if ok else f"MFU {_pct(ours['mfu'])} < {target:.0%}",
               figures={"MFU": _pct(ours["mfu"]), "MFU executed": _pct(ours.get("mfu_executed")),
                        f"{FULL_LAYERS}-layer step s": round(ours["step_s"], 2),
                        "kernel": ours["kernel"], "settings": ours["source"]})


def speed_verdict(record: dict, tokens: str, peer: str, noise: float = NOISE) -> Row:
    """Ours' 32-layer throughput at least the peer's (within ``noise``); a peer out of memory
    loses, ours out of memory fails."""
    name = f"verdict: ours at least as fast as {peer} at {tokens}/rank"
    ours, theirs = _depth(record, "ours", tokens), _depth(record, peer, tokens)
    if ours is None or ours["step_s"] <= 0:
        status, why = _missing_reason(record, parse_tokens(tokens), "ours")
        return Row(group="step", name=name, status=status if ours is None else "failed",
                   reason=why if ours is None else "ours' 32-layer step <= 0 s: timing noise")
    figures = {"ours tok/s/rank": round(ours["tokens_per_s_per_rank"]),
               "ours step s": round(ours["step_s"], 2)}
    if theirs is None or theirs["step_s"] <= 0:
        status, why = _missing_reason(record, parse_tokens(tokens), peer)
        if "out of memory" in why:
            return Row(group="step", name=name, status="passed", figures=figures,
                       reason=f"{peer} {why}")
        return Row(group="step", name=name, status="not run" if status != "failed" else status,
                   reason=f"{peer}: {why}", figures=figures)
    ratio = ours["tokens_per_s_per_rank"] / theirs["tokens_per_s_per_rank"]
    figures.update({f"{peer} tok/s/rank": round(theirs["tokens_per_s_per_rank"]),
                    f"{peer} step s": round(theirs["step_s"], 2), "ours / peer": round(ratio, 3),
                    "allowed": f">= {1 - noise:.2f}"})
    ok = ratio >= 1 - noise
    return Row(group="step", name=name, status="passed" if ok else "failed", figures=figures,
               reason="" if ok else f"ours is {1 / ratio:.3f}x slower than {peer}")


def verdict_rows(record: dict) -> list[Row]:
    return ([mfu_verdict(record)] + [speed_verdict(record, t, "alst") for t in LONG]
            + [speed_verdict(record, t, "ulysses") for t in SHORT])


def kernel_rows(record: dict) -> list[Row]:
    rows = []
    for k in record.get("kernels", []):
        name = f"kernel {k['backend']} alone, S={k['seq_len'] // 1024}K causal fwd+bwd"
        if "skipped" in k:
            rows.append(Row(group="step", name=name, status="skipped", reason=k["skipped"]))
        else:
            rows.append(Row(group="step", name=name, status="passed",
                            seconds=round(k["seconds"], 3),
                            figures={"TFLOP/s": round(k["tflops"], 1)}))
    return rows


def step_record_rows(record: dict) -> list[Row]:
    """step_gpu.py's JSON as rows: the verdicts, each measurement, the kernels alone."""
    return verdict_rows(record) + measurement_rows(record) + kernel_rows(record)


STEP_CAP_S = 400
"""The group's own limit (planner waits included): what one 540 s call can give it and
still run the first test files."""
STEP_MARGIN_S = 30
"""step_gpu.py's budget is its limit less this (its start, its JSON)."""


def step_rows(ctx: Context) -> list[Row]:
    """Waits for the planners as it needs them (step_gpu.py does), runs the schedule, and reads
    the JSON step_gpu.py wrote after each phase, even when the run was cut short."""
    path, out = ctx.tmp / "step_schedule.json", ctx.tmp / "step.json"
    write_schedule(schedule(ctx.tmp), path)
    limit = ctx.runner.budget.limit(STEP_CAP_S)
    ran = ctx.runner.run(step_cmd(path, out, ctx.args.step_iters, limit - STEP_MARGIN_S),
                         STEP_CAP_S)
    planners = ctx.planners
    rows = planner_rows(ctx.tmp, planners.seconds if planners else {})
    early = ran.early_row("step", "step_gpu.py --schedule")
    if not out.exists():
        return rows + [early or ran.failed_row("step", "step_gpu.py --schedule",
                                               f"rc {ran.rc}, no JSON")]
    record_rows = step_record_rows(json.loads(out.read_text()))
    if early or ran.rc != 0:
        record_rows.append(early or ran.failed_row("step", "step_gpu.py --schedule",
                                                   f"rc {ran.rc}"))
    record_rows[0].command = ran.command
    return rows + record_rows
