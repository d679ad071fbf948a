"""The README's headline: the planner's longest Llama-3-8B sequence per stack and cluster.

For each stack (``alst``: Ulysses + tiling + checkpointing + offload, no head chunking, as
DeepSpeed ALST; ``ours``: + head chunking with the projections fused into the chunk loop;
``hybrid``: ``ours`` over ring 2 x Ulysses W/2) and each cluster (8 x 80 GiB GPUs on one node,
32 on four; 2 TB of host memory per node), ``arctic.plan.find_max`` traces training steps
under FakeTensorMode until the longest fitting length is bracketed to 2%. Also records the
limiting memory kind and the largest tensors at the peak of the last length that did not fit.

    python benchmarks/plan_headline.py --gpus 8 --nodes 1 [--stacks alst ours hybrid]

Writes ``results/plan_headline_<G>x<K>.json``; published anchors are in the JSON for
comparison (ALST 3.7M on 8 H100 and 15M on 32; UPipe 5M on 8 H100).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arctic.plan import find_max, parse_bytes, plan  # noqa: E402

ANCHORS = {"alst_8xh100": 3_700_000, "alst_32xh100": 15_000_000, "upipe_8xh100": 5_000_000,
           "target_8x80gb": 6_000_000}
START = {("alst", 8): 3_000_000, ("ours", 8): 5_700_000, ("hybrid", 8): 5_700_000,
         ("alst", 32): 12_000_000, ("ours", 32): 18_000_000, ("hybrid", 32): 18_000_000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", default="80GiB")
    p.add_argument("--host-memory", default="2TB")
    p.add_argument("--stacks", nargs="+", default=["alst", "ours", "hybrid"])
    args = p.parse_args()
    world = args.gpus * args.nodes
    out = REPO / "benchmarks" / "results" / f"plan_headline_{args.gpus}x{args.nodes}.json"
    record = json.loads(out.read_text()) if out.exists() else {}
    record.update({"model": args.model, "gpus": args.gpus, "nodes": args.nodes,
                   "gpu_memory": args.gpu_memory, "host_memory_per_node": args.host_memory,
                   "anchors": ANCHORS})
    record.setdefault("stacks", {})
    for stack in args.stacks:
        start = time.perf_counter()
        print(f"{stack}:", flush=True)
        best, tried = find_max(
            lambda n: plan(args.model, n, gpus=args.gpus, nodes=args.nodes, stack=stack,
                           gpu_memory=parse_bytes(args.gpu_memory),
                           host_memory=parse_bytes(args.host_memory)),
            start=START.get((stack, world), 4_000_000), granule=1024 * world,
            log=lambda line: print(line, flush=True))
        misfits = [e for e in tried if not e.fits]
        nearest = min(misfits, key=lambda e: e.seq_len) if misfits else None
        fits = [e for e in tried if e.fits and e.seq_len == best]
        record["stacks"][stack] = {
            "max_seq_len": best, "at_max": fits[0].as_dict() if fits else None,
            "first_misfit": nearest.as_dict() if nearest else None,
            "tried": [e.as_dict() for e in tried], "search_s": round(time.perf_counter() - start)}
        print(f"{stack}: longest that fits {best:,} tokens "
              f"(limit above it: {nearest.limit() if nearest else '-'})", flush=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
