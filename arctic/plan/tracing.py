"""Tracing a step under FakeTensorMode: the fake world of ranks, and the peak tracker.

Why a tracer and not a formula: the step's peak depends on the order in which everything
the recipe does allocates and frees (tiles, recomputes, prefetches, FSDP's gathers), and
MemTracker sees that order as it runs. The tracker below adds what the planner reports: the
peak per phase, the chunk buffers of head-chunked attention apart from other temporaries
(through the pools' :attr:`ulysses.BufferPool.on_allocate` hook), and what is alive at the
peak, by the op and module that made it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from arctic.hf.binding import module_function
from arctic.hf.mixers import Dispatch
from ulysses import BufferPool, trace_shortcuts
from ulysses.torch_internals import fake_store, mem_tracker, step_mem_tracker_class


def fake_world(world: int) -> None:
    """Make this process rank 0 of ``world`` ranks on torch's fake process group (replacing
    an earlier fake group of another size). Refuses a real process group."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise ValueError("the planner needs a process of its own: a real process group "
                             "is initialized here")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)


KINDS = ("parameters", "gradients", "optimizer", "activations", "attention buffers",
         "temporaries")


@dataclass
class Peak:
    """Per-rank device memory at the peak of a traced step, and the host bytes of offload."""

    total: int
    by_kind: dict[str, int]
    host: int = 0
    largest: list = field(default_factory=list)
    """What is alive at the peak, grouped by the op and module that made it:
    ``(label, tensors, bytes)``, largest first (at the last 1% step of the peak's climb)."""
    stateless: int = 0
    """The phase's peak with the sharded training state left out: the most, over the phase,
    of the live bytes less the parameter shards, the optimizer's state and the gradient
    shards alive at that moment. What the device holds besides that state when the state
    is offloaded (:mod:`arctic.memory.placement`); in the optimizer phase, the bytes alive as it
    starts (an offloaded optimizer steps on the host)."""
    shard_params: int = 0
    """Parameters in this rank's shards (the state's size:
    :class:`arctic.memory.placement.Placement`)."""
    optimizer_state: int = 0
    """Bytes of the optimizer's state (AdamW's moments) of this rank."""

    def summary(self) -> dict:
        return {"device_peak_bytes": self.total, "by_kind": dict(self.by_kind),
                "host_peak_bytes": self.host, "stateless_peak_bytes": self.stateless,
                "shard_params": self.shard_params, "optimizer_state_bytes": self.optimizer_state,
                "largest_at_peak": [{"made_by": k, "tensors": c, "bytes": b}
                                    for k, c, b in self.largest]}


