"""``python -m arctic.plan``: the command line, its report, plot and JSON.

The flags read settings the way the training configs do (a named stack, or a DeepSpeed JSON
with our ``"ulysses"`` block), then change them one at a time; everything the CLI prints
comes from :func:`arctic.plan.estimate.plan` and :func:`arctic.plan.search.find_max`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from arctic.config import SequenceParallelConfig, load_ds_config
from arctic.hf.anatomy import text_config_of
from arctic.memory.placement import Placement, placement_from_ds_config
from arctic.plan.args import (  # noqa: F401 - parse_args, settings_from_args: the package's
    parse_args,
    searches,
    settings_from_args,
)
from arctic.plan.counts import predict_step, prefetch_work
from arctic.plan.estimate import Estimate, plan
from arctic.plan.launch import command_lines, ulysses_block, write_config, written_placement
from arctic.plan.models import model_config, token_mixer_heads, unsupported_settings
from arctic.plan.fastest import fastest
from arctic.plan.search import MIXER_CHUNK, find_max, search
from arctic.plan.speed import calibrate, rates_from
from arctic.plan.step import STACKS, stack_config
from arctic.plan import traces
from arctic.plan.traces import held_summary
from arctic.plan.workers import start_workers
from arctic.plan.units import GiB, format_gib


def prediction_line(e: Estimate) -> str:
    """The predicted step time, throughput and MFU, and where the time goes."""
    p = e.prediction
    parts = sorted(p.by_class_s.items(), key=lambda kv: -kv[1])
    return (f"predicted step {p.step_s:.2f} s ({p.rates} rates): "
            f"{p.tokens_per_s:,.0f} tokens/s per sequence, MFU {p.mfu:.1%}; "
            + ", ".join(f"{k} {v:.2f} s" for k, v in parts if v >= 0.005 * p.step_s))


def report(e: Estimate) -> str:
    """The estimate as the CLI prints it: the peak by kind, what is largest at it, the verdict."""
    lines = [f"{e.model}, {e.seq_len:,} tokens on {e.world} GPUs "
             f"({e.world // e.gpus_per_node} node(s) x {e.gpus_per_node}): "
             f"{e.seq_len // e.sp['sequence_parallel_size']:,} tokens per rank",
             "settings: " + ", ".join(f"{k}={v}" for k, v in e.sp.items()),
             f"per-rank device peak {format_gib(e.peak.total)}  "
             f"(budget {format_gib(e.device_budget)}: the GPU less the reserve, / "
             f"{e.headroom:g} allocator headroom)",
             f"how: {e.method}"]
    if e.placement.offloaded:
        lines.append(f"training state offloaded ({e.placement.mode}): "
                     f"{e.placement.device_bytes(e.peak.shard_params) / GiB:.2f} GiB stays on "
                     f"the device, {e.state_host / GiB:.2f} GiB on the host")
    lines += [f"  {kind:<18}{format_gib(v)}" for kind, v in e.peak.by_kind.items()]
    if e.peak.largest:
        lines.append(f"largest at the peak ({e.peak_phase}):")
        lines += [f"  {b / GiB:8.2f} GiB in {c:>3} tensor(s): {label}"
                  for label, c, b in e.peak.largest]
    lines.append(f"host, offloaded      {format_gib(e.peak.host)}  "
                 f"(budget {format_gib(e.host_budget)} per "
                 f"rank: 80% of the node's memory / {e.gpus_per_node}; layer inputs"
                 f"{' and training state' if e.state_host else ''})")
    if e.disk_budget:
        lines.append(f"  of it on disk      {format_gib(e.disk)}  (budget "
                     f"{format_gib(e.disk_budget)} per rank: --disk / {e.gpus_per_node}; "
                     f"whole layers past the host limit)")
    lines += [f"note: {note}" for note in e.notes]
    if e.prediction is not None:
        lines.append(prediction_line(e))
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
    del traces.HELD[:]  # this answer's warnings only (a process may answer several)
    try:
        args = parse_args(argv)
        start_workers()  # the tracers' imports run while this process reads the model
        return _main(args)
    except ValueError as e:  # bad settings: say what, no traceback
        raise SystemExit(f"error: {e}")
    finally:
        print_held()


def print_held() -> None:
    """The tracing's warnings (:data:`arctic.plan.traces.HELD`) on stderr: one line, or with
    ``ARCTIC_PLAN_WARNINGS=1`` each distinct one."""
    if os.environ.get("ARCTIC_PLAN_WARNINGS") == "1":
        for line in dict.fromkeys(traces.HELD):
            print(f"warning: {line}", file=sys.stderr)
    elif (line := held_summary()) is not None:
        print(line, file=sys.stderr)


def _placement(args: argparse.Namespace) -> Placement:
    if args.offload_state is not None:
        if args.offload_state == "none" or args.ds_config is None:  # as written
            return written_placement(args.offload_state, args.gpus * args.nodes)
        from_config = placement_from_ds_config(load_ds_config(args.ds_config))
        if from_config.mode != args.offload_state:
            raise ValueError(f"--offload-state {args.offload_state} contradicts --ds-config's "
                             f"zero_optimization ({from_config.mode}); drop one")
        return from_config
    if args.ds_config is not None:
        return placement_from_ds_config(load_ds_config(args.ds_config))
    return Placement()


def _attention_heads(config) -> tuple[int | None, int | None]:
    """The text config's query and kv heads; ``(None, None)`` without attention (Mamba2)."""
    text = text_config_of(config)
    heads = getattr(text, "num_attention_heads", None)
    return heads, getattr(text, "num_key_value_heads", None) or heads


