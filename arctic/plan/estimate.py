"""The planner's answer for one setting: trace the step, extend it to the model's depth and to
the sequence length, move the offloaded training state to the host, and compare the peaks
with the device and host budgets.

Two extensions keep a 32-layer, multi-million-token answer to a few short traces, each exact
for the step's structure (``tests/test_arctic_plan.py`` holds both to 1% of full traces):

- Depth: a step's memory is affine in the number of identical decoder layers, phase by phase
  (forward, backward, optimizer). Each layer adds its parameter, gradient and optimizer
  shards and its offloaded (or kept) input, while the activation peak is one layer's. A
  model deeper than 4 layers is traced at 3 and 4 and each phase is extended along the line.
- Length: at fixed settings, each phase's memory is affine in the sequence length. Layer
  inputs, offloaded bytes and attention buffers grow with it; parameters and state do not;
  "auto" tiles hold their temporaries to a fixed budget, however many tiles there are. A
  length beyond :data:`CHECK_TOKENS` per rank is read off the line through
  :data:`ANCHOR_TOKENS`, after a third trace (at :data:`CHECK_TOKENS`) confirms the line to
  :data:`CHECK_TOLERANCE`; if it does not, a line further up is tried, then the length is
  traced (:func:`_read_off_the_line`). ``quick`` skips the check.

Traces are cached on disk (:mod:`arctic.plan.cache`), so a search, a plot or the next run
reads them back instead of tracing again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from arctic.hf.anatomy import text_config_of
from arctic.memory.placement import Placement
from arctic.plan.models import is_vlm_config, model_config
from arctic.plan.step import PLANNED_FIELDS, pinned_blocks, stack_config
from arctic.plan.counts import predict_step
from arctic.plan.traces import Tracer, along
from arctic.plan.tracing import Peak
from arctic.plan.units import GiB
from arctic.plan.speed import Prediction, Rates

ALLOCATOR_HEADROOM = 1.12
"""Reserved over allocated bytes of the CUDA caching allocator with
``expandable_segments:True``, which every launch path of ours sets
(:func:`arctic.memory.allocator.use_expandable_segments`): measured on an H100, one rank of 8,
Llama-3-8B, 384K tokens per rank (38.19 / 33.96 GiB). The device budget for the traced
(allocated) bytes is the GPU's memory less the reserve, divided by this."""

VISION_NOTE = ("vision tower: its parameters, gradients and optimizer state are planned (the "
               "whole VLM is built and sharded); the activations of encoding a rank's images "
               "are not (vision towers compute their shapes from the image grid's values, "
               "which a trace without pixel values does not have): keep room for them")
"""What a VLM's plan leaves out: the step is traced on the merged sequence's tokens."""

ANCHOR_TOKENS = (49152, 98304)
"""Tokens per rank of the two traces whose line gives longer lengths. Each phase's peak is
the largest of several moments' bytes, each affine in the length, so the line bends where
another moment takes over: for Llama-3-8B on 8 ranks the forward peak's bend lies between
32K and 48K tokens per rank (the loss's fixed buffers give way to the layer inputs)."""

CHECK_TOKENS = 131072
"""Tokens per rank of the trace that checks the line; up to it, lengths are traced."""

CHECK_TOLERANCE = 0.005
"""How far (a fraction of the step's traced peak) the check trace may sit from the line."""

