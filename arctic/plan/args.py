"""``python -m arctic.plan``'s arguments (:func:`parse_args`) and the settings they give
(:func:`settings_from_args`: a named stack, or a DeepSpeed JSON, changed one flag at a time),
and whether the command searches them (:func:`searches`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from arctic.config import SequenceParallelConfig, load_ds_config, zero_stage
from arctic.memory.placement import MODES
from arctic.plan.estimate import ALLOCATOR_HEADROOM
from arctic.plan.models import MODELS
from arctic.plan.step import PLANNED_FIELDS, STACKS, check_plannable
from arctic.plan.units import parse_bytes, parse_tokens


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
                   help=f"one of {', '.join(MODELS)}, or a config.json path (default llama3-8b)")
    p.add_argument("--seq-len", type=_arg(parse_tokens), default=None,
                   help="tokens in one sequence (5000000, 4M, 512K); needed unless --find-max")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-memory", type=_arg(parse_bytes), default=parse_bytes("80GiB"),
                   help="memory of one GPU: 80GiB, 141GB (default 80GiB)")
    p.add_argument("--host-memory", type=_arg(parse_bytes), default=parse_bytes("1.5TiB"),
                   help="host memory of one node (default 1.5TiB)")
    p.add_argument("--disk", type=_arg(parse_bytes), default=0,
                   help="disk (NVMe) of one node for the offloaded layer inputs that host "
                        "memory cannot hold: the 'offload_dir' tier (default 0: none)")
    p.add_argument("--offload-dir", default=None,
                   help="with --disk: the directory the printed and written configs name as "
                        "'offload_dir' (needed by --write-config)")
    p.add_argument("--reserve", type=float, default=0.05,
                   help="fraction of GPU memory kept for the CUDA context and NCCL "
                        "(default 0.05)")
    p.add_argument("--allocator-headroom", type=float, default=ALLOCATOR_HEADROOM,
                   help="reserved / allocated bytes of the CUDA caching allocator: the "
                        "traced bytes must fit in the GPU's memory, less the reserve, divided "
                        f"by this (default {ALLOCATOR_HEADROOM}, measured on an H100 with "
                        "expandable_segments:True, which our launch paths set)")
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
    stack.add_argument("--seq-chunk", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="sequence blocks per rank's piece inside each head chunk "
                            "(ulysses.seq_chunk): an int, auto or none")
    stack.add_argument("--loss-tiles", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="logits + loss tiles: an int or auto")
    stack.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction,
                       default=None, help="q/k/v/o projections inside the head-chunk loop")
    stack.add_argument("--tiled-norms", action=argparse.BooleanOptionalAction, default=None,
                       help="tile the RMSNorms with the MLP")
    stack.add_argument("--tiled-layer", action=argparse.BooleanOptionalAction, default=None,
                       help="run each decoder layer's tail after attention (residual add, norm, "
                            "MLP, residual add) as one tiled unit (ulysses.tiled_layer)")
    stack.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                       help="checkpoint layers and offload their inputs to the host")
    stack.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None)
    stack.add_argument("--recompute-attention", action=argparse.BooleanOptionalAction,
                       default=None, help="--no-recompute-attention keeps each layer's attention "
                       "output and lse (on the host with --offload) instead of recomputing "
                       "attention in backward")
    stack.add_argument("--offload-state", choices=MODES, default=None,
                       help="where the optimizer state (and parameters) live: none (device), "
                            "optimizer (ZeRO-3 offload_optimizer), optimizer+params (and "
                            "offload_param), fsdp2 (FSDP2 CPUOffloadPolicy, train_fsdp.py "
                            "--offload-params); default: read from --ds-config, else none")
    p.add_argument("--layers", type=int, default=None,
                   help="override the decoder layer count (quick checks)")
    p.add_argument("--full-trace", action="store_true",
                   help="trace every layer instead of 3 and 4 layers extended to the real "
                        "depth (slower; the two agree, see tests/test_arctic_plan.py)")
    p.add_argument("--find-max", action="store_true",
                   help="the longest sequence that fits, searching the ring x Ulysses "
                        "factorizations unless --ring or --ulysses is given (or --no-search)")
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=None,
                   help="search the settings: with --seq-len, the fastest that fit (default "
                        "unless settings are given: --stack, --ds-config or any setting "
                        "below); with --find-max, the longest length (default unless --ring "
                        "or --ulysses is given)")
    p.add_argument("--rates", default=None,
                   help="the device's rates for the predicted step time: h100, h200, or a "
                        "file that --calibrate wrote (default h100)")
    p.add_argument("--no-step-time", action="store_true",
                   help="memory only: no predicted step time, and none of the work traces "
                        "it counts (faster); not with the settings search of --seq-len, "
                        "which ranks settings by their step time")
    p.add_argument("--calibrate", type=Path, default=None, metavar="RATES_JSON",
                   help="measure this machine's rates (CUDA if present, else CPU) as "
                        "--calibrate-world ranks use it, write them to RATES_JSON, and exit")
    p.add_argument("--calibrate-world", type=int, default=None,
                   help="ranks that measure at once (default: the GPUs, or 2 on a CPU)")
    p.add_argument("--trace-length", action="store_true",
                   help="trace the length itself instead of reading it off the length line "
                        "(slower; the two agree to 1%%, see tests/test_arctic_plan.py)")
    p.add_argument("--quick", action="store_true",
                   help="skip the trace that checks the length line (see arctic.plan.estimate)")
    p.add_argument("--write-config", type=Path, default=None,
                   help="write the chosen settings as a DeepSpeed JSON (--ds-config's, or a "
                        "ZeRO-3 bf16 one) with its 'ulysses' block")
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
        if (ds.get("ulysses") or {}).get("offload_dir") is not None:
            if not args.disk:
                raise ValueError("--ds-config sets ulysses.offload_dir: give --disk, its "
                                 "budget per node, to plan the disk tier")
            # The directory is the training nodes'; it need not exist where the plan is made,
            # nor need its I/O backend (offload_io) be usable here. Neither changes a byte.
            ds = dict(ds, ulysses={k: v for k, v in ds["ulysses"].items()
                                   if k not in ("offload_dir", "offload_io")})
        fields = SequenceParallelConfig.from_ds_config(ds, world_size=world)
        fields = {k: getattr(fields, k) for k in PLANNED_FIELDS}
        if searches(args):  # the JSON fixes the SP size (and the state); ours are searched
            fields = {**STACKS["ours"], "sequence_parallel_size": fields["sequence_parallel_size"]}
    else:
        fields = dict(STACKS[args.stack or "ours"])
    ring = args.ring if args.ring is not None else fields.get("ring_degree", 1)
    if args.ulysses is not None:
        fields["sequence_parallel_size"] = args.ulysses * ring
    fields["ring_degree"] = ring
    for arg, key in (("head_chunk", "head_chunk_size"), ("seq_chunk", "seq_chunk"),
                     ("tiled_mlp", "tiled_mlp"),
                     ("loss_tiles", "loss_tiles")):
        if hasattr(args, arg):
            fields[key] = getattr(args, arg)
    for arg in ("fuse_projections", "tiled_norms", "tiled_layer"):
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
    check_plannable(fields)
    SequenceParallelConfig(**{"sequence_parallel_size": world, **fields}).dims(world)
    if (args.disk or args.offload_dir) and not fields.get("offload_activations"):
        raise ValueError("--disk and --offload-dir plan the disk tier of offloaded layer "
                         "inputs: they need offload (the settings do not offload)")
    if args.offload_dir is not None and not args.disk:
        raise ValueError("--offload-dir needs --disk, the tier's budget per node")
    return fields


_SETTING_ARGS = ("stack", "ds_config", "ulysses", "ring", "head_chunk", "tiled_mlp", "seq_chunk",
                 "loss_tiles", "fuse_projections", "tiled_norms", "tiled_layer", "offload",
                 "checkpointing", "recompute_attention")
"""The command line's settings: given any, ``--seq-len`` plans them instead of searching."""


def settings_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, a, None) is not None for a in _SETTING_ARGS)


def searches(args: argparse.Namespace) -> bool:
    """Whether the command searches the settings (see ``--search``): from the least-memory
    ones, with a ``--ds-config``'s ZeRO stage, dtype, optimizer and SP size kept."""
    if args.find_max:
        return args.search if args.search is not None else (
            args.ring is None and args.ulysses is None)
    return args.seq_len is not None and (
        args.search if args.search is not None else not settings_given(args))