UNSUPPORTED_OFF = {"fuse_projections": (False, "fuse_projections"),
                   "tiled_layer": (False, "tiled_layer"),
                   "head_chunk_size": (None, "head_chunk"), "seq_chunk": (None, "seq_chunk"),
                   "tiled_mlp": (None, "tiled_mlp")}
"""A setting the model does not support (:func:`unsupported_settings`) -> what a named stack
takes instead, and the command-line argument that, given, keeps the user's value (the
recipe then refuses it by name)."""


def _main(args: argparse.Namespace) -> int:
    if args.calibrate is not None:
        return _calibrate(args)
    if args.seq_len is None and not args.find_max:
        raise SystemExit("give --seq-len, or --find-max")
    if args.no_step_time and args.rates is not None:
        raise ValueError(f"--rates {args.rates} with --no-step-time: the rates time the step "
                         "that --no-step-time leaves out; give one or the other")
    if args.no_step_time and args.seq_len is not None and not args.find_max and searches(args):
        raise ValueError("--no-step-time with the settings search: the search ranks settings "
                         "by their predicted step time; give settings (--stack, --ds-config "
                         "or a setting) or --no-search")
    rates = rates_from(args.rates or "h100")  # a bad --rates fails before any trace
    step_rates = None if args.no_step_time else rates
    fields = settings_from_args(args)
    placement = _placement(args)
    # The disk tier's directory for the printed and written config, checked before any trace.
    disk_dir = _disk_dir(args)
    if args.disk and args.write_config is not None and disk_dir is None:
        raise ValueError("--write-config with --disk: give --offload-dir, the directory the "
                         "written config names as offload_dir")
    config = model_config(args.model, layers=args.layers)  # an unknown model fails here
    if args.ds_config is None or searches(args):  # off what the model does not support
        for key, why in unsupported_settings(config).items():
            off, arg = UNSUPPORTED_OFF[key]
            if fields.get(key) not in (None, False) and getattr(args, arg, None) is None:
                fields[key] = off
                print(f"note: {key}={off}: {why}")
    if searches(args) and fields.get("mixer_chunk") is None and \
            fields.get("mixer_parallelism", "auto") != "all_to_all" and token_mixer_heads(config):
        fields["mixer_chunk"] = MIXER_CHUNK  # the least memory; the descent may take it back
        print(f"note: mixer_chunk={MIXER_CHUNK}: the search starts from the hybrid's mixer "
              f"layers in sequence chunks, which hold the least memory")
    world = args.gpus * args.nodes
    common = dict(gpus=args.gpus, nodes=args.nodes, gpu_memory=args.gpu_memory,
                  host_memory=args.host_memory, reserve=args.reserve,
                  headroom=args.allocator_headroom, placement=placement, layers=args.layers,
                  full_trace=args.full_trace, quick=args.quick,
                  line=not args.trace_length, disk_memory=args.disk)

    def plan_at(n: int, stack=fields, with_rates=None) -> Estimate:
        if "offload_state" in stack:  # the search's training-state trade
            stack = dict(stack)
            return plan(args.model, n, stack=stack, rates=with_rates,
                        **dict(common, placement=written_placement(
                            stack.pop("offload_state"), world)))
        return plan(args.model, n, stack=stack, rates=with_rates, **common)

    result: dict = {"model": args.model, "gpus": args.gpus, "nodes": args.nodes,
                    "gpu_memory": args.gpu_memory, "host_memory": args.host_memory,
                    "allocator_headroom": args.allocator_headroom,
                    "state_offload": placement.mode}
    estimates: list[Estimate] = []
    if args.seq_len is not None and not args.find_max and searches(args):
        return _fastest(args, config, fields, placement, plan_at, rates, result)
    chosen, best, candidates = {"sequence_parallel_size": world, **fields}, None, []
    if args.seq_len is not None:
        e = plan_at(args.seq_len, with_rates=step_rates)
        estimates.append(e)
        print(report(e))
        result["estimate"] = e.as_dict()
        if not args.find_max and e.fits:  # the given settings, as a config and launch lines
            _hand_over(args, result, chosen, _with_disk_dir(args, chosen, disk_dir),
                       args.seq_len, placement)
        elif not args.find_max and args.write_config is not None:
            print(f"did not write {args.write_config}: these settings do not fit "
                  f"{args.seq_len:,} tokens")
    if args.find_max:
        sp = fields.get("sequence_parallel_size", world)
        start = args.seq_len or 1 << 20
        if searches(args):
            print(f"searching the settings ({args.model}, {world} GPUs, SP {sp}):")
            winner, candidates = search(
                lambda n, f: plan_at(n, f), base=fields, sp_size=sp, granule=1024 * sp,
                heads=_attention_heads(config), start=start,
                mixers=token_mixer_heads(config),
                offload_state=args.offload_state is None and args.ds_config is None)
            print(search_table(candidates, winner))
            best, chosen = winner.best, winner.fields
            estimates += [e for c in candidates for e in c.tried]
            result["search"] = [{"ring": c.ring, "ulysses": c.ulysses, "fields": c.fields,
                                 "pruned": c.pruned, "max_seq_len": c.best,
                                 "stopped_below": c.below,
                                 "at_winner": c.at_winner.as_dict() if c.at_winner else None}
                                for c in candidates]
        else:
            print(f"finding the longest sequence that fits ({args.model}, {world} GPUs):")
            best, tried = find_max(plan_at, start=start, granule=1024 * sp)
            estimates += tried
        print(f"longest that fits: {best:,} tokens ({best / 1e6:.2f}M)")
        if best and step_rates is not None:
            at_best = plan_at(best, chosen, with_rates=step_rates)
            print(prediction_line(at_best))
            result["predicted"] = at_best.prediction.as_dict()
        if "offload_state" in chosen:
            chosen = dict(chosen)
            placement = written_placement(chosen.pop("offload_state"), world)
            print(_state_line(placement))
            result["state_offload"] = placement.mode
        result["max_seq_len"] = best
        result["tried"] = [e.as_dict() for e in estimates]
        _hand_over(args, result, chosen, _with_disk_dir(args, chosen, disk_dir), best,
                   placement)
    if args.plot is not None:
        top = max(e.seq_len for e in estimates)
        lengths = sorted({max(1024 * world, int(top * f) // (1024 * world) * 1024 * world)
                          for f in (0.25, 0.5, 0.75, 1.0)})
        series = {"these settings": [plan_at(n, chosen) for n in lengths]}
        for c in candidates:  # each searched factorization (and variant) at its settings
            if c.pruned or c.fields == chosen:
                continue
            extra = ",".join(f"{k}={v}" for k, v in _differs(c.fields, chosen).items())
            name = f"ring {c.ring} x ulysses {c.ulysses}" + (f" {extra}" if extra else "")
            series[name] = [plan_at(n, c.fields) for n in lengths]
        for name in ("ulysses", "alst", "ours"):
            series[name] = [plan_at(n, STACKS[name]) for n in lengths]
        result["plot"] = {name: [[e.seq_len, e.peak.total] for e in es]
                          for name, es in series.items()}
        plot(args.plot, series, budget=estimates[0].device_budget,
             title=f"{args.model}, {world} x {args.gpu_memory / GiB:.0f} GiB")
        print(f"wrote {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _fastest(args, config, fields: dict, placement: Placement, plan_at, rates,
             result: dict) -> int:
    """``--seq-len`` without settings: the fastest settings that fit (:func:`fastest`),
    from the least-memory ones (``fields``)."""
    world = args.gpus * args.nodes
    sp = fields.get("sequence_parallel_size", world)
    n = args.seq_len
    print(f"searching the fastest settings that fit {n:,} tokens ({args.model}, {world} GPUs, "
          f"SP {sp}, {rates.name} rates):")
    tracers: dict = {}

    def sp_of(f: dict | None):  # the settings without the training state's placement
        return None if f is None else stack_config(
            {k: v for k, v in f.items() if k != "offload_state"}, world=world)

    def predict_with(f: dict, ref: dict | None = None):
        key = repr(sorted(f.items()))
        if key not in tracers:
            where = (written_placement(f["offload_state"], world) if "offload_state" in f
                     else placement)
            f_sp = {k: v for k, v in f.items() if k != "offload_state"}
            tracers[key] = predict_step(config, sp_of(f), world, n, rates, placement=where,
                                        peak=plan_at(n, f_sp).peak if where.offloaded else None,
                                        outside=sp_of(ref))
        return tracers[key]

    best, tried = fastest(lambda f: plan_at(n, f), predict_with, base=fields, sp_size=sp,
                          heads=_attention_heads(config), seq_len=n,
                          mixers=token_mixer_heads(config),
                          unsupported=list(unsupported_settings(config)),
                          prefetch=lambda pairs, wait=True: prefetch_work(
                              config, [(sp_of(f), sp_of(r)) for f, r in pairs], world, n,
                              wait=wait),
                          fallbacks=[{"seq_chunk": "auto"}] + (
                              [{"offload_state": "optimizer"},
                               {"seq_chunk": "auto", "offload_state": "optimizer"}]
                              if args.offload_state is None and args.ds_config is None else []))
    result["tried"] = [{"fields": f, "predicted_s": t, "verdict": v} for f, t, v in tried]
    if best is None:
        print(f"does not fit: the least-memory settings do not fit {n:,} tokens "
              f"(python -m arctic.plan --find-max finds the longest that does)")
        if args.write_config is not None:
            print(f"did not write {args.write_config}: no settings fit {n:,} tokens")
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 1
    chosen = {k: best.sp[k] for k in best.sp}
    if best.placement.mode != placement.mode:  # a fallback moved the training state
        placement = best.placement
        print(_state_line(placement))
    e = plan_at(n, dict(chosen, offload_state=placement.mode), with_rates=rates)
    print(report(e))
    result["estimate"] = e.as_dict()
    _hand_over(args, result, chosen, _with_disk_dir(args, chosen, _disk_dir(args)), n, placement)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _state_line(placement: Placement) -> str:
    """What the chosen placement of the training state is, in DeepSpeed's keys."""
    keys = {"optimizer": "ZeRO-3 offload_optimizer",
            "optimizer+params": "ZeRO-3 offload_optimizer and offload_param",
            "fsdp2": "FSDP2 CPUOffloadPolicy"}
    return f"training state: {placement.mode} offloaded ({keys.get(placement.mode, '')})"


def _disk_dir(args):
    """The disk tier's directory for the printed and written config: --offload-dir, else the
    --ds-config's own, else None."""
    return args.offload_dir or (load_ds_config(args.ds_config).get("ulysses", {})
                                .get("offload_dir") if args.ds_config else None)


def _with_disk_dir(args, chosen: dict, disk_dir) -> dict:
    """The settings as shown and written: with the disk tier's directory when it is planned."""
    if args.disk and chosen.get("offload_activations"):
        return dict(chosen, offload_dir=disk_dir or "<a directory on the NVMe>")
    return chosen


def _hand_over(args, result: dict, chosen: dict, shown: dict, seq_len: int,
               placement: Placement) -> None:
    """The chosen settings as the user takes them: the ``"ulysses"`` block (``shown``: with
    the disk tier's directory when planned), the launch lines, and ``--write-config``."""
    result["settings"] = ulysses_block(shown)
    print("settings, as a DeepSpeed config's SP keys:")
    print(json.dumps(ulysses_block(shown), indent=2))
    if args.write_config is None:  # the launch lines name the file they need: none yet
        print("to launch: add --write-config FILE, which writes these settings as a DeepSpeed "
              "JSON and prints the command lines that run it")
        return
    write_config(args.write_config, args, shown, placement)
    print(f"wrote {args.write_config}")
    print("launch with:" + "".join(f"\n  {line}" for line in command_lines(
        args, chosen, seq_len, str(args.write_config), placement)))


def _calibrate(args: argparse.Namespace) -> int:
    """``--calibrate FILE``: this machine's rates, measured, written to FILE."""
    import torch

    cuda = torch.cuda.is_available()
    world = args.calibrate_world or (torch.cuda.device_count() if cuda else 2)
    rates = calibrate("cuda" if cuda else "cpu", world=world)
    rates.save(args.calibrate)
    print(f"wrote {args.calibrate}: plan with --rates {args.calibrate}")
    return 0


def _differs(fields: dict, ref: dict) -> dict:
    """The settings of ``fields`` that differ from ``ref``'s, the ring degree aside (the
    name says it); a key only one of them sets counts, with the config's default (or
    ``None``) for the other."""
    defaults = {f.name: f.default for f in dataclasses.fields(SequenceParallelConfig)}

    def value(d: dict, k: str):
        return d.get(k, defaults.get(k))

    return {k: value(fields, k) for k in sorted(fields.keys() | ref.keys())
            if value(fields, k) != value(ref, k) and k != "ring_degree"}


def search_table(candidates, winner) -> str:
    """The best length per factorization, and each one's plan at the winner's length."""
    rows = [f"{'ring x ulysses':<16}{'longest':>14}  {'at the winner':>24}  limit / note"]
    for c in candidates:
        name = f"{c.ring} x {c.ulysses}"
        extra = _differs(c.fields, winner.fields)
        if extra:
            name += " " + ",".join(f"{k}={v}" for k, v in extra.items())
        if c.pruned:
            rows.append(f"{name:<16}{'-':>14}  {'-':>24}  skipped: {c.pruned}")
            continue
        at = c.at_winner
        peak = (f"{at.peak.total / GiB:.2f} GiB " + ("fits" if at.fits else "no fit")
                if at else "-")
        mark = "  <- chosen" if c is winner else ""
        longest = (">=" if c.below else "") + f"{c.best:,}" if c.best else "-"
        note = c.limit() if c.best else f"does not fit one granule past the winner: {c.limit()}"
        if c.below:
            note = f"stopped short of {c.below:,} (does not fit; another fits it): {note}"
        rows.append(f"{name:<16}{longest:>14}  {peak:>24}  {note}{mark}")
    return "\n".join(rows)
