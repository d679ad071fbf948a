"""Benchmark: one gated delta net layer (Qwen3.5's) under sequence parallelism against the
unmodified layer on one process: per-rank peak memory and forward + backward time.

    torchrun --nproc_per_node 2 benchmarks/hybrid_layer.py [--seq 8192 --iters 3]

Every rank builds the same layer (``Qwen3_5GatedDeltaNet``, from ``--config``'s shapes,
random weights, fp32 on CPU, bf16 on a GPU) and the same input ``[1, S, E]``. Alternating, in
the same run:

- ``single``: rank 0 runs the stock layer on the whole sequence (the other ranks wait), or
  with ``--documents N`` on each of N packed documents alone;
- ``sp``: every rank runs the layer made sequence-parallel (``arctic.hf.mixers``) on its piece
  ``S / W`` (convolution with the previous rank's tail, delta rule head-sharded; state and
  window restarting at each document).

The model file's kernels run (transformers' torch fallback where flash-linear-attention and
causal-conv1d are not installed, theirs where they are: the run records which). Memory: the
peak of what one step allocates (MemTracker on CPU, which sees only allocations inside its
context; the CUDA allocator's peak on a GPU), the layer's parameters and the input tracked as
already there; the max over ranks for ``sp``. Time: medians of ``--iters`` alternating
rounds, each step timed as the max over ranks. The SP output and input gradient are checked
against the single run's (gathered). Writes ``results/hybrid_layer_<device>_w<W>.json``.
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

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arctic.hf.mixers import install_mixers, mixer_passing  # noqa: E402
from ulysses import SequenceParallelDims, gather_sequence, shard_sequence  # noqa: E402
from ulysses.torch_internals import step_mem_tracker  # noqa: E402

MIB = 2**20


def build(args, device, dtype):
    import transformers as tf
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = tf.Qwen3_5TextConfig(hidden_size=args.hidden, linear_num_value_heads=args.v_heads,
                                  linear_num_key_heads=args.k_heads,
                                  linear_key_head_dim=args.head_dim,
                                  linear_value_head_dim=args.head_dim,
                                  layer_types=["linear_attention"], num_hidden_layers=1)
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, 0).to(device, dtype), config


def kernels() -> dict:
    """Which kernels the model file runs: transformers resolves them when the file is imported
    (flash-linear-attention's and causal-conv1d's on a GPU where installed, else its torch
    fallback)."""
    import importlib.util

    from transformers.utils import import_utils as iu

    return {"fla": iu.is_flash_linear_attention_available(),
            "causal_conv1d": iu.is_causal_conv1d_available(),
            "fla_importable": importlib.util.find_spec("fla") is not None}


def documents_of(seq: int, count: int) -> tuple[int, ...] | None:
    """``count`` documents of near-equal lengths (None for one): their starts."""
    if count <= 1:
        return None
    return tuple(i * seq // count for i in range(count))


def step(layer, x, starts=None):
    """Forward and backward; with ``starts`` (the unmodified layer: one instance per document,
    sharing its parameters, since MemTracker follows one call of a module per step), each
    document alone."""
    x = x.detach().requires_grad_(True)
    if starts is None:
        out = layer(x)
    else:
        cuts = [*starts, x.shape[1]]
        out = torch.cat([m(x[:, a:b]) for m, a, b in zip(layer, cuts, cuts[1:])], dim=1)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def measure(layer, x, device, starts=None):
    for m in layer if starts is not None else [layer]:
        m.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t = time.perf_counter()
        out, dx = step(layer, x, starts)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t, torch.cuda.max_memory_allocated(device) - base, out, dx
    mt = step_mem_tracker()  # MemTracker, its step peak alone
    mt.track_external(*(layer[0] if starts is not None else layer).parameters(), x)
    with mt:
        t = time.perf_counter()
        out, dx = step(layer, x, starts)
        elapsed = time.perf_counter() - t
    peak = mt.get_tracker_snapshot("peak")[device]["Total"]
    return elapsed, peak, out, dx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--v-heads", type=int, default=8)
    p.add_argument("--k-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--documents", type=int, default=1,
                   help="packed documents of near-equal lengths (the reference runs each alone)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--mixer-parallelism", default="all_to_all",
                   choices=["all_to_all", "state_passing"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    mesh = SequenceParallelDims(world_size=world, ulysses_degree=world).build_mesh(device.type)

    single, _ = build(args, device, dtype)
    sp, _ = build(args, device, dtype)
    holder = _Holder(torch.nn.ModuleList([sp]))  # where the anatomy finds it in a model
    passing = mixer_passing(holder, mesh, args.mixer_parallelism)
    starts = documents_of(args.seq, args.documents)
    install_mixers(holder, mesh, _Documents(starts), frozenset(), passing)
    x = torch.randn(1, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(device, dtype)
    piece = shard_sequence(x, mesh).contiguous()

    reference = single
    if starts is not None:  # one instance per document, the same parameter tensors
        reference = torch.nn.ModuleList([single])
        for _ in starts[1:]:
            other, _ = build(args, device, dtype)
            other.load_state_dict(single.state_dict(), assign=True)
            reference.append(other)

    def run_single():
        if rank == 0:
            return measure(reference, x, device, starts)
        return 0.0, 0, None, None

    def run_sp():
        return measure(sp, piece, device)

    run_single(), run_sp()  # warm-up
    times = {"single": [], "sp": []}
    peaks = {"single": 0, "sp": 0}
    outputs = {}
    for _ in range(args.iters):
        for name, fn in (("single", run_single), ("sp", run_sp)):
            dist.barrier()
            elapsed, peak, out, dx = fn()
            t = torch.tensor([elapsed, float(peak)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t[0].item())
            peaks[name] = max(peaks[name], int(t[1].item()))
            outputs[name] = (out, dx)
    out_sp = gather_sequence(outputs["sp"][0], mesh)
    dx_sp = gather_sequence(outputs["sp"][1], mesh)
    if rank != 0:
        dist.destroy_process_group()
        return
    out, dx = outputs["single"]
    scale = max(out.abs().max().item(), 1e-30)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "world": world, "dtype": str(dtype),
        "shape": {"seq": args.seq, "hidden": args.hidden, "v_heads": args.v_heads,
                  "k_heads": args.k_heads, "head_dim": args.head_dim},
        "documents": list(starts or (0,)),
        "kernels": kernels(),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "peak_bytes": peaks,
        "peak_ratio_sp_over_single": peaks["sp"] / peaks["single"],
        "time_ratio_sp_over_single": statistics.median(times["sp"]) /
        statistics.median(times["single"]),
        "max_rel_diff": {"out": (out_sp.float() - out.float()).abs().max().item() / scale,
                         "dx": (dx_sp.float() - dx.float()).abs().max().item() /
                         max(dx.abs().max().item(), 1e-30)},
    }
    print(f"{'':8} {'median s':>10} {'peak MiB':>10}")
    for k in ("single", "sp"):
        print(f"{k:8} {result['median_s'][k]:10.3f} {peaks[k] / MIB:10.1f}")
    print(f"sp / single: time {result['time_ratio_sp_over_single']:.2f}x, "
          f"peak {result['peak_ratio_sp_over_single']:.2f}x; "
          f"max rel diff out {result['max_rel_diff']['out']:.2e}, "
          f"dx {result['max_rel_diff']['dx']:.2e}; kernels {result['kernels']}")
    out_path = args.out or REPO / "benchmarks" / "results" / \
        f"hybrid_layer_{'cuda' if cuda else 'cpu'}_w{world}.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    dist.destroy_process_group()


class _Documents:
    """The batch state the mixers read their documents from: fixed starts (the same on every
    rank and every call), or None for one document."""

    def __init__(self, starts):
        self.starts = starts

    def segments(self):
        return None if self.starts is None else [self.starts]


class _Holder(torch.nn.Module):
    """A stand-in for a model around the layer: what ``arctic.hf.mixers`` looks in."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers


if __name__ == "__main__":
    main()
