"""Benchmark: ``ulysses.ulysses_attention`` vs DeepSpeed's ``DistributedAttention``.

Every implementation gets the same inputs and the same output gradient and runs forward +
backward. They are timed alternately (ABC... ABC...) in the same run:
- DeepSpeed;
- ours unchunked;
- ours head-chunked at each ``--chunks`` size, with one BufferPool per variant reused across
  iterations as it would be across layers;
- ours at ``--no-overlap-chunk`` without overlap.

The first (warm-up) run of each is the one measured for memory. Every output and input
gradient must agree with DeepSpeed's.

Memory, per rank:
- ``peak`` is what a fwd+bwd allocates beyond its inputs. On CPU it comes from MemTracker,
  with the inputs registered as the baseline; on GPU from the CUDA allocator.
- ``transient`` is ``peak`` minus the output and the input gradients, which every
  implementation must hold.

    deepspeed --num_gpus 2 benchmarks/attention.py [--seq 8192 ...]
    torchrun --nproc_per_node 2 benchmarks/attention.py [--seq 8192 ...]

Shape legend: B batch, S full sequence, s = S / W this rank's piece, H query heads, K kv
heads, D head dim, h / k this rank's query / kv heads after the all-to-all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import deepspeed.comm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention

from ulysses import BufferPool, SequenceParallelDims, shard_sequence, ulysses_attention
from ulysses.torch_internals import step_mem_tracker


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}  # atol = rtol
MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192, help="full sequence length S")
    p.add_argument("--heads", type=int, default=32, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads K")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--iters", type=int, default=3, help="timed iterations per implementation")
    p.add_argument("--chunks", default="", help="head_chunk_size values to add, e.g. 1,2,4,8")
    p.add_argument("--no-overlap-chunk", type=int, default=None,
                   help="also run this head_chunk_size with chunk_overlap=False")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path; default benchmarks/results/attention_<device>_w<W>.json")
    # The DeepSpeed launcher appends --local_rank=N; the env var LOCAL_RANK is what we use.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def init_distributed() -> torch.device:
    """Init torch.distributed (gloo on CPU, nccl on CUDA), then wrap it in deepspeed.comm."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # torchrun sets LOCAL_WORLD_SIZE, the DeepSpeed launcher LOCAL_SIZE.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend)
    deepspeed.comm.init_distributed(dist_backend=backend)
    return device


def make_inputs(args, mesh, device: torch.device, seq: int | None = None) -> dict:
    """Full q/k/v/dout from one seed (same on every rank), sharded on the sequence dim.

    Returns local ``q_BsHD``, ``k_BsKD``, ``v_BsKD``, ``dout_BsHD`` (contiguous, no grad).
    """
    gen = torch.Generator().manual_seed(0)
    B, S, H, K, D = args.batch, seq or args.seq, args.heads, args.kv_heads, args.head_dim
    shapes = {"q": (B, S, H, D), "k": (B, S, K, D), "v": (B, S, K, D), "dout": (B, S, H, D)}
    dtype = DTYPES[args.dtype]
    return {name: shard_sequence(torch.randn(shape, generator=gen).to(device, dtype), mesh,
                                 dim=1).contiguous()
            for name, shape in shapes.items()}


def make_impls(mesh, causal: bool, chunks: list[int], no_overlap_chunk: int | None) -> dict:
    """The implementations, each ``fn(q_BsHD, k_BsKD, v_BsKD) -> out_BsHD``."""

    def local_sdpa(q_BShD, k_BSkD, v_BSkD):
        # What a DeepSpeed user writes: SDPA in [B, h, S, D], GQA handled by the kernel.
        return F.scaled_dot_product_attention(
            q_BShD.transpose(1, 2), k_BSkD.transpose(1, 2), v_BSkD.transpose(1, 2),
            is_causal=causal, enable_gqa=True).transpose(1, 2)

    def chunked(c: int, overlap: bool):
        pool = BufferPool()  # reused across iterations, as across the layers of a model
        return lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                                 head_chunk_size=c, buffer_pool=pool,
                                                 chunk_overlap=overlap)

    ds_attn = DistributedAttention(local_sdpa, mesh["ulysses"].get_group(), scatter_idx=2,
                                   gather_idx=1)
    impls = {
        "deepspeed": lambda q, k, v: ds_attn(q, k, v, 0),  # batch_dim_idx=0: [B, s, H, D]
        "ours": lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal),
    }
    impls |= {f"ours_c{c}": chunked(c, True) for c in chunks}
    if no_overlap_chunk is not None:
        impls[f"ours_c{no_overlap_chunk}_no_overlap"] = chunked(no_overlap_chunk, False)
    return impls