def _tracker_class():
    """The tracker's class, made when a trace runs: it subclasses torch's private MemTracker,
    which importing the planner should not need."""
    _, _TOTAL_KEY, _MemRefType, get_untyped_storages = mem_tracker()
    from torch.utils.weak import WeakIdKeyDictionary

    names = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters",
             _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer",
             _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
             _MemRefType.OTH: "temporaries"}

    class Tracker(step_mem_tracker_class()):
        """MemTracker (the step's peak alone) that also notes, at each new peak, the bytes
        of head-chunk buffers (storages that the traced pools created) alive then."""

        def __init__(self) -> None:
            super().__init__()
            self.pool_storages: weakref.WeakSet = weakref.WeakSet()
            self.pool_at_peak: dict = {}
            self.phases: dict[str, Peak] = {}
            self.labels = WeakIdKeyDictionary()  # storage -> (what made it, bytes)
            self.largest_at_peak: dict = {}
            self._labeled_at: dict = {}
            self._op = "before the step"
            self.state_params: list = []  # the sharded parameters (their .grad: grad shards)
            self.state_fixed = 0  # parameter shards + optimizer state: alive all step
            self.optimizer_state = 0
            self.stateless_peak = 0
            self._state_frozen = False

        def set_state(self, params, optimizer) -> None:
            """Note the training state (sharded parameters and ``optimizer``'s state) whose
            bytes :attr:`Peak.stateless` leaves out."""
            self.state_params = list(params)
            self.optimizer_state = sum(st.nbytes() for state in optimizer.state.values()
                                       for v in state.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0
                                       for st in get_untyped_storages(v))
            self.state_fixed = self.optimizer_state + sum(
                st.nbytes() for p in self.state_params for st in get_untyped_storages(p))

        def _grad_shards(self) -> int:
            # each storage once: FSDP2's gradient shards can be views of one flat buffer
            storages = {st for p in self.state_params if p.grad is not None
                        for st in get_untyped_storages(p.grad)}
            return sum(st.nbytes() for st in storages)

        def _note_stateless(self, total: int) -> None:
            # total - fixed bounds total - state from above; only then walk the gradients
            if not self._state_frozen and total - self.state_fixed > self.stateless_peak:
                self.stateless_peak = max(self.stateless_peak,
                                          total - self.state_fixed - self._grad_shards())

        def _tracked_dispatch(self, func, types, args, kwargs):
            self._op = func.__name__.split(".")[0]
            return super()._tracked_dispatch(func, types, args, kwargs)

        def _track(self, reftype, t) -> None:
            super()._track(reftype, t)
            for st in get_untyped_storages(t):
                if st not in self.labels:
                    # the innermost module; of siblings alike in depth (k_proj and v_proj
                    # in a backward), the same one in every process (a set's order is not)
                    where = max(self._mod_tracker.parents, key=lambda m: (len(m), m),
                                default="")
                    phase = "backward" if self._mod_tracker.is_bw else "forward"
                    self.labels[st] = (f"{self._op} in {where or 'the step'} ({phase})",
                                       st.nbytes(), t.device.type)

        def label_like(self, new, like) -> None:
            """Label ``new`` (a stand-in: :func:`ulysses.trace_shortcuts.stand_in`) as what
            made ``like``."""
            for st, was in zip(get_untyped_storages(new), get_untyped_storages(like)):
                if was in self.labels:
                    label, _, device = self.labels[was]
                    self.labels[st] = (label, st.nbytes(), device)

        def _largest(self, top: int = 6) -> list[tuple[str, int, int]]:
            """The live storages grouped by what made them: (label, count, bytes), largest
            first."""
            groups: dict[str, list[int]] = {}
            for label, nbytes, device in list(self.labels.values()):
                if device == "meta":  # the offload pool's host buffers (planned, not real)
                    continue
                g = groups.setdefault(label, [0, 0])
                g[0] += 1
                g[1] += nbytes
            return sorted(((k, c, b) for k, (c, b) in groups.items()),
                          key=lambda x: -x[2])[:top]

        def end_phase(self, name: str, device_type: str = "cpu", *,
                      last_backward: bool | None = None) -> None:
            """Note the peak since the last phase ended as ``name``'s, and start anew (a
            phase ended more than once, in segments, keeps their largest peak).
            ``last_backward``: whether the step's backward ends here (what the step then
            allocates is the optimizer's); by default, where ``name`` is "backward"."""
            peak = self.breakdown(device_type)
            peak.stateless = self.stateless_peak
            peak.shard_params = sum(p.numel() if not hasattr(p, "to_local") else
                                    p.to_local().numel() for p in self.state_params)
            peak.optimizer_state = self.optimizer_state
            was = self.phases.get(name)
            if was is not None:
                stateless = max(was.stateless, peak.stateless)
                peak = peak if peak.total > was.total else was
                peak.stateless = stateless
            self.phases[name] = peak
            now = sum(s[_TOTAL_KEY] for d, s in self._curr_mem_snap.items()
                      if d.type == device_type)
            self.stateless_peak = now - self.state_fixed - self._grad_shards()
            # An offloaded optimizer steps on the host: what the step allocates after the
            # backward is not device memory then.
            self._state_frozen = (name == "backward" if last_backward is None
                                  else last_backward)
            self._labeled_at = {}
            self._peak_mem = {d: s[_TOTAL_KEY] for d, s in self._curr_mem_snap.items()}
            self._peak_mem_snap = {d: dict(s) for d, s in self._curr_mem_snap.items()}
            self.pool_at_peak = {d: sum(st.nbytes() for st in list(self.pool_storages))
                                 for d in self._curr_mem_snap}

        def _at_allocation(self, dev, total: int) -> None:
            if dev.type == "cpu":  # the device; "meta" holds the offload pool's buffers
                self._note_stateless(total)

        def _at_new_peak(self, dev, total: int) -> None:
            # (one device per trace; fake storages report "meta")
            self.pool_at_peak[dev] = sum(st.nbytes() for st in list(self.pool_storages))
            # What is alive at the peak, for the report; refreshed when the peak grew by 1%
            # (each refresh walks every live storage).
            if total > 1.01 * self._labeled_at.get(dev, 0):
                self._labeled_at[dev] = total
                self.largest_at_peak[dev] = self._largest()

        def breakdown(self, device_type: str) -> Peak:
            snaps = {d: s for d, s in self.get_tracker_snapshot("peak").items()
                     if d.type == device_type}
            if not snaps:
                return Peak(0, dict.fromkeys(KINDS, 0))
            dev, snap = next(iter(snaps.items()))
            kinds = dict.fromkeys(KINDS, 0)
            for ref, value in snap.items():
                if ref in names:
                    kinds[names[ref]] += value
            pool = self.pool_at_peak.get(dev, 0)
            kinds["attention buffers"] = pool
            # Pool buffers were counted as activations (forward) or temporaries (backward).
            for k in ("temporaries", "activations"):
                take = min(pool, kinds[k])
                kinds[k] -= take
                pool -= take
            return Peak(snap["Total"], kinds, largest=list(self.largest_at_peak.get(dev) or []))

    return Tracker


