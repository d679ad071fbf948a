"""Benchmark: sliding-window attention, ours vs DeepSpeed's ``DistributedAttention`` with a
masked local SDPA (what a DeepSpeed user writes for Mistral-style windows).

Implementations, run alternately on the same inputs and output gradient (forward + backward):
- ``deepspeed_masked``: DeepSpeed's all-to-alls around ``F.scaled_dot_product_attention``
  with a boolean band mask ``[S, S]`` (causal, ``q - k < window``);
- ``ours_window``: ``ulysses_attention(..., window=w)`` (:mod:`ulysses.band`: about ``w``
  keys per query, no mask);
- ``ours_window_c1``: the same, head-chunked with ``head_chunk_size=1``;
- ``ours_causal``: plain causal attention without a window, for scale.

Outputs and input gradients of the windowed runs must match DeepSpeed's. Peak memory per
rank beyond the inputs: MemTracker on CPU, the CUDA allocator on GPU (as in
``benchmarks/attention.py``, whose helpers this script uses).

    torchrun --nproc_per_node 2 benchmarks/window.py [--seq 8192 --window 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention

from attention import DTYPES, MIB, TOLERANCE, gather_ints, init_distributed, make_inputs, run_all
from ulysses import SequenceParallelDims, ulysses_attention


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192, help="full sequence length S")
    p.add_argument("--window", type=int, default=1024, help="keys a query sees, itself included")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def make_impls(mesh, S: int, window: int, device) -> dict:
    i = torch.arange(S, device=device)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)   # [S_q, S_k]

    def masked_sdpa(q_BShD, k_BSkD, v_BSkD):
        return F.scaled_dot_product_attention(
            q_BShD.transpose(1, 2), k_BSkD.transpose(1, 2), v_BSkD.transpose(1, 2),
            attn_mask=band, enable_gqa=True).transpose(1, 2)

    ds_attn = DistributedAttention(masked_sdpa, mesh["ulysses"].get_group(), scatter_idx=2,
                                   gather_idx=1)
    return {
        "deepspeed_masked": lambda q, k, v: ds_attn(q, k, v, 0),
        "ours_window": lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True,
                                                         window=window),
        "ours_window_c1": lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True,
                                                            window=window, head_chunk_size=1),
        "ours_causal": lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True),
    }


def main() -> None:
    args = parse_args()
    device = init_distributed()
    world = dist.get_world_size()
    mesh = SequenceParallelDims(world, world).build_mesh(device.type)
    impls = make_impls(mesh, args.seq, args.window, device)
    inputs = make_inputs(args, mesh, device)
    times, memory, results = run_all(impls, inputs, args, device)
    tol = TOLERANCE[DTYPES[args.dtype]]
    diffs, ok = {}, True
    for name in ("ours_window", "ours_window_c1"):
        diffs[name] = {}
        for key, ours in results[name].items():
            d = (ours.float() - results["deepspeed_masked"][key].float()).abs().max()
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            diffs[name][key] = d.item()
            ok &= d.item() <= tol * (1 + results["deepspeed_masked"][key].abs().max().item())
    peaks = {name: max(gather_ints(m[0], device)) for name, m in memory.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                         if k != "local_rank"} | {"world_size": world},
              "device": device.type, "torch": torch.__version__, "times_s": times,
              "median_s": medians, "peak_bytes_max": peaks, "max_abs_diff": diffs,
              "outputs_match": ok}
    if dist.get_rank() == 0:
        print(f"\nW={world} B={args.batch} S={args.seq} window={args.window} H={args.heads} "
              f"K={args.kv_heads} D={args.head_dim} {args.dtype} iters={args.iters}")
        print(f"{'impl':<18} | {'median s':>9} | {'/ DS':>6} | {'peak MiB':>9} | {'/ DS':>6}")
        for name in impls:
            print(f"{name:<18} | {medians[name]:>9.3f} | "
                  f"{medians[name] / medians['deepspeed_masked']:>6.3f} | "
                  f"{peaks[name] / MIB:>9.1f} | {peaks[name] / peaks['deepspeed_masked']:>6.3f}")
        print(f"max abs diff vs DeepSpeed: {diffs}")
        out = args.out or (Path(__file__).parent / "results" /
                           f"window_{device.type}_w{world}_s{args.seq}_win{args.window}.json")
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
