"""Benchmark: the planner's speed model against measured step times, on this machine.

In one run:

1. ``--calibrate``: the rates of this machine as ``--world`` ranks use it
   (:func:`arctic.plan.speed.calibrate`, the same as ``python -m arctic.plan --calibrate``),
   or ``--rates FILE`` from an earlier calibration;
2. the planner's predicted step time for each setting (:func:`arctic.plan.plan` with those
   rates: the step's work counted on a trace, divided by the rates), and whether it fits
   the ``--gpu-memory`` / ``--host-memory`` budgets;
3. the measured step time of each setting: ``--world`` gloo ranks train the same model (fp32,
   ``arctic.plan.build`` and ``train_step``: FSDP2 with the recipe, the planner's own step)
   for ``--iters`` rounds after a warm-up, the settings alternating within each round, each
   step timed as the slowest rank's; medians.

It reports each setting's predicted and measured time and their ratio, Spearman's rank
correlation of the two over the settings, and the planner's choice (the fastest predicted
that fits) against the fastest measured. Writes ``results/plan_speed_cpu_w<world>.json``.

    python benchmarks/plan_speed.py --calibrate [--world 2 --seq 8192 --iters 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=65536, tie_word_embeddings=False)
"""A small Llama whose step at 8K tokens on 2 CPU ranks takes about a second: attention,
the MLP and the loss head each a sizeable part of it."""

SETTINGS: dict[str, dict] = {
    "ulysses": dict(loss_tiles=1),
    "ulysses+checkpointing": dict(loss_tiles=1, activation_checkpointing=True),
    "alst": dict(tiled_mlp="auto", tiled_norms=False, loss_tiles="auto",
                 activation_checkpointing=True, offload_activations=True),
    "ours": dict(head_chunk_size=1, fuse_projections=True, tiled_mlp="auto", tiled_layer=True,
                 loss_tiles="auto", activation_checkpointing=True, offload_activations=True),
    "ours, 2 heads per chunk": dict(head_chunk_size=2, fuse_projections=True, tiled_mlp="auto",
                                    tiled_layer=True, loss_tiles="auto",
                                    activation_checkpointing=True, offload_activations=True),
    "ours, attention kept": dict(head_chunk_size=1, fuse_projections=True, tiled_mlp="auto",
                                 tiled_layer=True, loss_tiles="auto",
                                 activation_checkpointing=True, offload_activations=True,
                                 recompute_attention=False),
    "ours, unfused": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                          activation_checkpointing=True, offload_activations=True),
    "ring 2": dict(ring_degree=2, loss_tiles=1),
}
"""The settings compared (:class:`arctic.config.SequenceParallelConfig` fields; the SP degree
is the world): what trades memory for time, from plain Ulysses to the full stack."""


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def _measure_worker(rank: int, world: int, threads: int, config_path: str, seq: int,
                    settings: dict, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from arctic.plan import build, make_batch, model_config, stack_config, train_step

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank,
                            world_size=world)
    try:
        config = model_config(config_path)
        runs = {}
        for name, fields in settings.items():
            sp = stack_config(fields, world=world)
            mesh = sp.dims(world).build_mesh("cpu")
            torch.manual_seed(0)
            model, optimizer = build(config, sp, mesh, device="cpu",
                                     compute_dtype=torch.float32)
            batch = make_batch(seq, config.vocab_size, mesh, "cpu")
            train_step(model, optimizer, batch)  # warm-up: the pools' buffers, AdamW's state
            runs[name] = (model, optimizer, batch)
        times: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(iters):
            for name, (model, optimizer, batch) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                train_step(model, optimizer, batch)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name].append(float(t))
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure(config_path: str, seq: int, settings: dict, *, world: int, threads: int,
            iters: int) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        mp.start_processes(_measure_worker, args=(world, threads, config_path, seq, settings,
                                                  iters, str(out)),
                           nprocs=world, start_method="spawn")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per rank (default: the cores shared out)")
    p.add_argument("--seq", type=int, default=8192, help="tokens in the sequence")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--calibrate", action="store_true", help="measure the rates first")
    p.add_argument("--rates", default=None, help="a rates file (--calibrate writes one)")
    p.add_argument("--gpu-memory", default="16GiB", help="the device budget per rank")
    p.add_argument("--host-memory", default="16GiB")
    p.add_argument("--only", action="append", default=None, help="a setting's name")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from arctic.plan import parse_bytes, plan
    from arctic.plan.speed import calibrate, rates_from

    import torch

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    settings = {k: v for k, v in SETTINGS.items() if not args.only or k in args.only}
    results = REPO / "benchmarks" / "results"
    out = args.out or results / f"plan_speed_cpu_w{args.world}.json"
    if args.calibrate:
        rates = calibrate("cpu", world=args.world, threads=threads)
        rates.save(out.with_suffix(".rates.json"))
    elif args.rates:
        rates = rates_from(args.rates)
    else:
        raise SystemExit("give --calibrate or --rates FILE")
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(MODEL))
        predicted = {}
        for name, fields in settings.items():
            e = plan(str(config_path), args.seq, gpus=args.world, stack=fields, rates=rates,
                     gpu_memory=parse_bytes(args.gpu_memory),
                     host_memory=parse_bytes(args.host_memory), compute_dtype=torch.float32)
            predicted[name] = e
            print(f"predicted {name}: {e.prediction.step_s:.3f} s "
                  f"({'fits' if e.fits else 'does not fit'})", flush=True)
        times = measure(str(config_path), args.seq, settings, world=args.world,
                        threads=threads, iters=args.iters)
    rows = []
    for name in settings:
        m = statistics.median(times[name])
        e = predicted[name]
        rows.append({"setting": name, "fields": settings[name], "measured_s": m,
                     "measured_all_s": times[name], "predicted_s": e.prediction.step_s,
                     "ratio": e.prediction.step_s / m, "fits": e.fits,
                     "predicted_by_class_s": e.prediction.by_class_s})
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    fitting = [r for r in rows if r["fits"]]
    choice = min(fitting, key=lambda r: r["predicted_s"])
    fastest = min(fitting, key=lambda r: r["measured_s"])
    within = choice["measured_s"] / fastest["measured_s"] - 1
    print(f"\n{'setting':<26}{'measured s':>12}{'predicted s':>13}{'pred/meas':>11}")
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        mark = "  <- planner's choice" if r is choice else ""
        print(f"{r['setting']:<26}{r['measured_s']:>12.3f}{r['predicted_s']:>13.3f}"
              f"{r['ratio']:>11.2f}{mark}")
    print(f"Spearman (predicted vs measured, {len(rows)} settings): {rho:.3f}")
    print(f"planner's choice: {choice['setting']}, {within:+.1%} against the fastest measured "
          f"({fastest['setting']})")
    out.write_text(json.dumps({
        "world": args.world, "threads_per_rank": threads, "seq": args.seq, "iters": args.iters,
        "model": MODEL, "rates": rates.__dict__, "rows": rows, "spearman": rho,
        "choice": choice["setting"], "fastest_measured": fastest["setting"],
        "choice_vs_fastest": within, "torch": torch.__version__}, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
