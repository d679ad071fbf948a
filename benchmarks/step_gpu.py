"""Step time and MFU of a training step, per stack and attention kernel, at one or two depths.

The same build and step as ``benchmarks/scale_gpu.py`` (``arctic.plan.build`` and
``arctic.plan.train_step``: the HF model from its config, the SP recipe, FSDP2 with bf16
compute, AdamW). Two ways to run it:

- one GPU, alone: one rank of a W-rank job, torch's fake process group standing in for the
  other W-1 ranks (collectives return at once and move nothing), so the step runs rank 0's
  real kernels on rank 0's real shapes; values are garbage, time and memory are real, and
  the step has no communication;
- under ``torchrun``: every rank of a real job (gloo on CPU, NCCL on GPUs); each step's time
  is the slowest rank's.

What runs: a run's settings are a named stack (``--stack``), SequenceParallelConfig fields
(``--fields [LABEL=]JSON``: an inline object, a file of fields, or the planner's JSON, whose
``estimate.sp`` it takes and whose ``estimate.predicted`` step it reports), or a schedule
(``--schedule FILE``, as ``gpu_acceptance.py`` writes it: phases of one length each, in
order, each run's settings named or the planner's pick; ``benchmarks/_step_specs.py``).
Every run of a phase (one length) is built at each depth, runs one warm-up step, which also
counts its work (:func:`arctic.plan.work.count_work`: attention kernels by their calls,
matrix products in and out of place, memory traffic, host copies, collectives, ops), then
``--iters`` rounds time one step of each run in turn (alternating, so drift hits all alike);
medians. A run that runs out of memory, or whose named kernel refuses or fails its
self-check, is recorded as such and the others go on. ``--budget-s`` leaves out (as "not
run") what would not end in time; the JSON is written after every phase.

Reported per run: step time, tokens/s per rank, peak memory (CUDA allocator, less what the
other runs keep between their steps), the work by class, and two MFUs over ``--peak-tflops``
(989 bf16 dense on an H100/H200 by default on CUDA; on CPU only when given): ``mfu``, model
FLOPs (:func:`arctic.plan.work.model_flops`: 6 P s + 3 A per rank, recompute not counted),
and ``mfu_executed``, the FLOPs the step ran (``Work.flops``). With ``--depths A B``, per
(run, kernel): the per-layer and fixed (head, loss, optimizer) time, the step of the model at
its full depth (``--full-layers``, default the model's own: 32 for Llama-3-8B) and its MFUs,
next to the planner's predicted step when the settings came from it (and that step less its
communication, which one rank on the fake process group does not have).

``--kernels`` also times each attention kernel alone (causal forward + backward over the
full sequence for this rank's heads, FLOPs counted as 3.5 forwards) and prints its TFLOP/s.

    python benchmarks/step_gpu.py --model llama3-8b --depths 1 2 --world 8 \\
        --tokens-per-rank 64K 128K --stack alst --fields ours=plan_128K.json --iters 3
    torchrun --nproc_per_node 2 benchmarks/step_gpu.py --model tiny-llama --layers 2 \\
        --tokens-per-rank 8K --stack ours --stack ours-keep-attention --iters 5

``--flops-only`` times nothing: it traces each stack on fake tensors (any machine, seconds) and
counts the executed FLOPs, with the step time and MFU they imply at given kernel speeds
(``--attention-tflops``, ``--matmul-tflops``).

Writes ``results/step_<device>_w<W>_l<layers>.json`` (``step_flops_...`` for
``--flops-only``; ``--out`` to choose).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ulysses.kernels as kernels  # noqa: E402
from _step_extras import H100_BF16_TFLOPS, flops_only, kernel_tflops, profile_step  # noqa
from _step_specs import (EXECUTED, Deadline, Phase, RunSpec, depth_entries,  # noqa: E402
                         fields_spec, read_schedule, resolve)
from arctic.hf.anatomy import text_config_of  # noqa: E402
from arctic.memory.allocator import use_expandable_segments  # noqa: E402
from arctic.plan import (STACKS, build, fake_world, init_optimizer_state, make_batch,  # noqa
                         model_config, parse_tokens, stack_config, train_step)
from arctic.plan.work import count_work, model_flops  # noqa: E402
from ulysses import BACKENDS  # noqa: E402

GiB = 1 << 30
MIN_BUILD_S = 20.0
"""The least ``--budget-s`` time worth building and warming a run with."""
WARM_TO_STEADY = 0.9
"""A steady step over the warm-up's (which counts its work and pays first-use costs): how
``--budget-s`` estimates the timed rounds from the warm-ups."""


def _init(world: int) -> tuple[torch.device, int, bool]:
    """(device, world size, real job?): torchrun's process group, or a fake one of ``world``."""
    if "WORLD_SIZE" in os.environ:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return device, dist.get_world_size(), True
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fake_world(world)
    return device, world, False


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, real: bool) -> float:
    if not real:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Run:
    """One (settings, kernel, depth), built, warmed (its work counted), timed in turn."""

    def __init__(self, spec: RunSpec, fields: dict, config, world, seq_len, device, dtype):
        self.label, self.backend, self.dtype = spec.label, spec.backend, dtype
        sp = stack_config(fields, world=world)
        if spec.backend != "auto":  # else the settings' own kernel, or the device's fastest
            sp = replace(sp, attention_backend=spec.backend)
        self.sp, self.seq_len = sp, seq_len
        self.tokens = seq_len // sp.sequence_parallel_size
        text = text_config_of(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # before the build: a named kernel that cannot run here is refused at once
        self.resolved = kernels.select_backend(device, dtype, head_dim, sp.attention_backend)
        mesh = sp.dims(world).build_mesh(device.type)
        cuda = device.type == "cuda"
        before = torch.cuda.memory_allocated(device) if cuda else 0
        self.model, self.optimizer = build(config, sp, mesh, device=device,
                                           host_memory_limit=96 * GiB, compute_dtype=dtype)
        init_optimizer_state(self.model, self.optimizer)
        self.batch = make_batch(seq_len, config.vocab_size, mesh, device)
        # What this run keeps between steps (parameters, AdamW state, batch): the other runs'
        # are alive too while it steps, and are taken out of its peak.
        self.resident = (torch.cuda.memory_allocated(device) - before) if cuda else 0
        self.times: list[float] = []
        self.peak = 0
        self.work: dict | None = None
        self.warm_s = 0.0

    def warm(self, device, count: bool) -> None:
        """The warm-up step (allocator, pools, kernel plans); it counts the step's work."""
        start = time.perf_counter()
        if count:
            with count_work() as work:
                train_step(self.model, self.optimizer, self.batch)
            self.work = work.as_dict()
        else:
            train_step(self.model, self.optimizer, self.batch)
        _sync(device)
        self.warm_s = time.perf_counter() - start

    def step(self, device, real) -> float:
        others = 0
        if device.type == "cuda":
            others = torch.cuda.memory_allocated(device) - self.resident
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        train_step(self.model, self.optimizer, self.batch)
        _sync(device)
        elapsed = _slowest(time.perf_counter() - start, real)
        if device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(device) - others)
        return elapsed

    def close(self, device) -> None:
        del self.model, self.optimizer, self.batch
        _free(device)


