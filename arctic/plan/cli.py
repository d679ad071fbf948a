"""``python -m arctic.plan``: the command line, its report, plot and JSON.

The flags read settings the way the training configs do (a named stack, or a DeepSpeed JSON
with our ``"ulysses"`` block), then change them one at a time; everything the CLI prints
comes from :func:`arctic.plan.estimate.plan` and :func:`arctic.plan.search.find_max`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arctic.config import SequenceParallelConfig, load_ds_config, zero_stage
from arctic.plan.estimate import Estimate, plan
from arctic.plan.models import MODELS, model_config
from arctic.plan.search import find_max
from arctic.plan.step import PLANNED_FIELDS, STACKS
from arctic.plan.units import GiB, format_gib, parse_bytes, parse_tokens


def _int_auto_none(text: str):
    low = text.lower()
    if low in ("none", "off", "no"):
        return None
    if low == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'auto' or 'none', got {text!r}")


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    convert.__name__ = parse.__name__
    return convert


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m arctic.plan",
        description="Trace one training step under FakeTensorMode and say whether it fits.")
    p.add_argument("--model", default="llama3-8b",
                   help=f"one of {', '.join(MODELS)}, or a config.json path")
    p.add_argument("--seq-len", type=_arg(parse_tokens), default=None,
                   help="tokens in one sequence (5000000, 4M, 512K); needed unless --find-max")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", type=_arg(parse_bytes), default=parse_bytes("80GiB"),
                   help="memory of one GPU (80GiB, 141GB)")
    p.add_argument("--host-memory", type=_arg(parse_bytes), default=parse_bytes("1.5TiB"),
                   help="host memory of one node")
    p.add_argument("--reserve", type=float, default=0.05,
                   help="fraction of GPU memory kept for the CUDA context, NCCL and "
                        "fragmentation (default 0.05)")
    stack = p.add_argument_group("settings (default: the 'ours' stack)")
    stack.add_argument("--stack", choices=sorted(STACKS), default=None,
                       help="a named stack; the flags below change it")
    stack.add_argument("--ds-config", type=Path, default=None,
                       help="a DeepSpeed JSON with our 'ulysses' block (ZeRO-3 is planned as "
                            "FSDP2: the same per-rank shards)")
    stack.add_argument("--ulysses", type=int, default=None, help="Ulysses degree")
    stack.add_argument("--ring", type=int, default=None, help="ring degree")
    stack.add_argument("--head-chunk", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="query heads per chunk: an int, auto or none")
    stack.add_argument("--tiled-mlp", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="MLP tiles: an int, auto or none")
    stack.add_argument("--loss-tiles", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="logits + loss tiles: an int or auto")
    stack.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction,
                       default=None, help="q/k/v/o projections inside the head-chunk loop")
    stack.add_argument("--tiled-norms", action=argparse.BooleanOptionalAction, default=None,
                       help="tile the RMSNorms with the MLP")
    stack.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                       help="checkpoint layers and offload their inputs to the host")
    stack.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None)
    stack.add_argument("--recompute-attention", action=argparse.BooleanOptionalAction,
                       default=None, help="--no-recompute-attention keeps each layer's attention "
                       "output and lse (on the host with --offload) instead of recomputing "
                       "attention in backward")
    p.add_argument("--layers", type=int, default=None,
                   help="override the decoder layer count (quick checks)")
    p.add_argument("--full-trace", action="store_true",
                   help="trace every layer instead of 3 and 4 layers extended to the real "
                        "depth (slower; the two agree, see tests/test_arctic_plan.py)")
    p.add_argument("--find-max", action="store_true",
                   help="bisect for the longest sequence that fits")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of peak memory against sequence length: these settings, plain "
                        "Ulysses, ALST-style and ours (needs matplotlib)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict:
    """The stack's SequenceParallelConfig fields from the command line."""
    world = args.gpus * args.nodes
    if args.ds_config is not None:
        if args.stack is not None:
            raise ValueError("give --stack or --ds-config, not both")
        ds = load_ds_config(args.ds_config)
        stage = zero_stage(ds)
        if stage not in (0, 3):
            raise ValueError(f"--ds-config has ZeRO stage {stage}: the planner plans full "
                             f"sharding (ZeRO-3 or FSDP2); use stage 3")
        zero = ds.get("zero_optimization")
        if isinstance(zero, dict) and (zero.get("offload_optimizer") or zero.get("offload_param")):
            print("note: the config offloads the optimizer or parameters to the host; the "
                  "planner keeps them on the GPU (FSDP2 shards), so its device peak is an "
                  "upper bound", file=sys.stderr)
        fields = SequenceParallelConfig.from_ds_config(ds, world_size=world)
        fields = {k: getattr(fields, k) for k in PLANNED_FIELDS}
    else:
        fields = dict(STACKS[args.stack or "ours"])
    ring = args.ring if args.ring is not None else fields.get("ring_degree", 1)
    if args.ulysses is not None:
        fields["sequence_parallel_size"] = args.ulysses * ring
    fields["ring_degree"] = ring
    for arg, key in (("head_chunk", "head_chunk_size"), ("tiled_mlp", "tiled_mlp"),
                     ("loss_tiles", "loss_tiles")):
        if hasattr(args, arg):
            fields[key] = getattr(args, arg)
    for arg in ("fuse_projections", "tiled_norms"):
        if getattr(args, arg) is not None:
            fields[arg] = getattr(args, arg)
    if args.checkpointing is not None:
        fields["activation_checkpointing"] = args.checkpointing
        if not args.checkpointing:
            fields["offload_activations"] = False
            fields["recompute_attention"] = True
    if args.recompute_attention is not None:
        fields["recompute_attention"] = args.recompute_attention
        if not args.recompute_attention:
            fields["activation_checkpointing"] = True
    if args.offload is not None:
        fields["offload_activations"] = args.offload
        if args.offload:
            fields["activation_checkpointing"] = True
    SequenceParallelConfig(**{"sequence_parallel_size": world, **fields}).dims(world)
    return fields


