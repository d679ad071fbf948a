"""The README's headline: the planner's longest sequence per recipe and cluster.

For each placement of the training state (``none``: on the GPU; ``optimizer``: ZeRO-3
offload_optimizer, as ALST's published runs and configs/llama3_8b_5m_8xh100.json) and each
recipe (``alst``: DeepSpeed ALST's recipe built from our code, fixed settings; ``ours``: the
planner's settings search over the ring x Ulysses factorizations,
:func:`arctic.plan.search.search`), the longest length that fits on ``--gpus`` x
``--nodes`` GPUs of 80 GiB (the device budget with the allocator headroom) and 2 TB of host
memory per node. Also records the table per factorization.

    python benchmarks/plan_headline.py --gpus 8 --nodes 1 [--stacks alst ours] \
        [--offload-state none optimizer] [--model llama3-70b] [--disk 30TB]

``--disk`` plans the ``offload_dir`` tier (issue 19) with that much NVMe per node.
Writes ``results/plan_headline_<G>x<K>[_<model>][_disk<size>].json``; published anchors are in the JSON for
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

from arctic.plan import STACKS, find_max, parse_bytes, plan  # noqa: E402
from arctic.plan.cli import search_table  # noqa: E402
from arctic.plan.launch import ulysses_block  # noqa: E402
from arctic.plan.models import model_config  # noqa: E402
from arctic.plan.search import search  # noqa: E402
from arctic.memory.placement import Placement  # noqa: E402

ANCHORS = {"alst_8xh100": 3_700_000, "alst_32xh100": 15_000_000, "upipe_8xh100": 5_000_000,
           "target_8x80gb": 6_500_000, "target_32": 24_000_000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", default="80GiB")
    p.add_argument("--host-memory", default="2TB")
    p.add_argument("--stacks", nargs="+", default=["alst", "ours"],
                   help="alst: its fixed recipe; ours: searched over ring x Ulysses")
    p.add_argument("--offload-state", nargs="+", default=["none", "optimizer"],
                   choices=["none", "optimizer", "optimizer+params"])
    p.add_argument("--start", default="4M")
    p.add_argument("--disk", default="0",
                   help="disk (NVMe) per node for the offload_dir tier (issue 19), e.g. 30TB; "
                        "default 0: none")
    args = p.parse_args()
    from arctic.plan import parse_tokens

    world = args.gpus * args.nodes
    config = model_config(args.model)
    tag = "" if args.model == "llama3-8b" else f"_{args.model}"
    disk = parse_bytes(args.disk)
    tag += f"_disk{args.disk}" if disk else ""
    out = REPO / "benchmarks" / "results" / f"plan_headline_{args.gpus}x{args.nodes}{tag}.json"
    record = {"model": args.model, "gpus": args.gpus, "nodes": args.nodes,
              "gpu_memory": args.gpu_memory, "host_memory_per_node": args.host_memory,
              "disk_per_node": args.disk,
              "anchors": ANCHORS, "runs": {}}
    for mode in args.offload_state:
        placement = Placement(mode, device_fixed=2 * 500_000_000 if mode != "none" else 0)
        for stack in args.stacks:
            start = time.perf_counter()
            name = f"{stack}/{mode}"
            print(f"{name}:", flush=True)

            def plan_with(n, fields):
                return plan(args.model, n, gpus=args.gpus, nodes=args.nodes, stack=fields,
                            gpu_memory=parse_bytes(args.gpu_memory), placement=placement,
                            host_memory=parse_bytes(args.host_memory), disk_memory=disk)

            log = lambda line: print(line, flush=True)  # noqa: E731
            fields = dict(STACKS[stack], sequence_parallel_size=world)
            if stack == "alst":
                best, tried = find_max(lambda n: plan_with(n, fields),
                                       start=parse_tokens(args.start), granule=1024 * world,
                                       log=log, tolerance=0.005)
                run = {"max_seq_len": best, "settings": ulysses_block(fields),
                       "tried": [e.as_dict() for e in tried]}
            else:
                winner, cands = search(plan_with, base=fields, sp_size=world,
                                       heads=(config.num_attention_heads,
                                              config.num_key_value_heads),
                                       start=parse_tokens(args.start), granule=1024 * world,
                                       log=log)
                table = search_table(cands, winner)
                print(table, flush=True)
                best = winner.best
                run = {"max_seq_len": best, "settings": ulysses_block(winner.fields),
                       "table": table,
                       "per_factorization": [{"ring": c.ring, "ulysses": c.ulysses,
                                              "variant": {k: v for k, v in c.fields.items()
                                                          if k != "ring_degree" and
                                                          fields.get(k) != v},
                                              "pruned": c.pruned, "max_seq_len": c.best,
                                              "stopped_below": c.below,
                                              "limit": c.limit()} for c in cands],
                       "at_max": winner.at_winner.as_dict() if winner.at_winner else None}
            run["search_s"] = round(time.perf_counter() - start)
            record["runs"][name] = run
            print(f"{name}: longest that fits {best:,} tokens ({run['search_s']} s)", flush=True)
            out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