def _fail(entry: dict, e: BaseException, explicit_kernel: bool) -> None:
    """Out of memory, a named kernel that refuses or fails its self-check (skipped), or a
    failure, recorded on the run's entry."""
    if isinstance(e, torch.OutOfMemoryError):
        entry.update(status="oom", reason=str(e).split("\n")[0][:300])
    elif isinstance(e, ValueError) and explicit_kernel:
        entry.update(status="skipped", reason=str(e)[:500])
    else:
        entry.update(status="failed", reason=f"{type(e).__name__}: {e}"[:500],
                     traceback=traceback.format_exc()[-2000:])


def _timed_entry(entry: dict, run: _Run, model_f: float, peak_tflops, device) -> None:
    step = statistics.median(run.times)
    entry.update(status="timed", step_s=step, step_s_all=run.times,
                 tokens_per_s_per_rank=run.tokens / step, model_flops=model_f)
    if device.type == "cuda":
        entry["max_memory_allocated"] = run.peak
    if run.work is not None:
        entry["work"] = run.work
        entry["executed_flops"] = sum(run.work[k] for k in EXECUTED)
    if peak_tflops:
        entry["mfu"] = model_f / step / (peak_tflops * 1e12)
        if "executed_flops" in entry:
            entry["mfu_executed"] = entry["executed_flops"] / step / (peak_tflops * 1e12)


