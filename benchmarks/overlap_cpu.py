"""Why chunk overlap cannot pay off on a 2-core CPU host: measure what there is to hide.

    torchrun --nproc_per_node 2 benchmarks/overlap_cpu.py [--seq 16384]

For the c=1 chunk exchange of the attention benchmark (one head per rank, fp32, D=64) it
times (1) one block exchange alone, (2) one chunk's attention kernel (fwd+bwd) alone, and
(3) the same kernel while exchanges are in flight (async gloo), alternating, and writes JSON.
Comm that can be hidden is at most (1) x exchanges per iteration; (3) - (2) is what running a
transfer beside the kernel costs the kernel on these cores.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ulysses.all_to_all import exchange_blocks_async
from ulysses.kernels import attention_backward, attention_forward


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overlap_cpu.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    W, S, D = dist.get_world_size(), args.seq, 64
    s = S // W
    x_sBD = torch.randn(s, 1, 1, D)                   # one head of this rank's piece
    q, k, v, dout = (torch.randn(1, S, 1, D) for _ in range(4))

    def exchange():
        exchange_blocks_async([x_sBD] * W, [(s, 1, 1, D)] * W, None).wait()

    def kernel():
        out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.125, backend="cpu_flash")
        attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.125,
                           backend="cpu_flash")

    def kernel_with_traffic(n=5):  # ~ a backward step's exchanges in flight during the kernel
        pend = [exchange_blocks_async([x_sBD] * W, [(s, 1, 1, D)] * W, None) for _ in range(n)]
        kernel()
        for p_ in pend:
            p_.wait()

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    exchange(), kernel()
    res = {"exchange": [], "kernel": [], "kernel_with_5_exchanges": []}
    for _ in range(args.reps):
        res["exchange"].append(statistics.median(timed(exchange) for _ in range(20)))
        res["kernel"].append(timed(kernel))
        res["kernel_with_5_exchanges"].append(timed(kernel_with_traffic))
    med = {k_: statistics.median(v_) for k_, v_ in res.items()}
    # c=1, Hq=32, Hkv=8, W=2: 16 steps; forward ~2.5 exchanges/step, backward ~5.
    per_iter = 16 * 7.5
    summary = {"seq": S, "world": W, "median_s": med, "exchanges_per_iteration": per_iter,
               "comm_s_per_iteration": med["exchange"] * per_iter,
               "kernel_s_per_iteration": med["kernel"] * 16,
               "kernel_slowdown_with_traffic_s": med["kernel_with_5_exchanges"] - med["kernel"],
               "hideable_fraction": med["exchange"] * per_iter / (med["kernel"] * 16)}
    if dist.get_rank() == 0:
        print(json.dumps(summary, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary | {"samples": res}, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
