"""Benchmark: per-rank peak memory and step time of the memory stack, one feature at a time.

The tiny Llama of ``examples/train.py`` trains one step (forward + backward, SP over all ranks)
under four stacks, each built from the same seed. It has the demo model's 2 decoder layers by
default (``--layers``; ``results/`` also holds an 8-layer run, ``_l8``, made before the
tiled norms and fused projections existed). The stacks:

1. ``ulysses``: SP attention, HF's own logits and a plain cross-entropy;
2. ``+chunking``: head-chunked attention (``--chunk`` heads at a time) with the q/k/v/o
   projections fused into the chunk loop (``--no-fuse``: chunking alone);
3. ``+tiling``: tiled MLP and RMSNorms, tiled logits + loss;
4. ``+ckpt+offload``: per-layer checkpointing, layer inputs in the host buffer pool;

then ``full, unchunked`` (stack 4 without chunking, to show what chunking is worth there),
``+seq-chunk`` (stack 4 with each head chunk's sequence cut into ``--seq-chunk`` blocks,
FPDT-style, :mod:`ulysses.seq_chunk`: its kv blocks wait on the host, counted as host bytes)

and, alternating with them in the same run, the peer ``deepspeed-alst``: DeepSpeed's ALST
pieces (``UlyssesSPAttentionHF``, ``TiledMLP``, ``TiledFusedLogitsLoss``) with HF's
non-reentrant checkpointing and no offload (DeepSpeed ships none); see ``_alst_peer.py``. Its
batch is the same: DeepSpeed's data adapter is checked to cut the same contiguous shards.

Memory (per rank, the max over ranks is reported): the peak of everything allocated, from
MemTracker on CPU (parameters, the batch and the host pool registered up front) or the CUDA
allocator, minus the host pool's buffers: the offloaded bytes are host memory, reported apart
as ``host``. On CPU the "device" and the host are the same memory; the split is the one a GPU
would see. Each stack runs a warm-up step first, so the pool's buffers exist before the
measured step and the measured step must not grow it (checked).

Time: ``--iters`` rounds, stacks alternating, each step timed as the max over ranks; medians.
Every stack's loss and gradients are compared with stack 1's. The acceptance checks cover
our four stacks only; the peer gets ratios (``vs_peer``), for information.

    torchrun --nproc_per_node 2 benchmarks/memory.py [--seq 16384 --layers 2 --iters 2]
    python benchmarks/memory.py --predict --world 2 [...]   # the planner's prediction
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
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arctic.data.batch import prepare_sp_batch  # noqa: E402
from arctic.plan import buffer_pools  # noqa: E402
from arctic.hf.attention import apply_sequence_parallel  # noqa: E402
from arctic.loss.head import apply_sp_loss
from arctic.loss.token import sp_token_loss  # noqa: E402
from arctic.tiling.mlp import apply_tiled_mlp
from arctic.tiling.norms import apply_tiled_norms  # noqa: E402
from arctic import apply_activation_checkpointing  # noqa: E402
from ulysses import SequenceParallelDims, flat_mesh  # noqa: E402
from ulysses.torch_internals import (FakeTensorMode, disable_current_modes,  # noqa: E402
                                     step_mem_tracker)

import _alst_peer  # noqa: E402  (benchmarks/, on sys.path as the script's directory)

MIB = 2**20
STACKS = ("ulysses", "+chunking", "+tiling", "+ckpt+offload")
PEER = "deepspeed-alst"
UNCHUNKED = "full, unchunked"
SEQ = "+seq-chunk"
"""Stack 4 without head chunking: what chunking is worth once checkpointing removed the saved
activations (without checkpointing they hide the attention transient that chunking cuts)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=16384, help="full sequence length")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers (examples/train.py's tiny-llama has 2)")
    p.add_argument("--chunk", type=int, default=1, help="heads per chunk in stacks 2-4")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked stacks fuse q/k/v/o into the chunk loop (fuse_projections)")
    p.add_argument("--mlp-tiles", type=int, default=8)
    p.add_argument("--loss-tiles", type=int, default=8)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--stacks", nargs="+", default=None,
                   help=f"a subset of {list(STACKS) + [UNCHUNKED, SEQ, PEER]} (default: all)")
    p.add_argument("--seq-chunk", type=int, default=4,
                   help="sequence blocks per rank's piece in the +seq-chunk stack")
    p.add_argument("--predict", action="store_true",
                   help="no ranks: trace rank 0 of --world ranks under FakeTensorMode with the "
                        "memory planner (arctic.plan) and write its predicted peaks")
    p.add_argument("--world", type=int, default=2, help="ranks to predict for (--predict)")
    return p.parse_args()