LINE_MISFITS = """A misfit read off a length line is taken only from a checked line (the
check trace within :data:`CHECK_TOLERANCE`), as a fit is, or from the length traced: a
phase's peak is not convex in the length, so an unchecked line bounds nothing. Past the
anchors a moment whose tiles stop growing at a cap of rows bends the peak downwards.
Qwen3.5-9B (ring 8, 8 layers, 16 sequence blocks): the attention layer's backward adds 5.71
hidden-sized rows per token per rank between 48K and 96K tokens per rank, 8.04 up to 128K
and 4.04 from there to 256K (a moment of its row-tiled work takes over and stops growing
with its tiles), so the line through 48K and 96K reads 68.03 GiB at 1.5M tokens per rank
where the trace holds 59.65; as a lower bound it took 12,042,240 tokens on 8 GPUs for a
misfit, where 13,033,472 fit traced (67.13 GiB)."""


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
    placement: Placement = field(default_factory=Placement)
    state_host: int = 0
    """Host bytes of the offloaded training state (in ``peak.host`` with the layer inputs)."""
    method: str = "traced"
    """How the figures were had: traced at this length, or read off the length line."""
    headroom: float = ALLOCATOR_HEADROOM
    disk: int = 0
    """Bytes of layer inputs spilled to the disk tier (``offload_dir``), of ``peak.host``."""
    disk_budget: int = 0
    """The disk tier's bytes per rank (0: no disk tier)."""
    notes: tuple[str, ...] = ()
    """What the figures leave out (:data:`VISION_NOTE`)."""
    prediction: Prediction | None = None
    """The step's predicted time (:mod:`arctic.plan.speed`), when planned with rates."""

    @property
    def fits(self) -> bool:
        return self.offload_fits and self.peak.total <= self.device_budget

    @property
    def offload_fits(self) -> bool:
        """Whether the offloaded bytes fit: the host's (or host and disk) budgets, nothing
        refused."""
        return self.refused is None and (self.peak.host <= self.host_budget or
                                         0 < self.disk <= self.disk_budget)

    def loads(self) -> tuple[float, float]:
        """The device and offload figures over their budgets (> 1: over), for the search.
        With a disk tier the offload figure is the host's and the disk's bytes (with the
        whole-layer rounding of the spill) over both budgets."""
        device = self.peak.total / self.device_budget
        if not self.disk:
            return device, self.peak.host / max(1, self.host_budget)
        layer = self.disk - (self.peak.host - self.host_budget)  # the spill's rounding
        return device, max(self.state_host / max(1, self.host_budget),
                           (self.peak.host + layer) / (self.host_budget + self.disk_budget))

    def limit(self) -> str:
        if self.refused is not None:
            return self.refused
        if self.disk > self.disk_budget or (self.disk and self.state_host > self.host_budget):
            return "host and disk for offloaded layer inputs"
        if self.peak.host > self.host_budget and not self.disk:
            return ("host memory for offloaded layer inputs" +
                    (" and training state" if self.state_host else ""))
        return max(self.peak.by_kind, key=self.peak.by_kind.get)

    def as_dict(self) -> dict:
        """The estimate as JSON-ready values: the CLI's ``--json`` and the benchmarks' records."""
        return {"seq_len": self.seq_len, "stack": self.stack, "sp": self.sp, "fits": self.fits,
                "limit": None if self.fits else self.limit(), **self.peak.summary(),
                "device_budget": self.device_budget, "host_budget": self.host_budget,
                "allocator_headroom": self.headroom, "state_offload": self.placement.mode,
                "state_host_bytes": self.state_host, "disk_bytes": self.disk,
                "disk_budget": self.disk_budget, "method": self.method,
                "trace_s": round(self.trace_s, 1), "notes": list(self.notes),
                "predicted": self.prediction.as_dict() if self.prediction else None}


def _line_checked(tracer: Tracer, anchors: tuple[int, int], check: int) -> float:
    """How far the trace at ``check`` tokens sits from the line through ``anchors``, at the
    shallower traced depth: the largest gap over phases, device figures as a fraction of the
    step's traced device peak, host figures of the traced host peak."""
    layers = min(tracer.depths())
    (na, nb), traced = anchors, tracer.at(check, layers)
    a, b = tracer.at(na, layers), tracer.at(nb, layers)
    scale = max(1, max(t.total for t in traced.values()))
    worst = 0.0
    for k, t in traced.items():
        guess = along(a[k], b[k], na, nb, check)
        worst = max(worst, *(abs(getattr(guess, f) - getattr(t, f)) / scale
                             for f in ("total", "stateless")),
                    abs(guess.host - t.host) / max(1, t.host))
    return worst


