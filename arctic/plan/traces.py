"""Traces of one setting, through the disk cache: a step traced on fake tensors for its
memory (:func:`trace`, each phase's peak) or its work (:func:`_work_trace`), at any length and
depth (:class:`Tracer`), several at once in processes forked from a server that imported what
a trace needs once (:func:`start_workers`, :func:`prefetch`). :mod:`arctic.plan.estimate`
extends them to the model's depth and the sequence length."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import os
import warnings
from dataclasses import replace

from arctic.hf.anatomy import decoder_layers, text_config_of
from arctic.plan import workers
from arctic.plan.cache import PINNED, cache_dir, cached, code_version, is_cached, trace_key
from arctic.plan.step import (
    PLANNED_FIELDS,
    build,
    init_optimizer_state,
    make_batch,
    train_step,
)
from arctic.plan.tracing import (KINDS, Peak, buffer_pools, fake_world,
                                 plain_kernel_functions, track_peak)
from arctic.plan.work import Work, count_work
from ulysses.torch_internals import FakeTensorMode
from ulysses.trace_shortcuts import memory_trace, work_trace

TRACE_LAYERS = (3, 4)
"""Layer counts traced when a model's own count is larger (see :func:`plan`)."""

NUMBERS = ("total", "host", "stateless", "shard_params", "optimizer_state")


def along(a: Peak, b: Peak, xa: int, xb: int, x: int) -> Peak:
    """The peak at ``x`` on the line through ``a`` at ``xa`` and ``b`` at ``xb``."""
    def line(ya: int, yb: int) -> int:
        return int(round(ya + (yb - ya) * (x - xa) / (xb - xa)))

    values = {k: line(getattr(a, k), getattr(b, k)) for k in NUMBERS}
    return Peak(by_kind={k: line(a.by_kind[k], b.by_kind[k]) for k in KINDS},
                largest=(b if abs(x - xb) <= abs(x - xa) else a).largest, **values)


def layer_period(config) -> int:
    """The period of a hybrid model's ``layer_types`` (Qwen3.5: 3 linear-attention layers,
    then an attention layer: 4); 1 when every layer is of one kind."""
    types = list(getattr(text_config_of(config), "layer_types", None) or ())
    for p in range(1, len(types) + 1):
        if all(t == types[i % p] for i, t in enumerate(types)):
            return p
    return 1


def trace_layers(config) -> tuple[int, int]:
    """The two depths whose line gives a deeper model's phases: :data:`TRACE_LAYERS`, or for
    a hybrid model whose layers differ, two and three periods of its ``layer_types`` (each
    period then adds the same bytes; the model's depth is read along whole periods). Not one
    and two: in a one-period model the attention layer is the last, and its backward, the
    step's peak, overlaps no later layer's gradient reduction (Qwen3.5-9B, ring 8, 712K tokens
    per rank: a mixer layer's 0.81 GiB float32 reduce-scatter input held at 8 layers, not at
    4), so the line through 4 and 8 layers multiplied that one buffer by the periods
    (68.51 GiB at 32 layers against 63.62 traced whole; through 8 and 12: 63.62)."""
    p = layer_period(config)
    return TRACE_LAYERS if p == 1 else (2 * p, 3 * p)


