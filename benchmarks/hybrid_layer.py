"""Benchmark: one gated delta net layer (Qwen3.5's) under sequence parallelism, by the
all-to-all over heads and by state passing, against the unmodified layer on one process:
per-rank peak memory, forward + backward time and the bytes each rank sends.

    torchrun --nproc_per_node 2 benchmarks/hybrid_layer.py [--seq 8192 --iters 3]

Every rank builds the same layer (``Qwen3_5GatedDeltaNet``, from ``--config``'s shapes,
random weights, fp32 on CPU, bf16 on a GPU) and the same input ``[1, S, E]``. Alternating, in
the same run:

- ``single``: rank 0 runs the stock layer on the whole sequence (the other ranks wait), or
  with ``--documents N`` on each of N packed documents alone;
- ``all_to_all``: every rank runs the layer made sequence-parallel (``arctic.hf.mixers``) on
  its piece ``S / W`` (convolution with the previous rank's tail, delta rule head-sharded over
  the whole sequence; state and window restarting at each document);
- ``state``: the same, its delta rule on this rank's piece with every head, from the state
  the earlier pieces leave (``mixer_parallelism="state_passing"``, :mod:`ulysses.state_passing`);
- ``chunked`` (with ``--mixer-chunk N``): ``state`` with the layer run in sequence chunks
  of ``N`` positions, each checkpointed, the window and state carried between them
  (``mixer_chunk``, :mod:`arctic.hf.mixer_chunks`);
- ``state_loop`` (with ``--documents``): ``state`` with one kernel call per document, as
  before packed documents went in a few calls (:mod:`ulysses.packing`'s length groups made
  singletons for that step).

The model file's kernels run (transformers' torch fallback where flash-linear-attention and
causal-conv1d are not installed, theirs where they are: the run records which). With fla's
kernel resolved, ``state`` runs fla's own context parallelism (``fla.ops.cp``, one call per
rank; :mod:`arctic.hf.mixer_fla`). More ranks than GPUs (one GPU, two ranks) share the GPUs
over gloo, their collectives staged through host memory: the kernels' results are checked as
on separate GPUs, and the times compare the paths, not the speed-up. Memory: the
peak of what one step allocates (MemTracker on CPU, which sees only allocations inside its
context; the CUDA allocator's peak on a GPU), the layer's parameters and the input tracked as
already there; the max over ranks for the SP runs. Time: medians of ``--iters`` alternating
rounds, each step timed as the max over ranks. Bytes sent: per rank and step, what its
collectives hand to other ranks (an all-to-all: all but its own share, by its split sizes
where it has them; an all-gather: its part to each other rank; an all-reduce: twice ``(W -
1) / W`` of it, as a ring does). The SP outputs and input gradients are checked against the
single run's (gathered). Writes
``results/hybrid_layer_<device>_w<W>.json``.
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
from ulysses import packing  # noqa: E402
from ulysses.torch_internals import step_mem_tracker  # noqa: E402

MIB = 2**20
MODES = ("all_to_all", "state")


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


def fla_cp(mesh) -> bool:
    """Whether ``state`` runs by flash-linear-attention's own context parallelism (fla's
    kernel resolved for the model file, the mesh's layout one of fla's, one row)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as file

    from arctic.hf.mixer_fla import fla_kernel, fla_layout
    from arctic.hf.mixers import Dispatch

    scan = file.torch_chunk_gated_delta_rule
    scan = scan.original if isinstance(scan, Dispatch) else scan
    return fla_kernel("torch_chunk_gated_delta_rule", scan) is not None and \
        fla_layout(mesh) is not None


