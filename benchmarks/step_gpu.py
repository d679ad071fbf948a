"""Step time and MFU of a training step, per stack and attention kernel (issue 17).

The same build and step as ``benchmarks/scale_gpu.py`` (``arctic.plan.build`` and
``arctic.plan.train_step``: the HF model from its config, the SP recipe, FSDP2 with bf16
compute, AdamW). Two ways to run it:

- one GPU, alone: one rank of a W-rank job, torch's fake process group standing in for the
  other W-1 ranks (collectives return at once and move nothing), so the step runs rank 0's
  real kernels on rank 0's real shapes; values are garbage, time and memory are real;
- under ``torchrun``: every rank of a real job (gloo on CPU, NCCL on GPUs); each step's time
  is the slowest rank's. This is how the CPU shows what kept attention saves.

Every (stack, kernel) pair is built, runs one warm step, then ``--iters`` rounds time one
steady step of each pair in turn (alternating, so drift hits all alike); medians. Reported:
step time, tokens/s per rank, peak memory (CUDA allocator, less what the other runs
keep between their steps) and two MFUs over ``--peak-tflops``
(989 bf16 dense on an H100 SXM by default on CUDA; on CPU only when given):

- ``mfu``: model FLOPs, 6 * P * s + 3 * A per rank, with P the parameters (input embedding
  excluded, a tied lm_head counted), s the tokens per rank and A this rank's share of the
  causal attention forward, layers * 2 * S^2 * H * D / sp; recompute not counted;
- ``mfu_executed``: the FLOPs the step ran, counted on one extra step: matmuls (and the rest
  of torch's FLOP formulas) by ``torch.utils.flop_counter.FlopCounterMode``, attention kernels
  by their calls (4 * B * Sq * Sk * H * D, halved when causal; backward 2.5 times that).

``--kernels`` also times each attention kernel alone (causal forward + backward over the
full sequence for this rank's heads, FLOPs counted as 3.5 forwards) and prints its TFLOP/s.

    python benchmarks/step_gpu.py --model llama3-8b --layers 2 --world 8 \\
        --tokens-per-rank 64K 128K --stack alst --stack ours --stack ours-keep-attention \\
        --backend auto --backend sdpa_flash --kernels
    torchrun --nproc_per_node 2 benchmarks/step_gpu.py --model tiny-llama --layers 2 \\
        --tokens-per-rank 8K --stack ours --stack ours-keep-attention --iters 5

``--flops-only`` times nothing: it traces each stack on fake tensors (any machine, seconds) and
counts the executed FLOPs, attention kernels and the rest, with the step time and MFU they
imply at given kernel speeds (``--attention-tflops``, ``--matmul-tflops``).

    python benchmarks/step_gpu.py --flops-only --model llama3-8b --layers 2 --world 8 \
        --tokens-per-rank 64K 128K --stack alst --stack ours --stack ours-keep-attention

Writes ``results/step_<device>_w<W>_l<layers>.json`` (``step_flops_...`` for
``--flops-only``; ``--out`` to choose).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from dataclasses import replace
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ulysses.kernels as kernels  # noqa: E402
from arctic.memory.allocator import use_expandable_segments  # noqa: E402
from arctic.plan.tracing import fake_world  # noqa: E402
from arctic.plan import (STACKS, build, init_optimizer_state, make_batch, model_config,  # noqa
                         parse_tokens, stack_config, train_step)
from ulysses import BACKENDS  # noqa: E402

GiB = 1 << 30
H100_BF16_TFLOPS = 989.0


# --- FLOPs -----------------------------------------------------------------------------------

def model_flops(config, tokens_per_rank: int, seq_len: int, sp: int) -> float:
    """6 * P * s + 3 * A per rank (see the module docstring); recompute not counted."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters()) - embed.numel()
    if out is embed:  # tied: the lm_head's matmul still runs
        params += embed.numel()
    H = config.num_attention_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    attention = config.num_hidden_layers * 2 * seq_len ** 2 * H * D / sp
    return 6 * params * tokens_per_rank + 3 * attention


def _attention_flops(q, k, causal: bool) -> float:
    B, Sq, H, D = q.shape
    return 4 * B * Sq * k.shape[1] * H * D * (0.5 if causal else 1.0)


