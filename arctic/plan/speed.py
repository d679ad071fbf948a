"""The planner's speed model: a step's time from its work and the device's rates.

A traced step's work (:mod:`arctic.plan.work`: attention FLOPs forward and backward, matrix
product FLOPs, memory-bound bytes, host copies, collective bytes, kernels launched) divided
by the rates of the machine it runs on, class by class:

    kernels = attention_fwd / R_af + attention_bwd / R_ab + gemm / R_g + memory / R_m
    a CPU:  step = kernels + ops x t_op + collective / R_c + (host_copy + host_restore) / R_h
    a GPU:  step = max(max(kernels, ops x t_op) + collective / R_c + host_restore / R_h,
                       host_copy / R_h)

A GPU is asynchronous (:attr:`Rates.asynchronous`): the host queues kernels ahead, so the
cost of launching them shows only where it exceeds the kernels' own time (short contexts),
and offload copies run on a side stream beside compute, except the copies back that the step
waits for (``host_restore``: without ``offload_prefetch``). Collectives are counted whole
(exposed), though head-chunked attention overlaps part of them.

The rates (:class:`Rates`) come from ``python -m arctic.plan --calibrate``, which measures
them on the machine at hand (:func:`calibrate`) and writes a JSON file, or from the known
defaults (:data:`DEVICES`) for GPUs measured in ``benchmarks/results``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from arctic.plan.work import CLASSES, Work
from ulysses.kernels import attention_backward, attention_forward, select_backend

RATE_KEYS = {"attention_fwd": "attention_fwd_flops", "attention_bwd": "attention_bwd_flops",
             "gemm": "gemm_flops", "memory": "memory_bytes", "host_copy": "host_copy_bytes",
             "host_restore": "host_copy_bytes", "collective": "collective_bytes"}
"""Work class -> the :class:`Rates` field that divides it (per second)."""


@dataclass
class Rates:
    """What a device does per second in each class of work, and per kernel launched."""

    name: str
    attention_fwd_flops: float
    attention_bwd_flops: float
    gemm_flops: float
    memory_bytes: float
    host_copy_bytes: float
    collective_bytes: float
    op_seconds: float
    """Seconds per kernel launched beyond its work (dispatch, Python, launch)."""
    peak_flops: float
    """The dense peak that MFU divides by (the vendor's bf16 figure on a GPU; the measured
    matrix product rate where none is published: a CPU)."""
    asynchronous: bool = False
    """A device the host queues kernels to (CUDA): launches overlap the kernels, and host
    copies run on a side stream beside compute. On a CPU each op and copy takes the cores."""
    source: str = ""
    """Where the figures come from."""
    measured: dict = field(default_factory=dict)
    """The calibration's raw timings."""

    def seconds(self, work: Work) -> dict[str, float]:
        """Each class's time."""
        out = {k: getattr(work, k) / getattr(self, RATE_KEYS[k]) for k in RATE_KEYS}
        out["ops"] = work.ops * self.op_seconds
        return out

    def step_seconds(self, work: Work) -> float:
        s = self.seconds(work)
        kernels = s["attention_fwd"] + s["attention_bwd"] + s["gemm"] + s["memory"]
        if self.asynchronous:
            return max(max(kernels, s["ops"]) + s["collective"] + s["host_restore"],
                       s["host_copy"])
        return kernels + s["ops"] + s["collective"] + s["host_copy"] + s["host_restore"]

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Rates:
        data = json.loads(Path(path).read_text())
        missing = [f for f in cls.__dataclass_fields__ if f not in data
                   and f not in ("asynchronous", "source", "measured")]
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if missing or unknown:
            raise ValueError(f"{path}: not a rates file (missing {missing}, unknown {unknown}); "
                             f"write one with python -m arctic.plan --calibrate")
        return cls(**data)


_H200_ATTENTION = 527e12
"""cuDNN's causal bf16 attention, forward and backward, head dim 128, on an H200 (torch
2.11, cuDNN 9.19; ``benchmarks/results/gpu_acceptance_nvidia-h200*``)."""

DEVICES: dict[str, Rates] = {
    "h200": Rates(
        name="h200", attention_fwd_flops=_H200_ATTENTION, attention_bwd_flops=_H200_ATTENTION,
        gemm_flops=700e12, memory_bytes=3.6e12, host_copy_bytes=40e9, collective_bytes=150e9,
        op_seconds=8e-6, peak_flops=989e12, asynchronous=True,
        source="attention: cuDNN measured on an H200 (benchmarks/results); the other rates "
               "are typical achieved fractions of the H200's published figures (989 TFLOP/s "
               "bf16 dense, 4.8 TB/s HBM3e, PCIe 5 x16, NVLink 4 all-to-all over 8), not yet "
               "calibrated on a lent GPU"),
}
DEVICES["h100"] = replace(
    DEVICES["h200"], name="h100", memory_bytes=2.6e12,
    source="the H200's compute rates (the same tensor cores and clocks); memory at a typical "
           "achieved fraction of the H100 SXM's 3.35 TB/s; not yet calibrated on a lent GPU")
