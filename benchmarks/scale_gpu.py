"""One rank of a W-rank job on one real GPU: peak CUDA memory of a training step, to check the
memory planner (``python -m arctic.plan``) against ``torch.cuda.max_memory_allocated``.

torch's fake process group stands in for the other W-1 ranks: collectives return at once and
move no data, so the step runs rank 0's real CUDA kernels (flash attention over the full
sequence for its H/W heads, the projections, the tiled MLP and loss, FSDP2's gathered
layers, AdamW) on rank 0's real shapes. The values are garbage (nothing was exchanged); the
memory and the kernels are real. The code is the planner's own: ``arctic.plan.build`` and
``arctic.plan.train_step``.

    python benchmarks/scale_gpu.py --model llama3-8b --layers 2 --world 8 \\
        --tokens-per-rank 64K 256K 512K [--stack ours --stack ckpt-no-offload ...]

Issue 19's check, one rank of 8 at 1M tokens per rank, 1 layer, with sequence chunks and
the disk tier (a 1 GiB host limit, so the layer input spills):

    python benchmarks/scale_gpu.py --layers 1 --tokens-per-rank 1M --seq-chunk 8 \\
        --offload-dir /tmp/arctic-spill --host-limit-gib 1

For each stack and length: build, create AdamW's state, reset the peak, time one step, and
record ``max_memory_allocated`` (and ``max_memory_reserved``), the host pool's peak, and the
planner's prediction for the same settings when ``--plan`` is given (it traces on this
machine's CPU under FakeTensorMode). The allocator runs with expandable segments, as arctic's
launch paths set it (``--default-allocator`` to compare); ``--cap-gib`` caps the process's
CUDA memory, and an OOM in the step is recorded as a result. Writes
``results/scale_<gpu>_w<W>_l<layers>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arctic.plan import (STACKS, build, init_optimizer_state, make_batch, model_config,  # noqa
                         parse_tokens, stack_config, train_step)
from arctic.memory.allocator import use_expandable_segments  # noqa: E402
from ulysses import SequenceParallelDims  # noqa: E402
from ulysses.torch_internals import fake_store  # noqa: E402

GiB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--tokens-per-rank", nargs="+", default=["64K", "256K", "512K"])
    p.add_argument("--stack", action="append", choices=sorted(STACKS), default=None,
                   help="repeatable; default: ours")
    p.add_argument("--plan", action="store_true", help="also trace the planner for each run")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="cap this process's CUDA memory at this many GiB "
                        "(torch.cuda.set_per_process_memory_fraction): the real test of the "
                        "planner's \"fits\" (the step must complete at the planned peak plus "
                        "its allocator headroom, and OOM well above it)")
    p.add_argument("--default-allocator", action="store_true",
                   help="leave PYTORCH_CUDA_ALLOC_CONF alone (default: expandable segments, as "
                        "arctic's launch paths set it)")
    p.add_argument("--seq-chunk", default=None,
                   help="sequence blocks per rank's piece inside each head chunk "
                        "(ulysses.seq_chunk): an int or auto; default: the stack's")
    p.add_argument("--offload-dir", type=Path, default=None,
                   help="the disk tier's directory (ulysses.offload_dir; created): offloaded "
                        "layer inputs past --host-limit-gib spill there")
    p.add_argument("--host-limit-gib", type=float, default=96,
                   help="the activation offload pool's host limit (default 96)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.seq_chunk not in (None, "auto"):
        args.seq_chunk = int(args.seq_chunk)
    if args.offload_dir is not None:
        args.offload_dir.mkdir(parents=True, exist_ok=True)
    stacks = args.stack or ["ours"]
    if not torch.cuda.is_available():
        raise SystemExit("scale_gpu.py needs a CUDA device")
    alloc = "default" if args.default_allocator else use_expandable_segments()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if args.cap_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), device)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.world)
    mesh = SequenceParallelDims(world_size=args.world,
                                ulysses_degree=args.world).build_mesh("cuda")
    name = torch.cuda.get_device_name(device)
    out = args.out or REPO / "benchmarks" / "results" / \
        f"scale_{name.split()[1].lower()}_w{args.world}_l{args.layers}.json"
    record = {"model": args.model, "layers": args.layers, "world": args.world, "gpu": name,
              "torch": torch.__version__, "runs": []}
    allocator_conf = "default" if alloc == "default" else \
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if out.exists():  # several calls (sizes) add to one file
        record["runs"] = json.loads(out.read_text()).get("runs", [])
    for stack in stacks:
        for tokens in args.tokens_per_rank:
            s = parse_tokens(tokens)
            seq = s * args.world
            config = model_config(args.model, layers=args.layers, max_positions=seq)
            fields = dict(STACKS[stack])
            if args.seq_chunk is not None:
                fields["seq_chunk"] = args.seq_chunk
            if args.offload_dir is not None:
                fields["offload_dir"] = str(args.offload_dir)
            sp = stack_config(fields, world=args.world)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            model, optimizer = build(config, sp, mesh, device=device,
                                     host_memory_limit=int(args.host_limit_gib * GiB))
            init_optimizer_state(model, optimizer)
            batch = make_batch(seq, config.vocab_size, mesh, device)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            oom = None
            try:
                train_step(model, optimizer, batch)
                torch.cuda.synchronize()
            except torch.OutOfMemoryError as e:  # a result too: it does not fit
                oom = str(e).split(". GPU")[0]
            elapsed = time.perf_counter() - start
            run = {"stack": stack, "seq_chunk": args.seq_chunk,
                   "offload_dir": None if args.offload_dir is None else str(args.offload_dir),
                   "host_limit_gib": args.host_limit_gib,
                   "tokens_per_rank": s, "seq_len": seq, "oom": oom,
                   "cap_gib": args.cap_gib, "allocator": allocator_conf,
                   "max_memory_allocated": torch.cuda.max_memory_allocated(device),
                   "max_memory_reserved": torch.cuda.max_memory_reserved(device),
                   "allocated_before_step": before, "step_s": elapsed}
            session = getattr(model, "activation_offload", None)
            if session is not None:
                run["host_peak_bytes"] = session.pool.stats.peak_host_bytes
                run["disk_peak_bytes"] = session.pool.stats.peak_disk_bytes
            print(f"{stack:<18} s={s:>8} S={seq:>9}  max_allocated "
                  f"{run['max_memory_allocated'] / GiB:7.2f} GiB  reserved "
                  f"{run['max_memory_reserved'] / GiB:7.2f} GiB  host "
                  f"{run.get('host_peak_bytes', 0) / GiB:6.2f} GiB  step {elapsed:7.1f} s"
                  f"{'  OOM: ' + oom if oom else ''}",
                  flush=True)
            del model, optimizer, batch, session
            gc.collect()
            torch.cuda.empty_cache()
            record["runs"] = [r for r in record["runs"]
                              if (r["stack"], r["tokens_per_rank"], r.get("cap_gib"),
                                  r.get("allocator"), r.get("seq_chunk"),
                                  r.get("offload_dir")) != (stack, s, args.cap_gib,
                                                            allocator_conf, run["seq_chunk"],
                                                            run["offload_dir"])] + [run]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=2) + "\n")
            if os.environ.get("OUT"):
                (Path(os.environ["OUT"]) / out.name).write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