@contextlib.contextmanager
def count_executed_flops():
    """Count the FLOPs run inside the block: yields a dict whose ``"total"`` is set on exit.

    Attention kernels are counted at their calls (every backend goes through
    ``ulysses.kernels``' tables), causal-aware; torch's FlopCounterMode counts the rest, with
    its attention formulas (which ignore the causal mask) zeroed so nothing counts twice."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    counted = {"attention": 0.0}
    fwd, bwd = dict(kernels._FORWARD), dict(kernels._BACKWARD)

    def forward(name):
        def call(q, k, v, causal, scale):
            counted["attention"] += _attention_flops(q, k, causal)
            return fwd[name](q, k, v, causal, scale)
        return call

    def backward(name):
        def call(dout, q, k, v, out, lse, causal, scale):
            counted["attention"] += 2.5 * _attention_flops(q, k, causal)
            return bwd[name](dout, q, k, v, out, lse, causal, scale)
        return call

    zero = {op: (lambda *a, **kw: 0) for op in flop_registry if "attention" in str(op)}
    for name in fwd:
        kernels._FORWARD[name], kernels._BACKWARD[name] = forward(name), backward(name)
    mode = FlopCounterMode(display=False, custom_mapping=zero)
    try:
        with mode:
            yield counted
    finally:
        kernels._FORWARD.update(fwd)
        kernels._BACKWARD.update(bwd)
    counted["other"] = float(mode.get_total_flops())
    counted["total"] = counted["attention"] + counted["other"]


# --- setup -----------------------------------------------------------------------------------

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


def _backend_name(backend: str) -> str | None:
    return None if backend == "auto" else backend


class _Run:
    """One (stack, backend) pair, built and warmed, timed in turn with the others."""

    def __init__(self, stack, backend, config, world, tokens, device, real, dtype):
        self.stack, self.backend, self.tokens, self.dtype = stack, backend, tokens, dtype
        sp = replace(stack_config(stack, world=world), attention_backend=_backend_name(backend))
        self.sp = sp
        mesh = sp.dims(world).build_mesh(device.type)
        self.seq_len = tokens * sp.sequence_parallel_size
        cuda = device.type == "cuda"
        before = torch.cuda.memory_allocated(device) if cuda else 0
        self.model, self.optimizer = build(config, sp, mesh, device=device,
                                           host_memory_limit=96 * GiB, compute_dtype=dtype)
        init_optimizer_state(self.model, self.optimizer)
        self.batch = make_batch(self.seq_len, config.vocab_size, mesh, device)
        # What this run keeps between steps (parameters, AdamW state, batch): the other runs'
        # are alive too while it steps, and are taken out of its peak.
        self.resident = (torch.cuda.memory_allocated(device) - before) if cuda else 0
        self.times: list[float] = []
        self.peak = 0
        self.resolved = None

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

    def close(self) -> None:
        del self.model, self.optimizer, self.batch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _resolved_backend(run: _Run, device) -> str:
    """The kernel an ``auto`` run actually used (its compute dtype, the model's head dim)."""
    if run.backend != "auto":
        return run.backend
    cfg = run.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return kernels.select_backend(device, run.dtype, head_dim)


# --- FLOPs alone, on fake tensors ------------------------------------------------------------

def flops_only(args, stacks, backends, dtype) -> dict:
    """Each stack's executed FLOPs (attention kernels, everything else), traced on fake
    tensors (any machine, no time): what recompute costs at the real shapes. With the kernel speeds
    (``--attention-tflops``, ``--matmul-tflops``) also the step time and MFU they imply."""
    from ulysses.torch_internals import FakeTensorMode

    fake_world(args.world)
    rows = []
    for tokens_text in args.tokens_per_rank:
        tokens = parse_tokens(tokens_text)
        for stack in stacks:
            sp = replace(stack_config(stack, world=args.world),
                         attention_backend=_backend_name(backends[0]))
            seq = tokens * sp.sequence_parallel_size
            config = model_config(args.model, layers=args.layers, max_positions=seq)
            mesh = sp.dims(args.world).build_mesh("cpu")
            with FakeTensorMode(allow_non_fake_inputs=True):
                model, optimizer = build(config, sp, mesh, device="cpu", compute_dtype=dtype,
                                         host_memory_limit=1 << 50)
                init_optimizer_state(model, optimizer)
                batch = make_batch(seq, config.vocab_size, mesh, "cpu")
                with count_executed_flops() as counted:
                    train_step(model, optimizer, batch)
            model_f = model_flops(config, tokens, seq, sp.sequence_parallel_size)
            attention_s = counted["attention"] / (args.attention_tflops * 1e12)
            other_s = counted["other"] / (args.matmul_tflops * 1e12)
            peak = args.peak_tflops or H100_BF16_TFLOPS
            rows.append({"stack": stack, "tokens_per_rank": tokens, "seq_len": seq,
                         "model_flops": model_f, "executed_flops": counted["total"],
                         "attention_flops": counted["attention"],
                         "other_flops": counted["other"],
                         "implied_step_s": attention_s + other_s,
                         "implied_mfu": model_f / (attention_s + other_s) / (peak * 1e12)})
            del model, optimizer, batch
            gc.collect()
    print(f"{args.model} x {args.layers} layers, {args.world} ranks: executed TFLOP per step "
          f"(rank 0), and the step implied by attention at {args.attention_tflops:g} and "
          f"everything else at {args.matmul_tflops:g} TFLOP/s")
    print(f"{'stack':<22}{'tokens':>8}{'attention':>11}{'other':>9}{'executed':>10}"
          f"{'model':>8}{'step s':>8}{'MFU':>7}")
    for r in rows:
        print(f"{r['stack']:<22}{r['tokens_per_rank']:>8}{r['attention_flops'] / 1e12:11.1f}"
              f"{r['other_flops'] / 1e12:9.1f}{r['executed_flops'] / 1e12:10.1f}"
              f"{r['model_flops'] / 1e12:8.1f}{r['implied_step_s']:8.2f}"
              f"{100 * r['implied_mfu']:6.1f}%")
    return {"flops_only": rows, "attention_tflops": args.attention_tflops,
            "matmul_tflops": args.matmul_tflops}


# --- profile ---------------------------------------------------------------------------------

def profile_step(run: _Run, device, top: int) -> list[dict]:
    """One steady step under torch.profiler: the ``top`` ops by self time (CUDA time on a
    GPU, CPU time otherwise), each with its share of the step. Printed on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        train_step(run.model, run.optimizer, run.batch)
        _sync(device)
    cuda = device.type == "cuda"
    events = [e for e in prof.key_averages() if e.key and not e.key.startswith("ProfilerStep")]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(key(e) for e in events) or 1
    rows = [{"op": e.key, "self_us": key(e), "share": key(e) / total, "calls": e.count}
            for e in sorted(events, key=key, reverse=True)[:top]]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  profile of {run.stack} / {run.resolved}: top {top} ops by self "
              f"{'CUDA' if cuda else 'CPU'} time (of {total / 1e6:.2f} s)")
        for r in rows:
            print(f"    {r['share']:6.1%} {r['self_us'] / 1e6:8.3f} s {r['calls']:7d} x  {r['op']}")
    return rows


# --- kernels alone --------------------------------------------------------------------------

def kernel_tflops(device, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                  backends, iters: int, dtype: torch.dtype) -> list[dict]:
    """Causal forward + backward of each backend alone, FLOPs = 3.5 forwards."""
    from ulysses.attention import local_attention
    from ulysses.kernels import check_supported

    g = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(1, seq_len, h, head_dim, generator=g, device=device, dtype=dtype)

    q, k, v, dout = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
    flops = 3.5 * 4 * seq_len * seq_len * heads * head_dim * 0.5
    rows = []
    for backend in backends:
        try:
            check_supported(backend, device, dtype, head_dim)
        except ValueError as e:
            rows.append({"backend": backend, "skipped": str(e)})
            continue
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        times = []
        for _ in range(iters + 1):  # the first is a warm-up
            _sync(device)
            start = time.perf_counter()
            local_attention(*leaves, causal=True, backend=backend).backward(dout)
            _sync(device)
            times.append(time.perf_counter() - start)
        t = statistics.median(times[1:])
        rows.append({"backend": backend, "seconds": t, "tflops": flops / t / 1e12})
    return rows


# --- main ------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--world", type=int, default=8, help="ranks of the emulated job (alone)")
    p.add_argument("--tokens-per-rank", nargs="+", default=["64K", "128K"])
    p.add_argument("--stack", action="append", choices=sorted(STACKS), default=None,
                   help="repeatable; default: alst, ours, ours-keep-attention")
    p.add_argument("--backend", action="append", choices=("auto", *BACKENDS), default=None,
                   help="attention kernel, repeatable; default: auto")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute dtype (FSDP2's param_dtype); fp32 for CPU runs, where bf16 "
                        "matmuls take a slow path on CPUs without bf16 units")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"for MFU; default {H100_BF16_TFLOPS:g} on CUDA, none on CPU")
    p.add_argument("--no-count", action="store_true", help="skip the executed-FLOPs step")
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
                   help="--flops-only: the speed of everything else")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    stacks = args.stack or ["alst", "ours", "ours-keep-attention"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    backends = args.backend or ["auto"]
    if args.flops_only:
        record = {"model": args.model, "layers": args.layers, "world": args.world,
                  "torch": torch.__version__,
                  **flops_only(args, stacks, backends, dtype)}
        out = args.out or REPO / "benchmarks" / "results" / \
            f"step_flops_w{args.world}_l{args.layers}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
        return
    use_expandable_segments()  # as arctic's launch paths do (arctic.memory.allocator)
    device, world, real = _init(args.world)
    rank0 = not real or dist.get_rank() == 0
    peak_tflops = args.peak_tflops or (H100_BF16_TFLOPS if device.type == "cuda" else None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = gpu.split()[1].lower() if device.type == "cuda" and len(gpu.split()) > 1 else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"step_{tag}_w{world}_l{args.layers}.json"
    record = {"model": args.model, "layers": args.layers, "world": world, "device": gpu,
              "dtype": args.dtype,
              "real_job": real, "torch": torch.__version__, "iters": args.iters,
              "peak_tflops": peak_tflops, "runs": [], "kernels": []}

    def say(*a):
        if rank0:
            print(*a, flush=True)

    for tokens_text in args.tokens_per_rank:
        tokens = parse_tokens(tokens_text)
        runs = []
        for stack in stacks:
            for backend in backends:
                seq = tokens * world
                config = model_config(args.model, layers=args.layers, max_positions=seq)
                run = _Run(stack, backend, config, world, tokens, device, real, dtype)
                run.resolved = _resolved_backend(run, device)
                run.step(device, real)  # warm: allocator, pools, kernel autotuning
                runs.append(run)
        for _ in range(args.iters):
            for run in runs:
                run.times.append(run.step(device, real))
        for run in runs:
            cfg = run.model.config
            entry = {"stack": run.stack, "backend": run.backend, "kernel": run.resolved,
                     "tokens_per_rank": tokens, "seq_len": run.seq_len,
                     "step_s": statistics.median(run.times), "step_s_all": run.times,
                     "tokens_per_s_per_rank": tokens / statistics.median(run.times),
                     "model_flops": model_flops(cfg, tokens, run.seq_len,
                                                run.sp.sequence_parallel_size)}
            if device.type == "cuda":
                entry["max_memory_allocated"] = run.peak
            if not args.no_count:
                with count_executed_flops() as counted:
                    train_step(run.model, run.optimizer, run.batch)
                entry["executed_flops"] = counted["total"]
                entry["executed_attention_flops"] = counted["attention"]
            if peak_tflops:
                entry["mfu"] = entry["model_flops"] / entry["step_s"] / (peak_tflops * 1e12)
                if "executed_flops" in entry:
                    entry["mfu_executed"] = (entry["executed_flops"] / entry["step_s"] /
                                             (peak_tflops * 1e12))
            if args.profile:
                entry["profile"] = profile_step(run, device, args.profile)
            record["runs"].append(entry)
            run.close()
        base = record["runs"][-len(runs)]
        say(f"\n{tokens:,} tokens per rank ({runs[0].seq_len:,} total), {world} ranks, "
            f"{args.model} x {args.layers} layers, {gpu}")
        say(f"{'stack':<22}{'kernel':<16}{'step s':>9}{'tok/s/rank':>12}{'vs first':>9}"
            f"{'MFU':>7}{'MFU exec':>9}{'max alloc':>11}")
        for e in record["runs"][-len(runs):]:
            mfu = f"{100 * e['mfu']:6.1f}%" if "mfu" in e else "      -"
            mfux = f"{100 * e['mfu_executed']:8.1f}%" if "mfu_executed" in e else "        -"
            mem = (f"{e['max_memory_allocated'] / GiB:8.2f} GiB"
                   if "max_memory_allocated" in e else "          -")
            say(f"{e['stack']:<22}{e['kernel']:<16}{e['step_s']:9.3f}"
                f"{e['tokens_per_s_per_rank']:12.0f}{base['step_s'] / e['step_s']:8.2f}x"
                f"{mfu}{mfux} {mem}")
        if args.kernels:
            config = model_config(args.model, layers=1)
            H, K = config.num_attention_heads, config.num_key_value_heads
            U = world  # the kernels of plain Ulysses over all ranks: H / W local heads
            D = getattr(config, "head_dim", None) or config.hidden_size // H
            names = [b for b in BACKENDS if b != "math"]
            rows = kernel_tflops(device, tokens * world, max(1, H // U), max(1, K // U), D,
                                 names, args.iters, dtype)
            for r in rows:
                r["seq_len"] = tokens * world
                say(f"  kernel {r['backend']:<16}" + (f"{r['seconds']:8.3f} s "
                                                     f"{r['tflops']:9.3f} TFLOP/s"
                                                     if "seconds" in r else
                                                     f"skipped: {r['skipped']}"))
            record["kernels"] += rows
    if rank0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / out.name).write_text(json.dumps(record, indent=2))
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