"""Known rates by name (``--rates h100``); anything else is a file :func:`calibrate` wrote."""


def rates_from(spec: str | os.PathLike | Rates) -> Rates:
    """A :class:`Rates` from a name in :data:`DEVICES`, or a file that ``--calibrate`` wrote."""
    if isinstance(spec, Rates):
        return spec
    if str(spec).lower() in DEVICES:
        return DEVICES[str(spec).lower()]
    if not Path(spec).is_file():
        raise ValueError(f"--rates {spec}: neither one of {', '.join(DEVICES)} nor a file "
                         f"(python -m arctic.plan --calibrate writes one)")
    return Rates.load(Path(spec))


@dataclass
class Prediction:
    """A step's predicted time, and what follows from it."""

    step_s: float
    tokens_per_s: float
    """Tokens of the sequence per second, over all ranks of a sequence-parallel group."""
    mfu: float
    """Model FLOPs (:func:`arctic.plan.work.model_flops`) per rank over ``step_s`` and the
    device's peak."""
    by_class_s: dict
    work: Work
    rates: str

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "by_class_s": self.by_class_s, "work": self.work.as_dict(), "rates": self.rates}


def predict(work: Work, rates: Rates, *, seq_len: int, model_flops_per_rank: float) -> Prediction:
    """The step time of ``work`` at ``rates``; ``seq_len`` tokens per sequence."""
    step = rates.step_seconds(work)
    return Prediction(step_s=step, tokens_per_s=seq_len / step if step else 0.0,
                      mfu=model_flops_per_rank / step / rates.peak_flops if step else 0.0,
                      by_class_s=rates.seconds(work), work=work, rates=rates.name)


# --- calibration ------------------------------------------------------------------------------

