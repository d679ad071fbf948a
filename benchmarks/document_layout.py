"""Benchmark: ring attention over packed documents, whole-row zigzag vs the per-document layout.

On W ranks (a ring of W, ``ulysses=1``), causal fwd+bwd of the same packed sequence, its
documents given as ``segments``, on two meshes that differ only in the layout:

- ``zigzag``: the row cut into 2W chunks, rank r holding chunks r and 2W-1-r;
- ``per_document``: every document cut that way
  (``SequenceParallelDims(..., per_document=True)``, :func:`ulysses.sharding.ring_runs`).

The documents (fixed seed): one long document of half the row at a random place, the rest
log-uniform between S/64 and S/16 tokens. The layouts run alternately in the same run.
Reported per layout:

- ``median_s``: wall time of one fwd+bwd, max over ranks;
- ``busy_max_s`` / ``busy_mean_s``: the ranks' main-thread CPU time (one thread per rank, so
  the rank's own compute), and their ratio: what a host with a core per rank waits for
  (oversubscribed hosts time-slice the ranks, so wall time follows the total);
- ``predicted``: max / mean of the visible (query, key) pairs per rank
  (``benchmarks/document_balance.py``'s measure), for comparison;
- the largest difference of the gathered out/dq/dk/dv between the two layouts.

    torchrun --nproc_per_node 2 benchmarks/document_layout.py [--seq 16384 --iters 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ulysses import SequenceParallelDims, gather_sequence, shard_sequence, ulysses_attention
from ulysses.sharding import _SeqSplit, ring_runs

REPO = Path(__file__).resolve().parent.parent
NAMES = ("q", "k", "v", "dout")


def draw_documents(seq: int, seed: int) -> tuple[int, ...]:
    """Document starts: one of ``seq / 2`` tokens at a random place among log-uniform ones."""
    rng = np.random.default_rng(seed)
    long_at, starts, pos = int(rng.integers(0, seq // 2)), [], 0
    while pos < seq:
        starts.append(pos)
        if long_at is not None and pos >= long_at:
            n, long_at = seq // 2, None
        else:
            n = int(np.exp(rng.uniform(np.log(seq / 64), np.log(seq / 16))))
        pos += n
    return tuple(starts)


def predicted_imbalance(seq: int, R: int, starts: tuple[int, ...], per_document: bool) -> float:
    """max / mean over ranks of the visible (query, key) pairs of their query rows."""
    bounds = np.array(starts[1:])
    offsets = np.arange(seq) - np.array(starts)[np.searchsorted(bounds, np.arange(seq),
                                                                 side="right")]
    prefix = np.concatenate([[0], np.cumsum(offsets + 1)])
    split = _SeqSplit(ring=R, ulysses=1, zigzag=True)
    work = []
    for r in range(R):
        runs = ring_runs(seq, R, r, starts) if per_document else split.runs(seq, r)
        work.append(sum(prefix[g + n] - prefix[g] for g, n in runs))
    return float(max(work) / np.mean(work))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path,
                   default=REPO / "benchmarks" / "results" / "document_layout.json")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.seq % (2 * world):
        raise SystemExit(f"--seq must divide by 2 x {world}")
    starts = draw_documents(args.seq, args.seed)
    meshes = {name: SequenceParallelDims(world, 1, world, per_document=name == "per_document")
              .build_mesh("cpu") for name in ("zigzag", "per_document")}
    g = torch.Generator().manual_seed(1)
    shape = (1, args.seq, args.heads, args.head_dim)
    kv = (1, args.seq, args.kv_heads, args.head_dim)
    full = {n: torch.randn(kv if n in ("k", "v") else shape, generator=g) for n in NAMES}
    segments = (starts,)

    def step(name):
        mesh = meshes[name]
        cut = {"segments": segments} if name == "per_document" else {}
        local = {n: shard_sequence(full[n], mesh, **cut).contiguous() for n in NAMES}
        q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = ulysses_attention(q, k, v, mesh=mesh, causal=True, segments=segments)
        out.backward(local["dout"])
        busy, wall = time.thread_time() - c0, time.perf_counter() - t0
        dist.barrier()
        return wall, busy, [gather_sequence(t, mesh, **cut) for t in (out.detach(), q.grad,
                                                                      k.grad, v.grad)]

    results = {name: {"wall": [], "busy": []} for name in meshes}
    outputs = {}
    for it in range(args.iters + 1):  # the first round warms up
        for name in (("zigzag", "per_document") if it % 2 == 0 else ("per_document", "zigzag")):
            wall, busy, outputs[name] = step(name)
            if it == 0:
                continue
            times = torch.tensor([wall, busy], dtype=torch.float64)
            every = [torch.empty_like(times) for _ in range(world)]
            dist.all_gather(every, times)
            results[name]["wall"].append(max(float(t[0]) for t in every))
            results[name]["busy"].append([float(t[1]) for t in every])
    diff = max(float((a - b).abs().max()) for a, b in zip(outputs["zigzag"],
                                                          outputs["per_document"]))
    rows = []
    for name, res in results.items():
        per_rank = np.median(np.array(res["busy"]), axis=0)
        rows.append({"layout": name, "median_s": round(statistics.median(res["wall"]), 4),
                     "busy_max_s": round(float(per_rank.max()), 4),
                     "busy_mean_s": round(float(per_rank.mean()), 4),
                     "busy_max_over_mean": round(float(per_rank.max() / per_rank.mean()), 3),
                     "predicted_max_over_mean": round(predicted_imbalance(
                         args.seq, world, starts, name == "per_document"), 3)})
    if rank == 0:
        zig, doc = rows
        print(f"ring of {world}, S = {args.seq}, {len(starts)} documents, H = {args.heads}, "
              f"K = {args.kv_heads}, D = {args.head_dim}, {os.cpu_count()} cores")
        print(f"{'layout':<14}{'median s':>10}{'busy max':>10}{'busy mean':>11}"
              f"{'max/mean':>10}{'predicted':>11}")
        for r in rows:
            print(f"{r['layout']:<14}{r['median_s']:>10.3f}{r['busy_max_s']:>10.3f}"
                  f"{r['busy_mean_s']:>11.3f}{r['busy_max_over_mean']:>10.3f}"
                  f"{r['predicted_max_over_mean']:>11.3f}")
        print(f"per_document / zigzag: wall {doc['median_s'] / zig['median_s']:.3f}, busiest "
              f"rank {doc['busy_max_s'] / zig['busy_max_s']:.3f}; largest difference of "
              f"out/dq/dk/dv between them {diff:.2e}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "world": world, "seq": args.seq, "documents": list(starts), "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
            "host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
            "max_abs_difference": diff, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