def fwd_bwd(fn, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One forward + backward on fresh leaves; returns the output and the input grads."""
    q, k, v = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v"))
    out_BsHD = fn(q, k, v)
    out_BsHD.backward(inputs["dout"])
    return {"out": out_BsHD.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_memory(fn, inputs, device) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    """(peak, transient) bytes of one fwd+bwd beyond its inputs, and that run's results."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fwd_bwd(fn, inputs)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        mt = step_mem_tracker()  # MemTracker, its step peak alone
        # Registered up front, the inputs form the baseline (MemTracker would otherwise count
        # a storage only once an op touches it).
        mt.track_external(*inputs.values())
        with mt:
            base = mt.get_tracker_snapshot("current")[device]["Total"]
            result = fwd_bwd(fn, inputs)
        peak = mt.get_tracker_snapshot("peak")[device]["Total"] - base
    return (peak, peak - _nbytes(*result.values())), result


def run_all(impls: dict, inputs, args, device) -> tuple[dict, dict, dict]:
    """A memory-measured warm-up run of each, then ``iters`` alternating timed rounds.

    Each iteration's time is the max over ranks.
    """
    memory, results = {}, {}
    for name, fn in impls.items():
        memory[name], results[name] = peak_memory(fn, inputs, device)
    times = {name: [] for name in impls}
    for _ in range(args.iters):
        for name, fn in impls.items():
            sync(device)
            start = time.perf_counter()
            fwd_bwd(fn, inputs)
            sync(device)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return times, memory, results


def kernel_names(fn, inputs) -> list[str]:
    """The aten attention ops one fwd+bwd dispatches to, from torch.profiler (untimed run)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fwd_bwd(fn, inputs)
    keys = ("scaled_dot_product", "flash", "attention")
    return sorted({e.key for e in prof.key_averages()
                   if e.key.startswith("aten::") and any(s in e.key for s in keys)})


def gather_ints(value: int, device) -> list[int]:
    """``value`` from every rank, in rank order."""
    out = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(value, dtype=torch.int64, device=device))
    return [int(t) for t in out]


def compare(results: dict, dtype: torch.dtype) -> tuple[dict, str | None]:
    """Max abs diff of each implementation against DeepSpeed (max over ranks), and the first
    mismatch message if any."""
    tol, diffs, error = TOLERANCE[dtype], {}, None
    peer = results["deepspeed"]
    for impl, res in results.items():
        if impl == "deepspeed":
            continue
        diffs[impl] = {}
        for name, ours in res.items():
            diff = (ours.float() - peer[name].float()).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            diffs[impl][name] = diff.item()
            try:
                torch.testing.assert_close(ours, peer[name], atol=tol, rtol=tol)
            except AssertionError as e:
                error = error or f"rank {dist.get_rank()} {impl} {name}: {e}"
    return diffs, error


def acceptance(record: dict) -> dict[str, dict]:
    """The ratios the issues set bars on, where this run has the implementations."""
    med, tr = record["median_s"], record["transient_bytes_max"]
    checks = {"unchunked_time_over_deepspeed": (med["ours"] / med["deepspeed"], 1.05),
              "unchunked_peak_over_deepspeed": (record["peak_bytes_max"]["ours"]
                                                / record["peak_bytes_max"]["deepspeed"], 1.0)}
    if "ours_c1" in med:
        checks["c1_time_over_unchunked"] = (med["ours_c1"] / med["ours"], 1.15)
        checks["c1_transient_over_unchunked"] = (tr["ours_c1"] / tr["ours"], 0.25)
    if "ours_c1" in med and "ours_c1_no_overlap" in med:
        checks["c1_overlap_time_over_no_overlap"] = (med["ours_c1"] / med["ours_c1_no_overlap"],
                                                     1.0)
    return {k: {"value": v, "bar": bar, "pass": v <= bar} for k, (v, bar) in checks.items()}


def report(args, world: int, device, record: dict) -> None:
    """Print the table and write the JSON (rank 0 only)."""
    med, mem, tr = record["median_s"], record["peak_bytes_max"], record["transient_bytes_max"]
    print(f"\nconfig: W={world} B={args.batch} S={args.seq} H={args.heads} K={args.kv_heads} "
          f"D={args.head_dim} dtype={args.dtype} causal={args.causal} iters={args.iters} "
          f"device={record['device']} threads/rank={torch.get_num_threads()}")
    print(f"{'impl':<22} | {'median s':>9} | {'/ DS':>6} | {'/ ours':>6} | {'peak MiB':>9} | "
          f"{'/ DS':>6} | {'transient MiB':>13} | {'/ ours':>6}")
    for name in med:
        print(f"{name:<22} | {med[name]:>9.3f} | {med[name] / med['deepspeed']:>6.3f} | "
              f"{med[name] / med['ours']:>6.3f} | {mem[name] / MIB:>9.1f} | "
              f"{mem[name] / mem['deepspeed']:>6.3f} | {tr[name] / MIB:>13.1f} | "
              f"{tr[name] / tr['ours']:>6.3f}")
    for name, check in record["acceptance"].items():
        print(f"{'PASS' if check['pass'] else 'FAIL'}  {name} = {check['value']:.3f} "
              f"(bar {check['bar']})")
    print(f"kernels: {record['kernels']}\nmax abs diff vs DeepSpeed: {record['max_abs_diff']}")
    out = args.out or Path(__file__).parent / "results" / f"attention_{device.type}_w{world}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    args = parse_args()
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = SequenceParallelDims(world, world).build_mesh(device.type)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    impls = make_impls(mesh, args.causal, chunks, args.no_overlap_chunk)

    # Which kernels each side dispatches to, on a short sequence (a profiled run is not timed).
    small = make_inputs(args, mesh, device, seq=min(args.seq, 256 * world))
    kernels = {name: kernel_names(impls[name], small) for name in ("deepspeed", "ours")}
    inputs = make_inputs(args, mesh, device)
    times, memory, results = run_all(impls, inputs, args, device)
    peaks = {name: gather_ints(m[0], device) for name, m in memory.items()}
    transients = {name: gather_ints(m[1], device) for name, m in memory.items()}
    diffs, error = compare(results, DTYPES[args.dtype])
    failed = torch.tensor(error is not None, dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        print(f"!!! MISMATCH against DeepSpeed: {error}", file=sys.stderr, flush=True)

    medians = {name: statistics.median(t) for name, t in times.items()}
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k != "local_rank"} | {"world_size": world},
        "device": device.type,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"{platform.processor() or platform.machine()}, "
                             f"{os.cpu_count()} cores, {torch.get_num_threads()} threads/rank"),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__,
        "times_s": times, "median_s": medians,
        "peak_bytes_per_rank": peaks, "transient_bytes_per_rank": transients,
        "peak_bytes_max": {name: max(p) for name, p in peaks.items()},
        "transient_bytes_max": {name: max(t) for name, t in transients.items()},
        "kernels": kernels, "max_abs_diff": diffs, "outputs_match": not failed.item(),
    }
    record["acceptance"] = acceptance(record)
    if rank == 0:
        report(args, world, device, record)
    dist.destroy_process_group()
    if failed.item():
        sys.exit(1)


if __name__ == "__main__":
    main()