def report(e: Estimate) -> str:
    """The estimate as the CLI prints it: the peak by kind, what is largest at it, the verdict."""
    lines = [f"{e.model}, {e.seq_len:,} tokens on {e.world} GPUs "
             f"({e.world // e.gpus_per_node} node(s) x {e.gpus_per_node}): "
             f"{e.seq_len // e.sp['sequence_parallel_size']:,} tokens per rank",
             "settings: " + ", ".join(f"{k}={v}" for k, v in e.sp.items()),
             f"per-rank device peak {format_gib(e.peak.total)}  "
             f"(budget {format_gib(e.device_budget)})"]
    lines += [f"  {kind:<18}{format_gib(v)}" for kind, v in e.peak.by_kind.items()]
    if e.peak.largest:
        lines.append(f"largest at the peak ({e.peak_phase}):")
        lines += [f"  {b / GiB:8.2f} GiB in {c:>3} tensor(s): {label}"
                  for label, c, b in e.peak.largest]
    lines.append(f"host, offloaded      {format_gib(e.peak.host)}  "
                 f"(budget {format_gib(e.host_budget)} per "
                 f"rank: 80% of the node's memory / {e.gpus_per_node})")
    verdict = "FITS" if e.fits else f"DOES NOT FIT (limit: {e.limit()})"
    lines.append(f"verdict: {verdict}   [traced in {e.trace_s:.0f} s]")
    return "\n".join(lines)


def plot(path: Path, series: dict[str, list[Estimate]], *, budget: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, estimates in series.items():
        pts = sorted((e.seq_len, e.peak.total) for e in estimates if e.refused is None)
        ax.plot([p[0] / 1e6 for p in pts], [p[1] / GiB for p in pts], marker="o", label=name)
    ax.axhline(budget / GiB, color="k", linestyle="--", linewidth=1, label="device budget")
    ax.set_xlabel("sequence length (M tokens)")
    ax.set_ylabel("per-rank peak device memory (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    try:
        return _main(parse_args(argv))
    except ValueError as e:  # bad settings: say what, no traceback
        raise SystemExit(f"error: {e}")


def _main(args: argparse.Namespace) -> int:
    if args.seq_len is None and not args.find_max:
        raise SystemExit("give --seq-len, or --find-max")
    fields = settings_from_args(args)
    model_config(args.model, layers=args.layers)  # an unknown model fails here, not mid-way
    world = args.gpus * args.nodes
    common = dict(gpus=args.gpus, nodes=args.nodes, gpu_memory=args.gpu_memory,
                  host_memory=args.host_memory, reserve=args.reserve, layers=args.layers,
                  full_trace=args.full_trace)

    def plan_at(n: int, stack=fields) -> Estimate:
        return plan(args.model, n, stack=stack, **common)

    result: dict = {"model": args.model, "gpus": args.gpus, "nodes": args.nodes,
                    "gpu_memory": args.gpu_memory, "host_memory": args.host_memory}
    estimates: list[Estimate] = []
    if args.seq_len is not None:
        e = plan_at(args.seq_len)
        estimates.append(e)
        print(report(e))
        result["estimate"] = e.as_dict()
    if args.find_max:
        sp = fields.get("sequence_parallel_size", world)
        print(f"finding the longest sequence that fits ({args.model}, {world} GPUs):")
        best, tried = find_max(plan_at, start=args.seq_len or 1 << 20, granule=1024 * sp)
        estimates += tried
        print(f"longest that fits: {best:,} tokens ({best / 1e6:.2f}M)")
        result["max_seq_len"] = best
        result["tried"] = [e.as_dict() for e in tried]
    if args.plot is not None:
        top = max(e.seq_len for e in estimates)
        lengths = sorted({max(1024 * world, int(top * f) // (1024 * world) * 1024 * world)
                          for f in (0.25, 0.5, 0.75, 1.0)})
        series = {"these settings": [e for e in estimates if e.seq_len in lengths]}
        for name in ("ulysses", "alst", "ours"):
            series[name] = [plan_at(n, STACKS[name]) for n in lengths]
        for n in lengths:
            if not any(e.seq_len == n for e in series["these settings"]):
                series["these settings"].append(plan_at(n))
        plot(args.plot, series, budget=int(args.gpu_memory * (1 - args.reserve)),
             title=f"{args.model}, {world} x {args.gpu_memory / GiB:.0f} GiB")
        print(f"wrote {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