def _read_off_the_line(tracer: Tracer, seq_len: int, snap, *, quick: bool):
    """The phases at ``seq_len`` from the length line, and how they were had.

    The line through :data:`ANCHOR_TOKENS` is checked at :data:`CHECK_TOKENS`. A phase's peak
    mostly bends upwards (a steeper moment takes over), so when the check is off the line is
    tried once more from the check's trace up: through :data:`CHECK_TOKENS` and its double,
    checked at three times it. When that is off too, or the length is within it, the length
    itself is traced. Past the first anchors every trace is at the shallower depth alone,
    what the deeper layers add read off the line through what they add at the anchors
    (:meth:`Tracer.deep`'s ``anchors``).
    """
    sp_size = tracer.sp.sequence_parallel_size
    steps = [(ANCHOR_TOKENS, CHECK_TOKENS), ((CHECK_TOKENS, 2 * CHECK_TOKENS), 3 * CHECK_TOKENS)]
    first = tuple(snap(t * sp_size) for t in ANCHOR_TOKENS)
    low = min(tracer.depths())
    notes = []
    for (ta, tb), tc in steps:
        if quick and notes:
            break
        if seq_len // sp_size <= tb:  # within the anchors: trace it
            break
        na, nb, nc = snap(ta * sp_size), snap(tb * sp_size), snap(tc * sp_size)
        depths = (low,) if (na, nb) != first and tracer.steady(first) else tracer.depths()
        tracer.prefetch([(n, d) for n in (na, nb) for d in depths] +
                        ([] if quick else [(nc, low)]))
        off = 0.0 if quick else _line_checked(tracer, (na, nb), nc)
        if off <= CHECK_TOLERANCE:
            a, b = (tracer.deep(n, full=False, anchors=first) for n in (na, nb))
            how = (f"length line through {ta // 1024}K and {tb // 1024}K tokens/rank" +
                   (" (unchecked: quick)" if quick else f", checked at {tc // 1024}K to {off:.2%}"))
            return {k: along(a[k], b[k], na, nb, seq_len) for k in a}, "; ".join(notes + [how])
        notes.append(f"the line through {ta // 1024}K and {tb // 1024}K was {off:.2%} off at "
                     f"{tc // 1024}K")
    steady = len(tracer.depths()) == 2 and tracer.steady(first)
    tracer.prefetch([(seq_len, d) for d in (tracer.depths() if not steady else (low,))])
    deeper = "" if not steady else (
        f" at {low} layers, the deeper layers' bytes off their line through "
        f"{ANCHOR_TOKENS[0] // 1024}K and {ANCHOR_TOKENS[1] // 1024}K tokens/rank")
    return (tracer.deep(seq_len, full=False, anchors=first),
            f"traced{deeper} ({'; '.join(notes) or 'within anchors'})")