def build(stack: str, args, mesh, device, seq_len: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    # examples/train.py's tiny-llama, with the layer count as a knob.
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if next(model.parameters()).device != device:  # (fake tensors, --predict, cannot move)
        model = model.to(device)
    if stack == PEER:
        model.sp_loss_applied = True
        return _alst_peer.apply_alst(model, mesh=mesh, seq_len=seq_len,
                                     mlp_tiles=args.mlp_tiles, loss_tiles=args.loss_tiles)
    level = 3 if stack in (UNCHUNKED, SEQ) else STACKS.index(stack)
    model.sp_loss_applied = level >= 2
    chunked = 1 <= level and stack != UNCHUNKED
    apply_sequence_parallel(model, mesh=mesh, head_chunk_size=args.chunk if chunked else None,
                            fuse_projections=chunked and args.fuse,
                            seq_chunk=args.seq_chunk if stack == SEQ else None)
    if level >= 2:
        apply_tiled_mlp(model, tiles=args.mlp_tiles)
        apply_tiled_norms(model, tiles=args.mlp_tiles)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=args.loss_tiles)
    if level >= 3:
        apply_activation_checkpointing(model, offload_to_cpu=True,
                                       group=flat_mesh(mesh, "dp_sp").get_group())
    return model


def step(model, batch, group) -> torch.Tensor:
    """One forward + backward; returns the loss."""
    if not model.sp_loss_applied:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1),
                                   batch["shift_labels"].flatten(), reduction="sum")
        loss = sp_token_loss(loss_sum, (batch["shift_labels"] != -100).sum(), group=group)
    else:
        loss = model(**batch)
    loss.backward()
    return loss.detach()


def pool_of(model):
    session = getattr(model, "activation_offload", None)
    return None if session is None else session.pool


def measure(model, batch, group, device) -> dict:
    """Device-side peak bytes of one step (host pool excluded), host bytes, loss, grads."""
    model.zero_grad(set_to_none=True)
    pool = pool_of(model)
    host = pool.host_buffers() if pool is not None else []
    host_bytes = sum(b.numel() for b in host)
    reserved = pool.stats.reserved_bytes if pool is not None else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = step(model, batch, group)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        mt = step_mem_tracker()  # MemTracker, its step peak alone
        mt.track_external(*model.parameters(), *filter(torch.is_tensor, batch.values()), *host)
        with mt:
            loss = step(model, batch, group)
        peak = mt.get_tracker_snapshot("peak")[device]["Total"] - host_bytes
    # The sequence-chunked attention's parked kv blocks and dk/dv sums: pinned host memory on
    # a GPU, allocated out of the tracker's sight on CPU (_untracked_host_blocks).
    blocks = max((p.stats.peak_host_bytes for p in buffer_pools(model)), default=0)
    grown = (pool.stats.reserved_bytes - reserved) if pool is not None else 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"peak": peak, "host_reserved": host_bytes, "pool_grew": grown,
            "host_peak": (pool.stats.peak_host_bytes if pool is not None else 0) + blocks,
            "loss": loss.item(), "grads": grads}