def run_phase(phase: Phase, args, device, world: int, real: bool, dtype, deadline: Deadline,
              peak_tflops) -> tuple[list[dict], list[dict]]:
    """Every run of ``phase`` at every depth: built, warmed, then timed in turn. Returns the
    runs' entries and, with two depths, the full-depth figures (:func:`depth_entries`)."""
    seq = parse_tokens(phase.tokens) * world
    depths = args.depths or [args.layers]
    entries, live = [], []
    for spec in phase.runs:
        base = {"label": spec.label, "stack": spec.stack, "backend": spec.backend,
                "kernel": None, "seq_len": seq, "tokens_per_rank": seq // world,
                "source": None, "fields": None, "predicted": None, "plan_error": ""}
        try:
            settings = resolve(spec, STACKS, deadline=deadline.at)
            base.update(source=settings.source, fields=settings.fields,
                        predicted=settings.predicted, plan_error=settings.plan_error)
        except ValueError as e:
            entries += [dict(base, layers=d, status="failed", reason=str(e)) for d in depths]
            continue
        for depth in depths:
            entry = dict(base, layers=depth)
            entries.append(entry)
            if deadline.left() < MIN_BUILD_S:
                entry.update(status="not run", reason=f"--budget-s: {deadline.left():.0f} s "
                                                      f"left, too little to build it")
                continue
            run = None
            try:
                config = model_config(args.model, layers=depth, max_positions=seq)
                run = _Run(spec, settings.fields, config, world, seq, device, dtype)
                entry.update(kernel=run.resolved, tokens_per_rank=run.tokens)
                run.warm(device, count=not args.no_count)
                live.append((entry, run))
            except Exception as e:  # out of memory, a kernel refused: the others go on
                _fail(entry, e, spec.backend != "auto")
            if entry.get("status") is not None and run is not None:
                run.close(device)  # after the except block: its traceback held the tensors
            elif entry.get("status") is not None:
                _free(device)
    need = args.iters * WARM_TO_STEADY * sum(run.warm_s for _, run in live)
    if live and need > deadline.left():
        for entry, run in live:
            entry.update(status="not run", reason=f"--budget-s: {deadline.left():.0f} s left, "
                                                  f"its rounds need about {need:.0f} s")
            run.close(device)
        live = []
    for _ in range(args.iters):
        for entry, run in list(live):
            try:
                run.times.append(run.step(device, real))
            except Exception as e:  # out of memory at a steady step: the others go on
                _fail(entry, e, False)
            if entry.get("status") is not None:
                run.close(device)
                live.remove((entry, run))
    full_config = model_config(args.model, layers=args.full_layers, max_positions=seq)
    for entry, run in live:
        cfg = run.model.config
        _timed_entry(entry, run, model_flops(cfg, run.tokens, seq, run.sp.sequence_parallel_size),
                     peak_tflops, device)
        if args.profile:
            entry["profile"] = profile_step(run, device, args.profile)
        entry["sp_size"] = run.sp.sequence_parallel_size
        run.close(device)
    if len(depths) == 2:
        full = text_config_of(full_config).num_hidden_layers
        return entries, depth_entries(
            entries, depths, full,
            lambda e: model_flops(full_config, e["tokens_per_rank"], seq, e["sp_size"]),
            peak_tflops)
    return entries, []