def trace(config, sp, world: int, seq_len: int, *, shard: bool,
           shortcuts: bool = True) -> dict[str, Peak]:
    """One traced step: each phase's peak, with the offload pool's host peak (and that of the
    sequence-chunked attention's host blocks) in ``host``.
    ``shortcuts``: skip the work that allocates nothing or repeats
    (:mod:`ulysses.trace_shortcuts`): the peaks are the same, the trace's cost no longer
    grows with the tile counts.

    A trace reads the same in a process that traced before as in a fresh one, whenever the
    garbage collector runs (:func:`ulysses.torch_internals.step_mem_tracker`'s module
    tracking leaves no reference cycle that holds a tensor)."""
    import torch

    fake_world(world)
    mesh = sp.dims(world).build_mesh("cpu")  # outside: the mesh reads its rank map
    skipping = memory_trace() if shortcuts else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), skipping:
        model, optimizer = build(config, sp, mesh, device="cpu", shard=shard,
                                 host_memory_limit=1 << 62)  # the host is judged after
        init_optimizer_state(model, optimizer)
        batch = make_batch(seq_len, text_config_of(config).vocab_size, mesh, "cpu")
        session = getattr(model, "activation_offload", None)
        tracked = (model, optimizer, *filter(torch.is_tensor, batch.values()))
        with plain_kernel_functions(), track_peak(track=tracked, pools=buffer_pools(model),
                                                  state=(model, optimizer)) as tracker, \
                split_backward(model, tracker) as on_phase:
            train_step(model, optimizer, batch, on_phase=on_phase)
    host = session.pool.stats.peak_host_bytes if session is not None else 0
    # The sequence-chunked attention's parked kv blocks and dk/dv sums (ulysses.seq_chunk).
    host += sum(pool.stats.peak_host_bytes for pool in buffer_pools(model))
    return {k: replace(v, host=host) for k, v in tracker.phases.items()}


BACKWARD_PHASES = ("backward", "backward: top layer", "backward: middle layers",
                   "backward: bottom layer", "backward: tail")
"""The phases of a traced step's backward (:func:`split_backward`), in its order."""


def backward_peak(phases: dict):
    """The largest of ``phases``' backward phases (:data:`BACKWARD_PHASES`)."""
    return max((p for k, p in phases.items() if k in BACKWARD_PHASES), key=lambda p: p.total)


@contextlib.contextmanager
def split_backward(model, tracker):
    """Yields the ``on_phase`` of a traced step whose backward is five phases
    (:data:`BACKWARD_PHASES`): until the gradient of the top decoder layer's output is made
    ("backward": the loss, the head and the final norm); the top layer's backward; the
    middle layers' (their largest); the bottom layer's (each layer's ending where the
    gradient of its input is made, its reductions included); and the tail (the input
    embedding's backward, the last reductions). Each is affine in the depth on its own,
    their largest not: a layer's backward holds the gradient shards of the layers above it,
    so the moments lower down grow faster with the depth, and past the traced depths they
    can take over (Llama-3-8B, 32K tokens per rank on 8 ranks: the backward's peak is the
    head's at 3 to 5 layers, at 9 the tail's with the ``ours`` stack and the bottom layer's
    with ALST's; one backward phase read off 3 and 4 layers was 3.2% under the trace of 9
    with either; see
    ``test_depth_extrapolation_matches_a_full_trace``). A model whose decoder layers or
    input embeddings are not found keeps one backward phase."""
    import torch

    layers = decoder_layers(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not layers or embedding is None:
        yield tracker.end_phase
        return
    names = {len(layers) - 1: BACKWARD_PHASES[1], 0: BACKWARD_PHASES[3]}
    state = {"forward": True, "split": False}

    def ended(name: str):
        def hook(grad):
            state["split"] = True
            tracker.end_phase(name, last_backward=False)
            return grad
        return hook

    def watch(name: str):
        def hook(module, args, output) -> None:
            out = output if torch.is_tensor(output) else next(
                (t for t in (output if isinstance(output, (tuple, list)) else ())
                 if torch.is_tensor(t)), None)
            # (in the forward alone: a checkpointed layer runs again in the backward)
            if state["forward"] and out is not None and out.requires_grad:
                out.register_hook(ended(name))
        return hook

    # the gradient of layer i's output ends the backward before it: the head's above the
    # top layer, layer i + 1's below it; the embedding's output, the bottom layer's
    watched = [(layers[-1], BACKWARD_PHASES[0])]
    watched += [(layers[i], names.get(i + 1, BACKWARD_PHASES[2]))
                for i in range(len(layers) - 1)]
    watched.append((embedding, names[0]))
    handles = [m.register_forward_hook(watch(name)) for m, name in watched]

    def on_phase(name: str) -> None:
        if name == "forward":
            state["forward"] = False
        if name == "backward" and state["split"]:
            tracker.end_phase(BACKWARD_PHASES[4], last_backward=True)
        else:
            tracker.end_phase(name)

    try:
        yield on_phase
    finally:
        for h in handles:
            h.remove()


def _work_trace(config, sp, world: int, seq_len: int, *, shard: bool,
                compute_dtype, shortcuts: bool = True) -> Work:
    """One traced step's work (:func:`arctic.plan.work.count_work`). ``shortcuts``: the
    loops that weigh their iterations leave repeats out and count them on the iteration
    before (:func:`ulysses.trace_shortcuts.work_trace`): the same counts, at the cost of a
    few iterations per loop. The offload pools' copies are counted from their statistics (a
    trace copies nothing)."""
    fake_world(world)
    mesh = sp.dims(world).build_mesh("cpu")
    skipping = work_trace() if shortcuts else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), skipping:
        model, optimizer = build(config, sp, mesh, device="cpu", shard=shard,
                                 host_memory_limit=1 << 62, compute_dtype=compute_dtype)
        init_optimizer_state(model, optimizer)
        batch = make_batch(seq_len, text_config_of(config).vocab_size, mesh, "cpu")
        with count_work() as work:
            train_step(model, optimizer, batch)
    session = getattr(model, "activation_offload", None)
    if session is not None:
        stats = session.pool.stats
        work.host_copy += stats.bytes_offloaded
        if session.prefetch:
            work.host_copy += stats.bytes_restored
        else:  # copied back on the compute's stream
            work.host_restore += stats.bytes_restored
    return work