def _untracked_host_blocks() -> None:
    """On CPU the host is the device's memory: allocate the sequence-chunked attention's host
    blocks (:class:`ulysses.host_blocks.HostBlocks`) outside the dispatch modes, so that
    MemTracker's device peak leaves them out, as a GPU's allocator would (they are host
    bytes, reported as such)."""
    from ulysses.host_blocks import HostBlocks

    empty = HostBlocks.empty

    def untracked(self, *args, **kwargs):
        with disable_current_modes():
            return empty(self, *args, **kwargs)

    HostBlocks.empty = untracked


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def predict(args) -> None:
    """The planner's prediction of each stack's device peak on rank 0: the same ``build`` and
    ``step`` traced under FakeTensorMode on torch's fake process group (arctic.plan)."""
    from arctic.plan import buffer_pools, fake_world, track_peak
    from ulysses.trace_shortcuts import memory_trace

    fake_world(args.world)
    mesh = SequenceParallelDims(world_size=args.world,
                                ulysses_degree=args.world).build_mesh("cpu")
    group = flat_mesh(mesh, "sp").get_group()
    device = torch.device("cpu")
    record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "predicted": {}}
    for s in args.stacks or STACKS + (UNCHUNKED, SEQ):
        if s == PEER:
            continue  # DeepSpeed's pieces are not ours to plan
        # the planner's shortcuts: the same peaks, without the repeated tiles and hops
        with FakeTensorMode(allow_non_fake_inputs=True), memory_trace():
            ids = torch.randint(0, 256, (1, args.seq))
            batch = prepare_sp_batch({"input_ids": ids}, mesh)
            model = build(s, args, mesh, device, args.seq)
            step(model, batch, group)  # warm-up, as measured: the host pool's buffers exist
            model.zero_grad(set_to_none=True)
            with track_peak(track=(*model.parameters(), *filter(torch.is_tensor, batch.values())),
                            pools=buffer_pools(model)) as tracker:
                step(model, batch, group)
        peak = tracker.breakdown("cpu")
        record["predicted"][s] = {"device_peak_bytes": peak.total, "by_kind": peak.by_kind}
        print(f"{s:<16} predicted device peak {peak.total / MIB:8.1f} MiB", flush=True)
    out = args.out or Path(__file__).parent / "results" / \
        f"memory_predicted_w{args.world}_s{args.seq}_l{args.layers}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    args = parse_args()
    if args.predict:
        return predict(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        _untracked_host_blocks()
    world = dist.get_world_size()
    mesh = SequenceParallelDims(world_size=world, ulysses_degree=world).build_mesh(device.type)
    group = flat_mesh(mesh, "sp").get_group()
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {k: v.to(device) if torch.is_tensor(v) else v
             for k, v in prepare_sp_batch({"input_ids": ids}, mesh).items()}
    _alst_peer.check_shards(ids.to(device), batch, mesh)
    seq_len = batch["input_ids"].shape[1] * world

    missing = set(STACKS) - set(args.stacks or STACKS)
    if missing:
        raise SystemExit(f"--stacks must include the four stacks {list(STACKS)}; missing "
                         f"{sorted(missing)}")
    models = {s: build(s, args, mesh, device, seq_len)
              for s in args.stacks or STACKS + (UNCHUNKED, SEQ, PEER)}
    for model in models.values():  # warm-up: kernels, the pool's buffers
        step(model, batch, group)
    mem = {s: measure(m, batch, group, device) for s, m in models.items()}
    times = {s: [] for s in models}
    for _ in range(args.iters):
        for s, model in models.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            step(model, batch, group)
            times[s].append(max_over_ranks(time.perf_counter() - start, device))

    ref = mem["ulysses"]
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"world_size": world, "seq_per_rank": args.seq // world},
        "device": device.type,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else
                        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                        f"{torch.get_num_threads()} threads/rank"),
        "torch": torch.__version__, "stacks": {},
    }
    for s in models:
        m = mem[s]
        diff = max((m["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
        record["stacks"][s] = {
            "device_peak_bytes": max_over_ranks(m["peak"], device),
            "rank0_device_peak_bytes": m["peak"],  # printed by rank 0: its own
            "host_peak_bytes": max_over_ranks(m["host_peak"], device),
            "host_pool_bytes": max_over_ranks(m["host_reserved"], device),
            "pool_grew_bytes": max_over_ranks(m["pool_grew"], device),
            "median_step_s": statistics.median(times[s]), "step_s": times[s],
            "loss": m["loss"], "loss_diff_vs_ulysses": abs(m["loss"] - ref["loss"]),
            "max_grad_diff_vs_ulysses": max_over_ranks(diff, device),
        }
    st = record["stacks"]
    peaks = [st[s]["device_peak_bytes"] for s in STACKS]
    record["acceptance"] = {
        "each_stack_lowers_device_peak": {"value": [p / peaks[0] for p in peaks],
                                          "pass": all(b < a for a, b in zip(peaks, peaks[1:]))},
        "full_over_plain_device_peak": {"value": peaks[-1] / peaks[0], "bar": 0.3,
                                        "pass": peaks[-1] / peaks[0] <= 0.3},
        "pool_not_grown_in_measured_step": {"pass": st[STACKS[-1]]["pool_grew_bytes"] == 0},
    }
    record["vs_peer"] = {f"{s}_over_{PEER}_{what}": st[s][key] / st[PEER][key]
                         for s in STACKS[2:] for what, key in (("device_peak", "device_peak_bytes"),
                                                               ("step_time", "median_step_s"))
                         if PEER in st}
    record["chunking_in_full_stack"] = {} if UNCHUNKED not in st else {
        "device_peak_chunked_over_unchunked": st[STACKS[-1]]["device_peak_bytes"] /
        st[UNCHUNKED]["device_peak_bytes"],
        "step_time_chunked_over_unchunked": st[STACKS[-1]]["median_step_s"] /
        st[UNCHUNKED]["median_step_s"]}
    record["seq_chunk_in_full_stack"] = {} if SEQ not in st else {
        "device_peak_seq_chunked_over_full": st[SEQ]["device_peak_bytes"] /
        st[STACKS[-1]]["device_peak_bytes"],
        "step_time_seq_chunked_over_full": st[SEQ]["median_step_s"] /
        st[STACKS[-1]]["median_step_s"]}
    if dist.get_rank() == 0:
        report(args, world, record)
    dist.destroy_process_group()


def report(args, world: int, record: dict) -> None:
    st = record["stacks"]
    base_peak, base_time = st["ulysses"]["device_peak_bytes"], st["ulysses"]["median_step_s"]
    print(f"\nconfig: W={world} S={args.seq} (s={args.seq // world}/rank) layers={args.layers} "
          f"chunk={args.chunk} mlp_tiles={args.mlp_tiles} loss_tiles={args.loss_tiles} "
          f"iters={args.iters} device={record['device_name']}")
    print(f"{'stack':<16} | {'device peak MiB':>15} | {'/ ulysses':>9} | {'host MiB':>8} | "
          f"{'step s':>7} | {'/ ulysses':>9} | {'max |dgrad|':>11}")
    for s, r in st.items():
        print(f"{s:<16} | {r['device_peak_bytes'] / MIB:>15.1f} | "
              f"{r['device_peak_bytes'] / base_peak:>9.3f} | {r['host_peak_bytes'] / MIB:>8.1f} | "
              f"{r['median_step_s']:>7.2f} | {r['median_step_s'] / base_time:>9.3f} | "
              f"{r['max_grad_diff_vs_ulysses']:>11.2e}")
    for name, check in record["acceptance"].items():
        value = check.get("value")
        shown = "" if value is None else (f" = {value:.3f}" if isinstance(value, float) else
                                          f" = {[round(v, 3) for v in value]}")
        bar = f" (bar {check['bar']})" if "bar" in check else ""
        print(f"{'PASS' if check['pass'] else 'FAIL'}  {name}{shown}{bar}")
    for name, value in (record["vs_peer"] | record["chunking_in_full_stack"] |
                        record["seq_chunk_in_full_stack"]).items():
        print(f"INFO  {name} = {value:.3f}")
    out = args.out or (Path(__file__).parent / "results" /
                       f"memory_{record['device']}_w{world}_s{args.seq}_l{args.layers}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