def documents_of(seq: int, count: int) -> tuple[int, ...] | None:
    """``count`` documents of near-equal lengths (None for one): their starts."""
    if count <= 1:
        return None
    return tuple(i * seq // count for i in range(count))


SENT = [0]
"""Bytes this rank's collectives sent since the last reset (:func:`count_sent`)."""


def count_sent() -> None:
    """Make torch.distributed's collectives add what this rank sends to :data:`SENT`."""
    world = dist.get_world_size

    def nbytes(t):
        return t.numel() * t.element_size()

    def sent(name, args, kwargs):
        group = kwargs.get("group")
        w = world(group)
        if name == "all_to_all_single":
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            if splits is None:
                return nbytes(args[1]) * (w - 1) // w
            row = nbytes(args[1]) // max(args[1].shape[0], 1) if args[1].dim() else 0
            mine = dist.get_rank(group)
            return row * sum(n for q, n in enumerate(splits) if q != mine)
        if name == "all_to_all":
            return sum(nbytes(t) for t in args[1]) * (w - 1) // w
        if name == "all_gather":
            return nbytes(args[1]) * (w - 1)
        if name == "all_reduce":
            return 2 * nbytes(args[0]) * (w - 1) // w
        return 0

    def counting(name, fn):
        def counted(*args, **kwargs):  # the collective's own arguments, passed on whole
            SENT[0] += sent(name, args, kwargs)
            return fn(*args, **kwargs)
        return counted

    for name in ("all_to_all_single", "all_to_all", "all_gather", "all_reduce"):
        setattr(dist, name, counting(name, getattr(dist, name)))


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
    p.add_argument("--mixer-chunk", type=int, default=None,
                   help="also run state passing with the layer in chunks of this many positions")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    local, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    shared = cuda and torch.cuda.device_count() < world  # the ranks take turns on the GPUs
    dist.init_process_group("nccl" if cuda and not shared else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    mesh = SequenceParallelDims(world_size=world, ulysses_degree=world).build_mesh(device.type)

    single, _ = build(args, device, dtype)
    starts = documents_of(args.seq, args.documents)
    sp = {}
    modes = MODES + (("chunked",) if args.mixer_chunk else ()) + \
        (("state_loop",) if args.documents > 1 else ())
    for mode in modes:
        sp[mode], _ = build(args, device, dtype)
        holder = _Holder(torch.nn.ModuleList([sp[mode]]))  # where the anatomy finds it
        passing = mixer_passing(holder, mesh, "all_to_all" if mode == "all_to_all" else
                                "state_passing")
        install_mixers(holder, mesh, _Documents(starts), frozenset(), passing,
                       args.mixer_chunk if mode == "chunked" else None)
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

    def run_loop():
        grouped = packing.length_groups
        packing.length_groups = lambda spans: [[i] for i in range(len(spans))]
        try:
            return measure(sp["state_loop"], piece, device)
        finally:
            packing.length_groups = grouped

    runs = {"single": run_single,
            **{mode: (lambda m=sp[mode]: measure(m, piece, device)) for mode in modes
               if mode != "state_loop"}}
    if "state_loop" in sp:
        runs["state_loop"] = run_loop
    names = list(runs)
    for fn in runs.values():  # warm-up
        fn()
    count_sent()
    times = {n: [] for n in names}
    peaks = {n: 0 for n in names}
    sent = {n: 0 for n in names}
    outputs = {}
    for _ in range(args.iters):
        for name, fn in runs.items():
            dist.barrier()
            SENT[0] = 0
            elapsed, peak, out, dx = fn()
            step_sent = SENT[0]
            t = torch.tensor([elapsed, float(peak), float(step_sent)], dtype=torch.float64,
                             device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t[0].item())
            peaks[name] = max(peaks[name], int(t[1].item()))
            sent[name] = int(t[2].item())
            outputs[name] = (out, dx)
    gathered = {mode: (gather_sequence(outputs[mode][0], mesh),
                       gather_sequence(outputs[mode][1], mesh)) for mode in modes}
    if rank != 0:
        dist.destroy_process_group()
        return
    out, dx = outputs["single"]
    scale = max(out.abs().max().item(), 1e-30)
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "world": world, "dtype": str(dtype),
        "shape": {"seq": args.seq, "hidden": args.hidden, "v_heads": args.v_heads,
                  "k_heads": args.k_heads, "head_dim": args.head_dim},
        "documents": list(starts or (0,)),
        "kernels": {**kernels(), "fla_cp": fla_cp(mesh)},
        "ranks_share_a_gpu": shared,
        "median_s": median,
        "peak_bytes": peaks,
        "sent_bytes_per_rank": sent,
        "time_ratio_over_single": {m: median[m] / median["single"] for m in modes},
        "peak_ratio_over_single": {m: peaks[m] / peaks["single"] for m in modes},
        "sent_ratio_state_over_all_to_all": sent["state"] / max(sent["all_to_all"], 1),
        "max_rel_diff": {m: {"out": (o.float() - out.float()).abs().max().item() / scale,
                             "dx": (g.float() - dx.float()).abs().max().item() /
                             max(dx.abs().max().item(), 1e-30)}
                         for m, (o, g) in gathered.items()},
    }
    print(f"{'':11} {'median s':>10} {'x single':>9} {'peak MiB':>10} {'x single':>9} "
          f"{'sent MiB':>10}")
    for k in names:
        print(f"{k:11} {median[k]:10.3f} {median[k] / median['single']:9.2f} "
              f"{peaks[k] / MIB:10.1f} {peaks[k] / peaks['single']:9.2f} {sent[k] / MIB:10.3f}")
    if "chunked" in median:
        result["mixer_chunk"] = args.mixer_chunk
        result["peak_ratio_chunked_over"] = {m: peaks["chunked"] / peaks[m]
                                             for m in ("all_to_all", "state")}
        print(f"mixer_chunk={args.mixer_chunk}: peak {result['peak_ratio_chunked_over']} of the "
              f"whole-piece paths'")
    if "state_loop" in median:
        result["time_ratio_state_over_state_loop"] = median["state"] / median["state_loop"]
        ratio = result["time_ratio_state_over_state_loop"]
        print(f"packed documents in length groups: {ratio:.3f}x the time of one call per "
              f"document")
    print(f"state passing sends {result['sent_ratio_state_over_all_to_all']:.4f}x the "
          f"all-to-all's bytes; max rel diff {result['max_rel_diff']}; kernels "
          f"{result['kernels']}")
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
