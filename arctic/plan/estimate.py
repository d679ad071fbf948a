"""The planner's answer for one setting: trace the step, extend it to the model's depth, and
compare its peaks with the device and host budgets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from arctic.plan.models import model_config
from arctic.plan.step import (PLANNED_FIELDS, build, init_optimizer_state, make_batch,
                              stack_config, train_step)
from arctic.plan.tracing import KINDS, Peak, buffer_pools, fake_world, track_peak
from arctic.plan.units import GiB


@dataclass
class Estimate:
    """The planner's answer for one setting."""

    model: str
    stack: str
    seq_len: int
    world: int
    gpus_per_node: int
    sp: dict
    peak: Peak
    device_budget: int
    host_budget: int
    refused: str | None = None
    peak_phase: str = ""
    phases: dict = field(default_factory=dict)
    trace_s: float = 0.0

    @property
    def fits(self) -> bool:
        return (self.refused is None and self.peak.total <= self.device_budget and
                self.peak.host <= self.host_budget)

    def limit(self) -> str:
        if self.refused is not None:
            return self.refused
        if self.peak.host > self.host_budget:
            return "host memory for offloaded layer inputs"
        return max(self.peak.by_kind, key=self.peak.by_kind.get)

    def as_dict(self) -> dict:
        """The estimate as JSON-ready values: the CLI's ``--json`` and the benchmarks' records."""
        return {"seq_len": self.seq_len, "stack": self.stack, "sp": self.sp, "fits": self.fits,
                "limit": None if self.fits else self.limit(), **self.peak.summary(),
                "device_budget": self.device_budget, "host_budget": self.host_budget,
                "trace_s": round(self.trace_s, 1)}


def _trace(config, sp, world: int, seq_len: int, *, shard: bool, host_limit: int):
    """One traced step: ``(phase peaks, host peak bytes, refusal or None)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_world(world)
    mesh = sp.dims(world).build_mesh("cpu")  # outside: the mesh reads its rank map
    refused = None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, optimizer = build(config, sp, mesh, device="cpu", shard=shard,
                                 host_memory_limit=host_limit)
        init_optimizer_state(model, optimizer)
        batch = make_batch(seq_len, config.vocab_size, mesh, "cpu")
        session = getattr(model, "activation_offload", None)
        with track_peak(track=(model, optimizer, *batch.values()),
                        pools=buffer_pools(model)) as tracker:
            try:
                train_step(model, optimizer, batch, on_phase=tracker.end_phase)
            except ValueError as e:  # the offload pool refused: host memory
                refused = str(e).split(". Fix")[0]
                tracker.end_phase("refused")
    host = session.pool.stats.peak_host_bytes if session is not None else 0
    return tracker.phases, host, refused


def _extrapolate(a: Peak, b: Peak, la: int, lb: int, layers: int) -> Peak:
    def line(x: int, y: int) -> int:
        return int(round(x + (y - x) * (layers - la) / (lb - la)))

    return Peak(line(a.total, b.total), {k: line(a.by_kind[k], b.by_kind[k]) for k in KINDS},
                line(a.host, b.host), largest=b.largest)


TRACE_LAYERS = (3, 4)
"""Layer counts traced when a model's own count is larger (see :func:`plan`)."""


def plan(model: str, seq_len: int, *, gpus: int, nodes: int = 1, stack: str | dict = "ours",
         gpu_memory: int = 80 * GiB, host_memory: int = int(1.5 * 1024) * GiB,
         reserve: float = 0.05, layers: int | None = None, shard: bool = True,
         full_trace: bool = False) -> Estimate:
    """Trace one training step of ``model`` at ``seq_len`` tokens over ``gpus * nodes`` ranks
    (rank 0) and compare its peak with the budgets: ``gpu_memory * (1 - reserve)`` per rank on
    the device, and the offload pool's limit, 80% of ``host_memory`` per node split among
    its ``gpus`` ranks (what :class:`offload.HostBufferPool` allows itself).

    Depth: a step's memory is affine in the number of identical decoder layers, phase by
    phase (forward, backward, optimizer): each layer adds its parameter, gradient and
    optimizer shards and its offloaded (or kept) input, while the activation peak is one
    layer's. So unless ``full_trace``, a model deeper than 4 layers is traced at 3 and 4
    layers and each phase's figures are extended along that line to the real depth; the
    step's peak is the largest phase. ``tests/test_arctic_plan.py`` checks this against full traces.
    """
    world = gpus * nodes
    sp = stack_config(stack, world=world)
    divisor = sp.dims(world).seq_len_divisor  # the mesh's padding rule (layout, degrees)
    seq_len = -(-seq_len // divisor) * divisor
    config = model_config(model, layers=layers, max_positions=seq_len)
    host_limit = int(0.8 * host_memory) // gpus
    name = stack if isinstance(stack, str) else "custom"
    start = time.perf_counter()
    depth = config.num_hidden_layers
    if full_trace or depth <= TRACE_LAYERS[1]:
        phases, host, refused = _trace(config, sp, world, seq_len, shard=shard,
                                       host_limit=host_limit)
        peaks = {k: replace(v, host=host) for k, v in phases.items()}
    else:
        la, lb = TRACE_LAYERS
        traced = []
        for n in (la, lb):
            config.num_hidden_layers = n
            phases, host, refused = _trace(config, sp, world, seq_len, shard=shard,
                                           host_limit=1 << 62)
            traced.append({k: replace(v, host=host) for k, v in phases.items()})
        config.num_hidden_layers = depth
        peaks = {k: _extrapolate(traced[0][k], traced[1][k], la, lb, depth)
                 for k in traced[0]}
        host = max(p.host for p in peaks.values())
        refused = None
        if host > host_limit:
            refused = (f"offloading the inputs of {depth} checkpointed layers needs "
                       f"{host / GiB:.2f} GiB of host memory per rank, more than the offload "
                       f"limit of {host_limit / GiB:.2f} GiB")
    phase = max(peaks, key=lambda k: peaks[k].total)
    peak = replace(peaks[phase], host=host)
    return Estimate(model=model, stack=name, seq_len=seq_len, world=world, gpus_per_node=gpus,
                    sp={k: getattr(sp, k) for k in PLANNED_FIELDS},
                    peak=peak, device_budget=int(gpu_memory * (1 - reserve)),
                    host_budget=host_limit, refused=refused, peak_phase=phase,
                    phases={k: v.total for k, v in peaks.items()},
                    trace_s=time.perf_counter() - start)