def plan(model: str, seq_len: int, *, gpus: int, nodes: int = 1, stack: str | dict = "ours",
         gpu_memory: int = 80 * GiB, host_memory: int = int(1.5 * 1024) * GiB,
         reserve: float = 0.05, headroom: float = ALLOCATOR_HEADROOM,
         placement: Placement | None = None, layers: int | None = None, shard: bool = True,
         full_trace: bool = False, quick: bool = False, line: bool = True,
         disk_memory: int = 0, rates: Rates | str | None = None,
         compute_dtype=None) -> Estimate:
    """Trace one training step of ``model`` at ``seq_len`` tokens over ``gpus * nodes`` ranks
    (rank 0) and compare its peak with the budgets: ``gpu_memory * (1 - reserve) / headroom``
    of allocated bytes per rank on the device (``reserve``: CUDA context and NCCL;
    ``headroom``: the caching allocator, :data:`ALLOCATOR_HEADROOM`), and 80% of
    ``host_memory`` per node split among its ``gpus`` ranks on the host (what
    :class:`offload.HostBufferPool` allows itself), shared by the offloaded layer inputs and
    the training state that ``placement`` offloads. ``disk_memory`` (per node, split among
    its ranks) is the disk tier's (``offload_dir``, :mod:`offload.disk`): the layer inputs the
    host cannot hold spill there, whole layers at a time (:func:`_spill`).

    ``full_trace`` traces every layer at the length itself; otherwise the depth and length
    lines of the module docstring apply (``line=False``: the depth line only, the length
    traced), ``quick`` skipping the length line's check.

    ``rates`` (a :class:`~arctic.plan.speed.Rates`, a name of
    :data:`~arctic.plan.speed.DEVICES` or a file ``--calibrate`` wrote): also predict the
    step's time from its counted work (:func:`step_work`, :func:`predict_step`).
    ``compute_dtype``: the step's compute dtype (default bf16, as the GPUs train).
    """
    if headroom < 1:
        raise ValueError(f"headroom is reserved / allocated bytes, >= 1; got {headroom}")
    placement = placement or Placement()
    world = gpus * nodes
    sp = stack_config(stack, world=world)
    divisor = sp.dims(world).seq_len_divisor  # the mesh's padding rule (layout, degrees)
    snap = lambda n: -(-n // divisor) * divisor  # noqa: E731
    seq_len = snap(seq_len)
    config = model_config(model, layers=layers)
    start = time.perf_counter()
    # traced with "auto" sizes pinned at this length: what runs at it, and what its lines read
    tracer = Tracer(config, pinned_blocks(sp, config, seq_len,
                                          compute_dtype=compute_dtype or torch.bfloat16),
                    world, shard=shard)
    budgets = dict(model=model, stack=stack, seq_len=seq_len, world=world, gpus=gpus,
                   sp=sp, config=config, placement=placement, host_memory=host_memory,
                   disk_memory=disk_memory,
                   device_budget=int(gpu_memory * (1 - reserve) / headroom), headroom=headroom)
    per_rank = seq_len // sp.sequence_parallel_size
    if full_trace or not line or per_rank <= CHECK_TOKENS:
        if not full_trace:
            tracer.prefetch([(seq_len, d) for d in tracer.depths()])
        e = _judged(tracer.deep(seq_len, full=full_trace), "traced", **budgets)
    else:
        # quick: the anchors' line alone; else checked, or the length traced (LINE_MISFITS)
        e = _judged(*_read_off_the_line(tracer, seq_len, snap, quick=quick), **budgets)
    return _predicted(e, rates, config, sp, world, shard, placement, compute_dtype, start)


def _predicted(e: Estimate, rates, config, sp, world: int, shard: bool, placement,
               compute_dtype, start: float) -> Estimate:
    """``e`` with its step time predicted (given ``rates``) and the time its plan took."""
    if rates is not None:
        e.prediction = predict_step(config, sp, world, e.seq_len, rates, shard=shard,
                                    placement=placement, peak=e.peak,
                                    compute_dtype=compute_dtype)
    e.trace_s = time.perf_counter() - start
    return e


def _judged(peaks: dict[str, Peak], method: str, *, model: str, stack, seq_len: int,
            world: int, gpus: int, sp, config, placement: Placement, host_memory: int,
            disk_memory: int, device_budget: int, headroom: float) -> Estimate:
    """The :class:`Estimate` of ``peaks`` (each phase's, as traced or read off the lines;
    ``method`` says which) against the budgets of :func:`plan`."""
    if placement.offloaded:
        peaks = {k: _offloaded(p, placement, phase=k) for k, p in peaks.items()}
    phase = max(peaks, key=lambda k: peaks[k].total)
    host = max(p.host for p in peaks.values())
    peak = replace(peaks[phase], host=host)
    state_host = placement.host_bytes(peak.shard_params) if placement.offloaded else 0
    host_limit = int(0.8 * host_memory) // gpus
    disk_limit = disk_memory // gpus
    depth = text_config_of(config).num_hidden_layers
    disk = _spill(host - state_host, state_host, host_limit, depth) if disk_limit else 0
    refused = None
    if disk and (disk > disk_limit or state_host > host_limit):
        refused = (f"the offloaded layer inputs and state need {host / GiB:.2f} GiB per rank, "
                   f"{disk / GiB:.2f} GiB of it on disk (whole layers), more than the host "
                   f"limit of {host_limit / GiB:.2f} GiB and the disk budget of "
                   f"{disk_limit / GiB:.2f} GiB allow")
    elif host > host_limit and not disk:
        refused = (f"the offloaded layer inputs and state need {host / GiB:.2f} GiB of host "
                   f"memory per rank, more than the offload limit of {host_limit / GiB:.2f} GiB")
    return Estimate(model=model, stack=stack if isinstance(stack, str) else "custom",
                    seq_len=seq_len, world=world, gpus_per_node=gpus,
                    sp={k: getattr(sp, k) for k in PLANNED_FIELDS}, peak=peak,
                    device_budget=device_budget, host_budget=host_limit, refused=refused,
                    peak_phase=phase, phases={k: v.total for k, v in peaks.items()},
                    placement=placement, state_host=state_host, method=method,
                    headroom=headroom, disk=disk, disk_budget=disk_limit,
                    notes=(VISION_NOTE,) if is_vlm_config(config) else ())


def _spill(inputs: int, state: int, host_limit: int, layers: int) -> int:
    """Bytes of the offloaded layer inputs (``inputs`` on the host without a disk tier) that
    the disk tier holds: at run time the pool's host limit is what the offloaded ``state``
    leaves (:func:`arctic.memory.placement.offload_pool_limit`); the tensor that does not fit, the
    rest of its layer and every later layer go to disk, so up to one layer more than the
    overflow (the layers' inputs being alike)."""
    over = inputs - max(0, host_limit - state)
    return 0 if over <= 0 else min(inputs, over + -(-inputs // max(1, layers)))


def _offloaded(p: Peak, placement: Placement, *, phase: str) -> Peak:
    """A phase's peak with the training state where ``placement`` puts it: the device keeps
    the phase's stateless peak plus the state it still holds; the host adds the state (and,
    for FSDP2's offload, torch's AdamW temporaries of the step, which then run on the host)."""
    n = p.shard_params
    device_state = placement.device_bytes(n)
    host = p.host + placement.host_bytes(n)
    if placement.mode == "fsdp2":
        host += max(0, p.by_kind["optimizer"] - p.optimizer_state) if phase == "optimizer" else 0
    by_kind = dict(p.by_kind, parameters=device_state, gradients=0, optimizer=0)
    rest = p.stateless - sum(v for k, v in by_kind.items() if k != "parameters")
    by_kind["temporaries"] += rest  # what the stateless peak holds beyond the kinds kept
    return replace(p, total=p.stateless + device_state, host=host, by_kind=by_kind)