HELD: list[str] = []
"""The warnings the traces of this process and of its workers gave (:func:`held_warnings`):
the planner's answer carries their count in one line, not the warnings themselves."""


class _Hold(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        HELD.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def held_warnings():
    """Python warnings, and the ``transformers`` and ``torch`` loggers' records, given while
    tracing (a kernel's reference fallback, MemTracker's skipped hooks on fake tensors): kept
    in :data:`HELD` instead of printed."""
    loggers = [logging.getLogger(name) for name in ("transformers", "torch")]
    saved = [(lg, lg.handlers, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers, lg.propagate = [_Hold(logging.WARNING)], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield
            finally:
                HELD.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate


def held_summary() -> str | None:
    """One line on :data:`HELD`, or None when the traces gave no warning."""
    if not HELD:
        return None
    distinct = list(dict.fromkeys(HELD))
    return (f"note: tracing gave {len(HELD)} warning(s), {len(distinct)} distinct, held back "
            f"(ARCTIC_PLAN_WARNINGS=1 prints them); the first: {distinct[0][:160]}")


_TRACING = threading.Lock()
"""Held by a trace that runs in this process (:meth:`Tracer.at`)."""


def _trace_in_worker(job) -> list[str]:
    """Trace ``job`` into the disk cache it names (the caller's now: the fork server's
    environment is the one it started with); returns the warnings it gave (:data:`HELD`)."""
    config, sp, world, shard, seq_len, layers, work, dtype, cache, version = job
    os.environ["ARCTIC_PLAN_CACHE"] = cache
    PINNED[:] = [version]  # the caller's keys, whatever the files read now
    workers.IN_WORKER.append(True)
    del HELD[:]
    Tracer(config, sp, world, shard=shard, work=work,
           compute_dtype=dtype).at(seq_len, layers)
    return list(HELD)


class Tracer:
    """Traces of one setting at any length and depth, through the disk cache: each phase's
    peak, or with ``work`` the step's work (:func:`_work_trace`)."""

    def __init__(self, config, sp, world: int, *, shard: bool, work: bool = False,
                 compute_dtype=None) -> None:
        import torch

        self.config, self.sp, self.world, self.shard = config, sp, world, shard
        self.work, self.compute_dtype = work, compute_dtype or torch.bfloat16
        self.fields = {k: getattr(sp, k) for k in PLANNED_FIELDS}
        if work or self.compute_dtype != torch.bfloat16:
            self.fields.update(counted="work" if work else "memory",
                               compute_dtype=str(self.compute_dtype))
        # the model's own; None: no positions to bound (a state-space model: Mamba2)
        self.positions = getattr(text_config_of(config), "max_position_embeddings", None)

    def _shaped(self, seq_len: int, layers: int):
        """A copy of the config with ``layers`` layers and room for ``seq_len`` positions
        (the traced length's, not the planned one's: the line's traces serve every length).
        A copy, since building a model writes to its config (``dtype``), which would change
        the cache keys of every later trace in this process."""
        config = copy.deepcopy(self.config)
        text_config_of(config).num_hidden_layers = layers
        if self.positions is not None:
            text_config_of(config).max_position_embeddings = max(self.positions, seq_len)
        return config

    def _key(self, seq_len: int, layers: int) -> str:
        return trace_key(self._shaped(seq_len, layers), self.fields, world=self.world,
                         seq_len=seq_len, shard=self.shard)

    def at(self, seq_len: int, layers: int):
        config = self._shaped(seq_len, layers)
        key = trace_key(config, self.fields, world=self.world, seq_len=seq_len,
                        shard=self.shard)
        _wait(key)
        if workers.in_workers(1) and not is_cached(key):
            prefetch([(self, seq_len, layers)])  # in the workers, which already run
        if not workers.IN_WORKER and not is_cached(key):
            workers.TRACED_HERE.append(True)
        # (held only around a trace here: a read of the cache warns of nothing, and the
        # searches read from several threads, which warnings' state is not safe in; a trace
        # here runs alone: what it swaps in the model files and torch is the process's)
        tracing = not is_cached(key)
        with _TRACING if tracing else contextlib.nullcontext(), \
                held_warnings() if tracing else contextlib.nullcontext():
            if self.work:
                work, _ = cached(key, lambda: _work_trace(
                    config, self.sp, self.world, seq_len, shard=self.shard,
                    compute_dtype=self.compute_dtype), encode=Work.as_dict,
                    decode=lambda d: Work(**d))
                return work
            phases, _ = cached(key, lambda: trace(config, self.sp, self.world, seq_len,
                                                  shard=self.shard))
            return phases

    def prefetch(self, jobs: list[tuple[int, int]]) -> None:
        """Trace the ``(seq_len, layers)`` jobs not yet cached in the worker processes
        (:func:`prefetch`); each writes the cache, where :meth:`at` then reads it."""
        prefetch([(self, n, d) for n, d in jobs])

    def job(self, seq_len: int, layers: int) -> tuple:
        return (self.config, self.sp, self.world, self.shard, seq_len, layers, self.work,
                self.compute_dtype, str(cache_dir()), code_version())

    def depths(self) -> tuple[int, ...]:
        depth = text_config_of(self.config).num_hidden_layers
        traced = trace_layers(self.config)
        return (depth,) if depth <= traced[1] else traced

    def steady(self, anchors: tuple[int, int]) -> bool:
        """Whether the deeper layers add the same device bytes at both ``anchors`` (to
        :data:`STEADY`), phase by phase: their state alone, the step's peak at the same
        moment at both depths, so that :func:`deepened` holds past them. Not so where
        the layers keep their inputs on the device (the bytes grow with the length) or
        where the shallower depth peaks elsewhere: Qwen3.5-9B on Ulysses 8 at 48K tokens
        per rank, 8 layers peak 0.49 GiB under 12 in the backward, at 96K 1.61 GiB under
        (the state of 4 layers), and a line through them read 234K tokens per rank as
        67.83 GiB against 48.42 traced at both depths."""
        la, lb = trace_layers(self.config)
        (a0, a1), (b0, b1) = ((self.at(n, la), self.at(n, lb)) for n in anchors)
        return all(abs((a1[k].total - a0[k].total) - (b1[k].total - b0[k].total))
                   <= STEADY * b1[k].total for k in a0)

    def deep(self, seq_len: int, *, full: bool,
             anchors: tuple[int, int] | None = None) -> dict[str, Peak]:
        """The phases at the model's depth: traced whole, or along :func:`trace_layers`.
        ``anchors``: two lengths traced at both depths; ``seq_len`` is then traced at the
        shallower depth alone, and what the deeper layers add is read off the line through
        what they add at the anchors (:func:`deepened`)."""
        depth = text_config_of(self.config).num_hidden_layers
        la, lb = trace_layers(self.config)
        if full or depth <= lb:
            return self.at(seq_len, depth)
        if anchors is not None and seq_len not in anchors and self.steady(anchors):
            return deepened(self.at(seq_len, la), *(self.deep(n, full=False) for n in anchors),
                            *(self.at(n, la) for n in anchors), anchors, seq_len)
        self.prefetch([(seq_len, d) for d in (la, lb)])
        a, b = self.at(seq_len, la), self.at(seq_len, lb)
        return {k: along(a[k], b[k], la, lb, depth) for k in a}


STEADY = 0.001
"""How far apart (a fraction of the deeper trace's peak) the device bytes the deeper layers
add at the two anchors may be for :meth:`Tracer.steady`."""


def deepened(shallow: dict[str, Peak], deep_a: dict[str, Peak], deep_b: dict[str, Peak],
             shallow_a: dict[str, Peak], shallow_b: dict[str, Peak], anchors: tuple[int, int],
             seq_len: int) -> dict[str, Peak]:
    """The phases at the model's depth at ``seq_len``, from ``shallow`` (traced there at the
    shallower depth) and what the deeper layers add at the two ``anchors`` lengths (``deep_*``
    less ``shallow_*``), on the line through them: each layer adds its state (the same at
    any length) and the inputs it keeps (in proportion to the length), also where the peak's
    moment bends the length line. On Qwen3.5-9B (ring 8, mixer chunks) the line through 48K
    and 96K tokens per rank gave the increment at 128K, 256K, 280K and 626K tokens per rank
    to the byte in the backward and on the host (the peak), and 0.01% over in the forward."""
    na, nb = anchors
    out = {}
    for k, p in shallow.items():
        more = along(deep_a[k], deep_b[k], na, nb, seq_len)
        less = along(shallow_a[k], shallow_b[k], na, nb, seq_len)
        out[k] = Peak(by_kind={x: p.by_kind[x] + more.by_kind[x] - less.by_kind[x]
                               for x in KINDS}, largest=p.largest,
                      **{x: getattr(p, x) + getattr(more, x) - getattr(less, x)
                         for x in NUMBERS})
    return out


def prefetch(jobs: list[tuple[Tracer, int, int]], *, wait: bool = True) -> None:
    """Trace the ``(tracer, seq_len, layers)`` jobs not yet cached, in the worker processes
    (:mod:`arctic.plan.workers`; several settings' traces share them), memory traces ahead
    of work traces and each kind in the order given. ``wait=False``: return once they are
    queued; a later :func:`prefetch` or :meth:`Tracer.at` of a queued job waits for it
    instead of queueing it again (so a caller can trace one thing while the workers trace
    what it needs next)."""
    todo = [(t, n, d) for t, n, d in jobs if not is_cached(t._key(n, d))]
    todo = list({t._key(n, d): (t, n, d) for t, n, d in todo}.values())
    todo.sort(key=lambda j: (-j[2], -j[1]))  # deepest first: the workers finish together
    if not todo or not workers.in_workers(len(todo)):
        return
    for t, n, d in todo:
        workers.submit(t._key(n, d), _trace_in_worker, t.job(n, d), first=not t.work)
    if wait:
        for t, n, d in todo:
            _wait(t._key(n, d))


def _wait(key: str) -> None:
    """Wait for the queued trace ``key`` (if it is) and keep the warnings it gave."""
    HELD.extend(workers.wait(key) or ())