def _median_seconds(fn, *, sync, repeats: int = 5, min_s: float = 0.05) -> float:
    """Median wall time of ``fn`` over ``repeats`` timings of enough calls to last ``min_s``."""
    fn()
    sync()
    calls, t0 = 1, time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_s / once))
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def calibrate(device: str = "cpu", dtype=None, *, world: int = 1, threads: int | None = None,
              head_dim: int = 64, seq: int = 2048, heads: int = 4, hidden: int = 1024,
              log=print) -> Rates:
    """Measure the rates of this machine as a training job uses it: ``world`` processes (gloo
    on CPU, NCCL over the node's GPUs), each with ``threads`` CPU threads (default: the cores
    shared out), measure at once, as their ranks would run: a matrix product, the attention
    kernel the runtime picks for ``device`` and ``dtype`` (forward and backward, causal), an
    element-wise op's bytes, a device<->host copy, one small op's cost, and, with ``world``
    > 1, an all-to-all's bytes per second. Rank 0's figures are returned.

    Shapes are those of a small training step's work (``hidden`` x ``hidden`` products over
    ``seq`` rows); on a GPU pass a model's own."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    dtype_name = str(dtype or "").replace("torch.", "")
    shapes = dict(head_dim=head_dim, seq=seq, heads=heads, hidden=hidden)
    if world == 1:
        torch.set_num_threads(threads)
        rates = _measure(device, dtype_name, shapes)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rates.json"
            mp.start_processes(_calibration_worker,
                               args=(world, threads, device, dtype_name, shapes, str(out)),
                               nprocs=world, start_method="spawn")
            rates = Rates(**json.loads(out.read_text()))
    m = rates.measured
    log(f"calibrated {rates.name} ({m['dtype']}, {world} rank(s) x {threads} thread(s)): "
        f"matrix products {rates.gemm_flops / 1e9:.1f} GFLOP/s, attention "
        f"({m['attention_backend']}) {rates.attention_fwd_flops / 1e9:.1f} / "
        f"{rates.attention_bwd_flops / 1e9:.1f} GFLOP/s forward / backward, memory "
        f"{rates.memory_bytes / 1e9:.1f} GB/s, host copies {rates.host_copy_bytes / 1e9:.1f} "
        f"GB/s, {rates.op_seconds * 1e6:.1f} us per op, all-to-all "
        + (f"{rates.collective_bytes / 1e9:.2f} GB/s sent per rank" if world > 1
           else "not measured (one rank)"))
    return rates


def _measure(device: str, dtype_name: str, shapes: dict, collective=None) -> Rates:
    """This process's rates (:func:`calibrate`); ``collective()``: the all-to-all's bytes per
    second, measured between the compute timings' barriers (None: one rank)."""
    import torch

    dev = torch.device(device)
    dtype = (getattr(torch, dtype_name) if dtype_name
             else torch.bfloat16 if dev.type == "cuda" else torch.float32)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    seq, hidden, heads, head_dim = (shapes[k] for k in ("seq", "hidden", "heads", "head_dim"))
    measured: dict = {"dtype": str(dtype).replace("torch.", ""), **shapes}
    torch.manual_seed(0)

    a = torch.randn(seq, hidden, device=dev, dtype=dtype)
    b = torch.randn(hidden, hidden, device=dev, dtype=dtype)
    t = _median_seconds(lambda: a @ b, sync=sync)
    gemm = 2 * seq * hidden * hidden / t
    measured["gemm_s"] = t

    backend = select_backend(dev, dtype, head_dim)
    q, k, v = (torch.randn(1, seq, heads, head_dim, device=dev, dtype=dtype) for _ in range(3))
    scale = head_dim ** -0.5
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=scale, backend=backend)
    flops = 2.0 * seq * (seq + 1) / 2 * heads * 2 * head_dim
    tf = _median_seconds(lambda: attention_forward(q, k, v, causal=True, softmax_scale=scale,
                                                   backend=backend), sync=sync)
    tb = _median_seconds(lambda: attention_backward(out, q, k, v, out, lse, causal=True,
                                                    softmax_scale=scale, backend=backend),
                         sync=sync)
    measured.update(attention_backend=backend, attention_fwd_s=tf, attention_bwd_s=tb)

    big = torch.randn(8 * seq, hidden, device=dev, dtype=dtype)
    other = torch.randn_like(big)
    t = _median_seconds(lambda: big.add(other), sync=sync)
    memory = 3 * big.numel() * big.element_size() / t
    measured["memory_s"] = t

    pin = dev.type == "cuda"
    host = torch.empty(big.shape, dtype=dtype, pin_memory=pin)
    t_out = _median_seconds(lambda: host.copy_(big, non_blocking=pin), sync=sync)
    t_in = _median_seconds(lambda: big.copy_(host, non_blocking=pin), sync=sync)
    host_copy = big.numel() * big.element_size() / ((t_out + t_in) / 2)
    measured.update(host_copy_out_s=t_out, host_copy_in_s=t_in)

    tiny = torch.randn(8, device=dev, dtype=dtype, requires_grad=True)

    def small_ops():  # 8 multiplies, their 8 backward multiplies, a sum and its backward
        x = tiny
        for _ in range(8):
            x = x * 1.0001
        x.sum().backward()

    op_seconds = _median_seconds(small_ops, sync=sync) / 18
    measured["op_s"] = op_seconds
    coll = collective() if collective is not None else 0.0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return Rates(name=name, attention_fwd_flops=flops / tf, attention_bwd_flops=2.5 * flops / tb,
                 gemm_flops=gemm, memory_bytes=memory, host_copy_bytes=host_copy,
                 collective_bytes=coll or DEVICES["h100"].collective_bytes,
                 op_seconds=op_seconds,
                 peak_flops=gemm if dev.type != "cuda" else DEVICES["h100"].peak_flops,
                 asynchronous=dev.type == "cuda",
                 source=f"python -m arctic.plan --calibrate on {name}, {measured['dtype']}, "
                        f"{time.strftime('%Y-%m-%d')}"
                        + ("" if coll else "; collectives: the default (one rank measured)"),
                 measured=measured)


def _calibration_worker(rank: int, world: int, threads: int, device: str, dtype_name: str,
                        shapes: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{out}.store",
                            rank=rank, world_size=world)
    dev = f"cuda:{rank}" if cuda else "cpu"
    try:
        def collective() -> float:
            n = shapes["seq"] * shapes["hidden"] // world * world
            x = torch.randn(n, device=dev)
            y = torch.empty_like(x)
            sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
            times = []
            for _ in range(5):  # the same count on every rank: a collective
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(4):
                    dist.all_to_all_single(y, x)
                sync()
                times.append((time.perf_counter() - t0) / 4)
            t = torch.tensor([statistics.median(times)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return n * x.element_size() * (world - 1) / world / float(t)

        dist.barrier()
        rates = _measure(dev, dtype_name, shapes, collective=collective)
        if rank == 0:
            Path(out).write_text(json.dumps(asdict(rates)))
    finally:
        dist.destroy_process_group()


__all__ = ["CLASSES", "DEVICES", "Prediction", "Rates", "calibrate", "predict", "rates_from"]
