"""The public API end to end: shard, Ulysses attention forward+backward, gather, check.

    torchrun --nproc_per_node 2 examples/quickstart.py
    deepspeed --num_gpus 2 examples/quickstart.py
    torchrun --nproc_per_node 4 examples/quickstart.py --ring-degree 2   # hybrid U=2 x R=2

Every rank builds the same full q/k/v from one seed and keeps its sequence piece. It runs
``ulysses_attention`` and gathers the output and the gradients, then checks them against
single-device attention on the full tensors.
"""

import argparse
import os

import torch
import torch.distributed as dist

from ulysses import (SequenceParallelDims, gather_sequence, local_attention, shard_sequence,
                     ulysses_attention)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=1001, help="full length; need not divide W")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ring-degree", type=int, default=1, help="R; Ulysses gets W // R")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    world, ring = dist.get_world_size(), args.ring_degree
    mesh = SequenceParallelDims(world, world // ring, ring).build_mesh(device.type)

    g = torch.Generator().manual_seed(0)
    B, S, H, K, D = 1, args.seq, args.heads, args.kv_heads, 64
    q_full = torch.randn(B, S, H, D, generator=g).to(device)
    k_full, v_full = (torch.randn(B, S, K, D, generator=g).to(device) for _ in range(2))

    # [B, S, H, D] -> [B, S_pad / W, H, D] (zigzag order when R > 1); the padded tail is
    # invisible to causal attention.
    q, k, v = (shard_sequence(t, mesh, dim=1, pad=True).detach().requires_grad_()
               for t in (q_full, k_full, v_full))
    out = ulysses_attention(q, k, v, mesh=mesh, causal=True)
    out.float().square().sum().backward()

    out_full = gather_sequence(out.detach(), mesh, dim=1, unpadded_len=S)
    dq_full = gather_sequence(q.grad, mesh, dim=1, unpadded_len=S)

    qr, kr, vr = (t.detach().requires_grad_() for t in (q_full, k_full, v_full))
    ref = local_attention(qr, kr, vr, causal=True)
    ref.square().sum().backward()
    err_out = (out_full - ref).abs().max().item()
    err_dq = (dq_full - qr.grad).abs().max().item()
    if dist.get_rank() == 0:
        print(f"W={world} (U={world // ring}, R={ring}) S={S} H={H} K={K}: "
              f"max |out - ref| = {err_out:.2e}, "
              f"max |dq - ref| = {err_dq:.2e}")
    torch.testing.assert_close(out_full, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dq_full, qr.grad, atol=1e-4, rtol=1e-4)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
