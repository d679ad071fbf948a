"""Benchmark: the disk tier (``offload_dir``) against host-only offload and plain
checkpointing, one training step (forward + backward) of a random-weight HF Llama.

Variants, built from the same weights and run alternately on the same batch:

- ``checkpoint``: every decoder layer checkpointed, inputs kept on the device;
- ``host``: the layer inputs offloaded to host buffers (the pool's limit far above them);
- ``disk_threads``, ``disk_aio``: offloaded with ``offload_dir`` and a host limit of
  ``--host-layers`` layers' inputs, so the other layers spill to files in ``--dir`` and
  come back one layer ahead in backward (:mod:`offload.disk`), through plain file I/O on
  threads or DeepSpeed's async I/O op (``offload_io``; ``--io`` picks, default both, aio
  left out with its reason where it is not usable).

Gradients of ``host`` and each disk variant must be bit-identical (and equal to
``checkpoint``'s). Reports the median step time per variant, its ratio to ``host`` and to
``disk_threads``, the bytes spilled and the peak host and disk bytes of the pool; on CUDA
also ``max_memory_allocated`` per variant. On CUDA the step runs in torch's deterministic
mode, so that the bit-for-bit comparison is meaningful.

    python benchmarks/offload_disk.py [--layers 8 --seq 8192 --device cpu|cuda --dir /nvme]
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

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arctic import apply_activation_checkpointing  # noqa: E402
from offload.disk_aio import unusable  # noqa: E402

MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--host-layers", type=float, default=2.5,
                   help="the disk variant's host limit, in layers' inputs")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=None,
                   help="the disk tier's directory (default: a temporary one)")
    p.add_argument("--io", nargs="+", choices=["threads", "aio"], default=None,
                   help="the disk tier's I/O backends to time (default: threads, and aio "
                        "where it is usable, JIT-building DeepSpeed's op if needed)")
    p.add_argument("--out", type=Path,
                   default=REPO / "benchmarks" / "results" / "offload_disk_cpu.json")
    return p.parse_args()


def build(args, device, **offload):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads // 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)
    return apply_activation_checkpointing(model, **offload)


def step(model, ids, device) -> tuple[float, torch.Tensor, int]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    grad = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
    model.zero_grad(set_to_none=True)
    return seconds, grad, peak


def deterministic_on(device: torch.device) -> None:
    """Bit-for-bit comparisons need a repeatable step. On CUDA the memory-efficient SDPA
    backward (fp32 here) splits keys and adds dq with atomics, so two identical steps differ
    in the last bits (seen on an H200: host != checkpoint); torch's deterministic mode makes
    it use one split, and cuBLAS needs a fixed workspace for it. warn_only: an op without a
    deterministic kernel warns with its name instead of stopping the run."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    deterministic_on(device)
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    dtype_bytes = 4  # fp32 weights and activations
    layer_input = args.seq * args.hidden * dtype_bytes
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        ios = args.io
        if ios is None:
            reason = unusable(str(Path(where) / "probe"), build=True)  # may JIT-build it
            ios = ["threads"] + (["aio"] if reason is None else [])
            if reason is not None:
                print(f"disk_aio left out: {reason}")
        models = {
            "checkpoint": build(args, device),
            "host": build(args, device, offload_to_cpu=True, host_memory_limit=1 << 40),
            **{f"disk_{io}": build(args, device, offload_to_cpu=True, offload_dir=where,
                                   offload_io=io,
                                   host_memory_limit=int(args.host_layers * layer_input))
               for io in ios},
        }
        disks = [name for name in models if name.startswith("disk_")]
        times = {name: [] for name in models}
        peaks, grads = {}, {}
        first_host = None
        for _ in range(args.iters + 1):  # the first round warms up and is not timed
            for name, model in models.items():  # alternating, on the same batch
                seconds, grads[name], peaks[name] = step(model, ids, device)
                times[name].append(seconds)
            first_host = grads["host"] if first_host is None else first_host
        stats = {name: models[name].activation_offload.pool.stats for name in ["host", *disks]}
    exact = all(torch.equal(grads["host"], grads[name]) for name in disks)
    same_as_ckpt = torch.equal(grads["host"], grads["checkpoint"])
    repeatable = torch.equal(grads["host"], first_host)
    med = {name: statistics.median(t[1:]) for name, t in times.items()}
    rows = []
    for name in models:
        pool = stats.get(name)
        rows.append({"variant": name, "median_s": round(med[name], 4),
                     "vs_host": round(med[name] / med["host"], 3),
                     "vs_threads": (round(med[name] / med["disk_threads"], 3)
                                    if name in disks and "disk_threads" in med else None),
                     "max_allocated_mib": round(peaks[name] / MIB, 1),
                     "spilled_mib": round(pool.bytes_spilled / MIB, 1) if pool else 0,
                     "peak_host_mib": round(pool.peak_host_bytes / MIB, 1) if pool else 0,
                     "peak_disk_mib": round(pool.peak_disk_bytes / MIB, 1) if pool else 0})
    print(f"{'variant':<14}{'median s':>10}{'vs host':>9}{'vs threads':>12}{'spilled MiB':>13}"
          f"{'peak host MiB':>15}{'peak disk MiB':>15}{'max alloc MiB':>15}")
    for r in rows:
        vs = "" if r["vs_threads"] is None else f"{r['vs_threads']:.3f}"
        print(f"{r['variant']:<14}{r['median_s']:>10.3f}{r['vs_host']:>9.3f}{vs:>12}"
              f"{r['spilled_mib']:>13.1f}{r['peak_host_mib']:>15.1f}{r['peak_disk_mib']:>15.1f}"
              f"{r['max_allocated_mib']:>15.1f}")
    print(f"gradients: {', '.join(disks)} == host bit for bit: {exact}; host == checkpoint: "
          f"{same_as_ckpt}; host's first step == its last: {repeatable}")
    if not exact:
        largest = {name: float((grads[name] - grads["host"]).abs().max()) for name in disks}
        raise SystemExit(f"the disk tier changed the gradients (largest difference from host "
                         f"{largest}; host's own run to run "
                         f"{float((grads['host'] - first_host).abs().max()):.3g})")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "device": str(device),
              "io": {name: models[name].activation_offload.pool.disk.io for name in disks},
              "torch": torch.__version__, "layer_input_mib": round(layer_input / MIB, 2),
              "gradients_bit_identical": exact, "host_repeatable": repeatable, "rows": rows,
              "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