def buffer_pools(model: nn.Module) -> list[BufferPool]:
    """The head-chunk buffer pools of ``model``'s SP attention modules, each once.

    :func:`arctic.apply_sequence_parallel` gives all attention modules of a model one shared
    pool when chunking (none without), recorded in each module's ``sp_attention`` settings;
    this is how a tracer reaches it (:func:`track_peak`'s ``pools``).
    """
    pools: list[BufferPool] = []
    for m in model.modules():
        pool = getattr(getattr(m, "sp_attention", None), "pool", None)
        if pool is not None and not any(pool is p for p in pools):
            pools.append(pool)
    return pools


def _module_of_a_function(value) -> bool:
    """Whether ``value`` is the ``kernels`` package's module of a function (no parameters, no
    submodules, a forward that calls one function; see
    :func:`arctic.hf.binding.module_function`)."""
    return (isinstance(value, nn.Module) and not any(True for _ in value.parameters()) and
            not any(True for _ in value.children()) and
            module_function(value) is not None)


@contextlib.contextmanager
def plain_kernel_functions():
    """Within the block, the functions that transformers' model files hold as the ``kernels``
    package's modules of a function (5.25 with ``kernels`` installed: ``causal_conv1d_forward``,
    the scans, ``apply_rotary_pos_emb``) are the functions they call, as without ``kernels``
    (the module calls it until the model is kernelized: the same ops). A traced step that
    calls them as modules, each one module shared by every layer, held more at the
    backward's peak, and more at some depths than others (a tiny Qwen3.5 on a ring of 8 at 8,
    12 and 16 layers: 307,740,608, 331,697,892 and 361,751,032 bytes, the line through 8
    and 12 1.7% under the trace at 16; with the functions, as without ``kernels``:
    303,544,000, 329,400,532 and 355,257,064, exactly a line). Entered after the model is
    built, when its files are imported and sequence parallelism wrapped their functions."""
    swapped: list[tuple[object, str, object, object]] = []
    for name, file in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or file is None:
            continue
        for attr, value in list(vars(file).items()):
            holder = value if isinstance(value, Dispatch) else None
            inner = holder.original if holder is not None else value
            if _module_of_a_function(inner):
                target = holder if holder is not None else file
                key = "original" if holder is not None else attr
                plain = module_function(inner)
                swapped.append((target, key, inner, plain))
                setattr(target, key, plain)
    try:
        yield
    finally:
        for target, key, inner, plain in reversed(swapped):
            current = getattr(target, key)
            if isinstance(current, Dispatch) and current.original is plain:
                current.original = inner  # sequence parallelism wrapped it meanwhile
            elif current is plain:
                setattr(target, key, inner)


@contextlib.contextmanager
def track_peak(*, track=(), pools: Sequence[BufferPool] = (), state=None):
    """Track every storage allocated inside the block (plus ``track``: modules, optimizers,
    tensors that exist before it). Yields the tracker; ``tracker.breakdown("cpu")`` after.
    ``state=(model, optimizer)`` names the training state that each phase's
    :attr:`Peak.stateless` leaves out.

    The buffers that ``pools`` (:func:`buffer_pools`) create inside the block are reported as
    "attention buffers": the block sets each pool's :attr:`ulysses.BufferPool.on_allocate`
    hook to note them, and puts the previous hook back at its end.
    """
    tracker = _tracker_class()()
    tracker.track_external(*track)
    if state is not None:
        tracker.set_state(state[0].parameters(), state[1])
    before = [pool.on_allocate for pool in pools]

    def note(buf: torch.Tensor) -> None:
        tracker.pool_storages.add(buf.untyped_storage())

    for pool in pools:
        pool.on_allocate = note
    try:
        with tracker, trace_shortcuts.stand_ins_noted(tracker.label_like):
            yield tracker
    finally:
        for pool, hook in zip(pools, before):
            pool.on_allocate = hook