def _show(say, phase: Phase, entries: list[dict], depth: list[dict], head: str) -> None:
    say(f"\n{phase.tokens} tokens per rank, {head}")
    say(f"{'run':<22}{'kernel':<14}{'layers':>7}{'step s':>9}{'tok/s/rank':>12}{'MFU':>7}"
        f"{'MFU exec':>9}{'max alloc':>11}  status")
    for e in entries:
        if e["status"] != "timed":
            say(f"{e['label']:<22}{e['kernel'] or e['backend']:<14}{e['layers']:>7}"
                f"{'':>48}  {e['status']}: {e.get('reason', '')[:120]}")
            continue
        mfu = f"{100 * e['mfu']:6.1f}%" if "mfu" in e else "      -"
        mfux = f"{100 * e['mfu_executed']:8.1f}%" if "mfu_executed" in e else "        -"
        mem = (f"{e['max_memory_allocated'] / GiB:8.2f} GiB" if "max_memory_allocated" in e
               else "          -")
        say(f"{e['label']:<22}{e['kernel']:<14}{e['layers']:>7}{e['step_s']:9.3f}"
            f"{e['tokens_per_s_per_rank']:12.0f}{mfu}{mfux} {mem}  timed")
    for d in depth:
        pred = d["predicted"]
        said = (f"; planner: {pred['step_s']:.3g} s, {pred['less_collective_s']:.3g} s without "
                f"communication" if pred else "")
        mfu = f", MFU {100 * d['mfu']:.1f}%" if "mfu" in d else ""
        say(f"  {d['label']} ({d['kernel']}): {d['per_layer_s']:.3f} s per layer, "
            f"{d['fixed_s']:.3f} s fixed -> {d['full_layers']} layers {d['step_s']:.2f} s"
            f"{mfu}{said}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=2, help="the depth, without --depths")
    p.add_argument("--depths", type=int, nargs=2, default=None, metavar=("A", "B"),
                   help="time every run at A and B layers and extend to --full-layers")
    p.add_argument("--full-layers", type=int, default=None,
                   help="with --depths: the depth to extend to (default: the model's own)")
    p.add_argument("--world", type=int, default=8, help="ranks of the emulated job (alone)")
    p.add_argument("--tokens-per-rank", nargs="+", default=["64K", "128K"])
    p.add_argument("--stack", action="append", choices=sorted(STACKS), default=None,
                   help="repeatable; default (without --fields): alst, ours, "
                        "ours-keep-attention")
    p.add_argument("--fields", action="append", default=None, metavar="[LABEL=]JSON",
                   help="repeatable: SequenceParallelConfig fields, inline JSON or a file "
                        "(a dict of fields, or the planner's --json output)")
    p.add_argument("--schedule", type=Path, default=None,
                   help="a JSON list of phases (benchmarks/_step_specs.py); replaces "
                        "--tokens-per-rank, --stack, --fields and --backend")
    p.add_argument("--backend", action="append", choices=("auto", *BACKENDS), default=None,
                   help="attention kernel, repeatable; default: auto")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=None,
                   help="leave out what would not end within this many seconds")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute dtype (FSDP2's param_dtype); fp32 for CPU runs, where bf16 "
                        "matmuls take a slow path on CPUs without bf16 units")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"for MFU; default {H100_BF16_TFLOPS:g} on CUDA, none on CPU")
    p.add_argument("--no-count", action="store_true", help="do not count the warm-up's work")
    p.add_argument("--kernels", action="store_true", help="also time each kernel alone")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile one more step of each run (torch.profiler) and print its "
                        "N most expensive ops by self time")
    p.add_argument("--flops-only", action="store_true",
                   help="no timing: trace each stack on fake tensors (this machine's CPU) and "
                        "count its executed FLOPs (attention kernels and the rest)")
    p.add_argument("--attention-tflops", type=float, default=540.0,
                   help="--flops-only: the attention kernel's speed (H100: cuDNN about 540, "
                        "SDPA flash about 320)")
    p.add_argument("--matmul-tflops", type=float, default=700.0,
                   help="--flops-only: the speed of the matrix products")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def phases_from_args(args) -> list[Phase]:
    """The command line's runs (every stack and fields x every kernel) at every length."""
    backends = args.backend or ["auto"]
    stacks = args.stack or ([] if args.fields else ["alst", "ours", "ours-keep-attention"])
    runs = [RunSpec(label=s, stack=s, backend=b) for s in stacks for b in backends]
    runs += [replace(fields_spec(f), backend=b) for f in args.fields or () for b in backends]
    return [Phase(tokens=t, runs=runs, kernels=args.kernels) for t in args.tokens_per_rank]


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    layers_tag = "-".join(map(str, args.depths)) if args.depths else str(args.layers)
    if args.flops_only:
        record = {"model": args.model, "layers": args.layers, "world": args.world,
                  "torch": torch.__version__,
                  **flops_only(args, args.stack or ["alst", "ours", "ours-keep-attention"],
                               args.backend or ["auto"], dtype)}
        out = args.out or REPO / "benchmarks" / "results" / \
            f"step_flops_w{args.world}_l{args.layers}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
        return
    phases = read_schedule(args.schedule) if args.schedule else phases_from_args(args)
    deadline = Deadline(budget_s=args.budget_s or float("inf"))
    use_expandable_segments()  # as arctic's launch paths do (arctic.memory.allocator)
    device, world, real = _init(args.world)
    rank0 = not real or dist.get_rank() == 0
    peak_tflops = args.peak_tflops or (H100_BF16_TFLOPS if device.type == "cuda" else None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = gpu.split()[1].lower() if device.type == "cuda" and len(gpu.split()) > 1 else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"step_{tag}_w{world}_l{layers_tag}.json"
    record = {"model": args.model, "layers": args.layers, "depths": args.depths,
              "world": world, "device": gpu, "dtype": args.dtype, "real_job": real,
              "torch": torch.__version__, "iters": args.iters, "peak_tflops": peak_tflops,
              "runs": [], "depth": [], "kernels": []}

    def say(*a):
        if rank0:
            print(*a, flush=True)

    def write():
        if rank0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=2) + "\n")
            if os.environ.get("OUT"):
                (Path(os.environ["OUT"]) / out.name).write_text(json.dumps(record, indent=2))

    for phase in phases:
        entries, depth = run_phase(phase, args, device, world, real, dtype, deadline,
                                   peak_tflops)
        record["runs"] += entries
        record["depth"] += depth
        _show(say, phase, entries, depth, f"{world} ranks, {args.model}, {gpu}")
        if phase.kernels and deadline.left() > 0:
            config = model_config(args.model, layers=1)
            H, K = config.num_attention_heads, config.num_key_value_heads
            D = getattr(config, "head_dim", None) or config.hidden_size // H
            seq = parse_tokens(phase.tokens) * world  # plain Ulysses' heads: H / W per rank
            rows = kernel_tflops(device, seq, max(1, H // world), max(1, K // world), D,
                                 [b for b in BACKENDS if b != "math"], args.iters, dtype)
            for r in rows:
                r["seq_len"] = seq
                say(f"  kernel {r['backend']:<16}" + (f"{r['seconds']:8.3f} s "
                                                     f"{r['tflops']:9.3f} TFLOP/s"
                                                     if "seconds" in r else
                                                     f"skipped: {r['skipped']}"))
            record["kernels"] += rows
        write()
    say(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
