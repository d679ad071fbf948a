"""Benchmark: ring and hybrid Ulysses x Ring attention, zigzag vs contiguous, and the peers.

On W ranks (default run: 4), causal fwd+bwd of the same full q/k/v/dout, each implementation
sharding them its own way:

- ours at every (U, R) with U x R = W, from (W, 1) (pure Ulysses) to (1, W) (pure ring),
  zigzag; and (1, W) with the contiguous layout;
- DeepSpeed's ``DistributedAttention`` (Ulysses, U = W) around SDPA;
- torch's ``context_parallel`` ring attention (R = W, its head-tail load balancing). On CPU it
  has no handler for ``aten._scaled_dot_product_flash_attention_for_cpu``
  (``_context_parallel/_attention.py`` dispatches the CUDA flash/efficient/cudnn ops only), so
  this script registers one: torch's own ``_templated_ring_attention`` (and backward) around
  the CPU flash op. Its gloo kv rotation is all-gather.

They run alternately in the same run. Reported per implementation:
- ``median_s``: wall time of one fwd+bwd, max over ranks;
- ``busy_s``: main-thread CPU time per rank (threads/rank = 1 here, so this is the rank's own
  compute; gloo's threads are not counted); ``imbalance`` = max / min over ranks;
- peak memory per rank beyond the inputs (MemTracker on CPU, the CUDA allocator on GPU);
- max abs difference of the gathered out/dq/dk/dv against ours at (W, 1).

Oversubscribed hosts (more ranks than cores) time-slice the ranks, so wall time follows the
total work of all ranks, which zigzag does not change (it moves work, it does not remove
it). ``busy_s`` max over ranks is what a host with a core per rank waits for.

    torchrun --nproc_per_node 4 benchmarks/ring.py [--seq 16384 --heads 32 --kv-heads 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses import SequenceParallelDims, gather_sequence, shard_sequence, ulysses_attention
from ulysses.torch_internals import context_parallel_internals, step_mem_tracker


MIB = 2**20
NAMES = ("q", "k", "v", "dout")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16384, help="full sequence length S")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3, help="timed rounds (after a memory round)")
    p.add_argument("--peers", default="deepspeed,torch_cp",
                   help="comma list of peers to include: deepspeed, torch_cp (or empty)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# --- implementations -------------------------------------------------------------------------
# Each has ``ready(full)``: a context yielding its local inputs (sharding is not timed),
# ``attend(q, k, v)``, and ``unshard(x)``: the full [B, S, H, D] tensor from local pieces.

class Ours:
    def __init__(self, world: int, ulysses: int, ring: int, zigzag: bool, device) -> None:
        self.mesh = SequenceParallelDims(world, ulysses, ring, zigzag).build_mesh(device.type)

    @contextmanager
    def ready(self, full):
        yield {n: shard_sequence(full[n], self.mesh).contiguous()
               for n in NAMES}

    def attend(self, q, k, v):
        return ulysses_attention(q, k, v, mesh=self.mesh, causal=True)

    def unshard(self, x):
        return gather_sequence(x, self.mesh)


class DeepSpeedUlysses(Ours):
    """``deepspeed.sequence.layer.DistributedAttention`` over all W ranks, SDPA inside."""

    def __init__(self, world: int, device) -> None:
        import deepspeed.comm
        from deepspeed.sequence.layer import DistributedAttention

        super().__init__(world, world, 1, True, device)
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend())

        def local_sdpa(q_BShD, k_BSkD, v_BSkD):
            return F.scaled_dot_product_attention(
                q_BShD.transpose(1, 2), k_BSkD.transpose(1, 2), v_BSkD.transpose(1, 2),
                is_causal=True, enable_gqa=True).transpose(1, 2)

        self.layer = DistributedAttention(local_sdpa, self.mesh["ulysses"].get_group(),
                                          scatter_idx=2, gather_idx=1)

    def attend(self, q, k, v):
        return self.layer(q, k, v, 0)


def _register_cpu_flash_for_context_parallel():
    """Give torch's context parallelism a handler for the CPU flash op: its own templated
    ring attention (forward and backward) around that op, sequence dim 2 of [B, H, S, D]."""
    from torch.distributed.tensor import DTensor, Shard

    cp = context_parallel_internals()[0]

    aten = torch.ops.aten

    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    def wrap(mesh, *tensors):
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)

    def forward(op_call, args, kwargs):
        mesh = next(a for a in args if isinstance(a, DTensor)).device_mesh
        q, k, v, *rest = (local(a) for a in args)
        causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        out, lse = cp._templated_ring_attention(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
            query=q, key=k, value=v, is_causal=causal, dropout_p=0.0, scale=kwargs.get("scale"))
        return wrap(mesh, out, lse)

    def backward(op_call, args, kwargs):
        mesh = next(a for a in args if isinstance(a, DTensor)).device_mesh
        dout, q, k, v, out, lse, dropout_p, causal = (local(a) for a in args)
        grads = cp._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
        return wrap(mesh, *grads)

    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward


class TorchContextParallel:
    """``torch.distributed.tensor.experimental.context_parallel`` over all W ranks."""

    def __init__(self, world: int, device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        context_parallel_unshard = context_parallel_internals()[1]

        if device.type == "cpu":
            _register_cpu_flash_for_context_parallel()
        self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        self._context_parallel, self._unshard = context_parallel, context_parallel_unshard

    @contextmanager
    def ready(self, full):
        # [B, S, H, D] -> [B, H, S, D]; the context shards these buffers in place (and
        # restores them on exit), in its load-balanced order.
        bufs = [full[n].transpose(1, 2).contiguous() for n in NAMES]
        with self._context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[2] * 4):
            yield dict(zip(NAMES, bufs))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def unshard(self, x):
        return self._unshard(self.mesh, [x.contiguous()], [2])[0].transpose(1, 2)


def make_impls(world: int, peers: list[str], kv_heads: int, device) -> dict:
    impls = {}
    if "deepspeed" in peers and kv_heads < world:
        # DeepSpeed asserts on fewer kv heads than ranks (it does not replicate them).
        print(f"skipping deepspeed: kv_heads ({kv_heads}) < world ({world})", flush=True)
        peers = [p for p in peers if p != "deepspeed"]
    for u in sorted({d for d in range(1, world + 1) if world % d == 0}, reverse=True):
        impls[f"ours_u{u}r{world // u}"] = Ours(world, u, world // u, True, device)
    impls[f"ours_u1r{world}_contiguous"] = Ours(world, 1, world, False, device)
    if "deepspeed" in peers:
        impls[f"deepspeed_u{world}"] = DeepSpeedUlysses(world, device)
    if "torch_cp" in peers:
        impls[f"torch_cp_r{world}"] = TorchContextParallel(world, device)
    return impls


# --- measurement -----------------------------------------------------------------------------

def fwd_bwd(impl, local) -> dict:
    q, k, v = (local[n].detach().requires_grad_() for n in ("q", "k", "v"))
    out = impl.attend(q, k, v)
    out.backward(local["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def peak_beyond_inputs(impl, local, device) -> tuple[int, dict]:
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        res = fwd_bwd(impl, local)
        return torch.cuda.max_memory_allocated(device) - base, res
    mt = step_mem_tracker()  # MemTracker, its step peak alone
    mt.track_external(*local.values())
    with mt:
        base = mt.get_tracker_snapshot("current")[device]["Total"]
        res = fwd_bwd(impl, local)
    return mt.get_tracker_snapshot("peak")[device]["Total"] - base, res


def all_ranks(value: float, device) -> list[float]:
    out = [torch.zeros((), dtype=torch.float64, device=device)
           for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(float(value), dtype=torch.float64, device=device))
    return [t.item() for t in out]


def run(impls: dict, full: dict, iters: int, device) -> dict:
    """A memory + correctness round, then ``iters`` alternating timed rounds."""
    rec = {name: {"wall_s": [], "busy_s": []} for name in impls}
    ref = None
    for name, impl in impls.items():
        with impl.ready(full) as local:
            peak, res = peak_beyond_inputs(impl, local, device)
            gathered = {n: impl.unshard(t) for n, t in res.items()}
        rec[name]["peak_bytes_per_rank"] = [int(p) for p in all_ranks(peak, device)]
        ref = ref or gathered
        rec[name]["max_abs_diff_vs_first"] = {
            n: max(all_ranks((gathered[n].float() - ref[n].float()).abs().max(), device))
            for n in gathered}
        del res, gathered
    for _ in range(iters):
        for name, impl in impls.items():
            with impl.ready(full) as local:
                sync(device)
                wall, busy = time.perf_counter(), time.thread_time()
                fwd_bwd(impl, local)
                busy = time.thread_time() - busy
                sync(device)
                wall = time.perf_counter() - wall
            rec[name]["wall_s"].append(max(all_ranks(wall, device)))
            rec[name]["busy_s"].append(all_ranks(busy, device))
    for r in rec.values():
        r["median_s"] = statistics.median(r["wall_s"])
        per_rank = [statistics.median(col) for col in zip(*r["busy_s"])]
        r["busy_median_per_rank_s"] = per_rank
        r["busy_max_s"] = max(per_rank)
        r["imbalance"] = max(per_rank) / min(per_rank)
        r["peak_bytes_max"] = max(r["peak_bytes_per_rank"])
    return rec


def acceptance(rec: dict, world: int) -> dict:
    zig, flat = rec[f"ours_u1r{world}"], rec[f"ours_u1r{world}_contiguous"]
    checks = {
        "zigzag_time_over_contiguous": (zig["median_s"] / flat["median_s"], 0.8),
        "zigzag_imbalance": (zig["imbalance"], 1.15),
        "zigzag_busy_max_over_contiguous": (zig["busy_max_s"] / flat["busy_max_s"], 0.8),
    }
    return {k: {"value": v, "bar": bar, "pass": v <= bar} for k, (v, bar) in checks.items()}


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    peers = [p for p in args.peers.split(",") if p]
    impls = make_impls(world, peers, args.kv_heads, device)

    gen = torch.Generator().manual_seed(0)
    B, S, H, K, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    shapes = {"q": (B, S, H, D), "k": (B, S, K, D), "v": (B, S, K, D), "dout": (B, S, H, D)}
    with torch.no_grad() if device.type == "cpu" else nullcontext():
        full = {n: torch.randn(s, generator=gen).to(device) for n, s in shapes.items()}
    rec = run(impls, full, args.iters, device)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k != "local_rank"} | {"world_size": world, "dtype": "fp32",
                                            "causal": True},
        "device": device.type,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"{platform.processor() or platform.machine()}, "
                             f"{os.cpu_count()} cores, {torch.get_num_threads()} threads/rank"),
        "torch": torch.__version__,
        "impls": rec,
        "acceptance": acceptance(rec, world),
    }
    if dist.get_rank() == 0:
        print(f"\nconfig: W={world} B={B} S={S} H={H} K={K} D={D} fp32 causal "
              f"iters={args.iters} device={record['device_name']}")
        base = rec[f"ours_u{world}r1"]
        print(f"{'impl':<22} | {'median s':>8} | {'/ u' + str(world) + 'r1':>7} | "
              f"{'busy max s':>10} | {'imbalance':>9} | {'peak MiB':>8} | max |diff|")
        for name, r in rec.items():
            print(f"{name:<22} | {r['median_s']:>8.2f} | {r['median_s'] / base['median_s']:>7.3f}"
                  f" | {r['busy_max_s']:>10.2f} | {r['imbalance']:>9.3f} | "
                  f"{r['peak_bytes_max'] / MIB:>8.1f} | "
                  f"{max(r['max_abs_diff_vs_first'].values()):.1e}")
        for name, c in record["acceptance"].items():
            print(f"{'PASS' if c['pass'] else 'FAIL'}  {name} = {c['value']:.3f} (bar {c['bar']})")
        out = args.out or (Path(__file__).parent / "results" /
                           f"ring_{device.type}_w{world}_s{S}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
