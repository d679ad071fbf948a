"""A step's work, counted on a few traces and read off at any length and depth, and its
predicted time (:mod:`arctic.plan.speed`).

Apart from :mod:`arctic.plan.estimate` (memory) because work adds up where memory peaks: a
step's work is affine in its depth from one layer on, and in its length but for attention's
``c n^2 + d n``, so two depths at two short lengths give it at any size; and two settings
apart only inside the decoder layers (:data:`INSIDE_FIELDS`) do the same work outside them, so
one's layers are counted at one depth against the other's outside (:func:`step_work`).
"""

from __future__ import annotations

from arctic.hf.anatomy import text_config_of
from arctic.memory.placement import Placement
from arctic.plan.speed import Prediction, predict, rates_from
from arctic.plan.step import PLANNED_FIELDS
from arctic.plan.traces import Tracer, layer_period, prefetch
from arctic.plan.tracing import Peak
from arctic.plan.work import CLASSES, Work, model_flops


WORK_TOKENS = 4096
"""Tokens per rank up to which a step's work is counted at its own length. Longer steps are
read off counts at half this and at this: every class but attention is affine in the length
(tiles, chunks and hops repeat the same work over more tokens), and attention's FLOPs are
``c n^2 + d n`` (exactly so for one causal document)."""


def step_work(config, sp, world: int, seq_len: int, *, shard: bool = True,
              compute_dtype=None, outside=None) -> Work:
    """The work of one step of ``config`` at ``seq_len`` tokens with settings ``sp`` over
    ``world`` ranks, rank 0's (:mod:`arctic.plan.work`), counted on traces (cached) at two
    depths (:func:`work_depths`) and, past :data:`WORK_TOKENS` per rank, two lengths.

    ``outside``: settings whose step differs from ``sp``'s in the decoder layers only (in
    :data:`INSIDE_FIELDS`, :func:`shares_outside`): their two depths give the work outside
    the layers, and ``sp``'s layers are counted at the shallower depth alone, half its traces
    (the counts are the same: tests/test_arctic_plan_speed.py)."""
    tracer, lengths, depths = _work_jobs(config, sp, world, seq_len, shard=shard,
                                         compute_dtype=compute_dtype)
    depth = text_config_of(config).num_hidden_layers
    da, db = work_depths(config)
    ref = _outside_jobs(config, sp, world, seq_len, outside, shard=shard,
                        compute_dtype=compute_dtype)
    jobs = [(tracer, n, d) for n in lengths for d in (depths if ref is None else depths[:1])]
    prefetch(jobs + ([(ref, n, d) for n in lengths for d in depths] if ref else []))

    def deep(n: int) -> Work:
        if len(depths) == 1:
            return tracer.at(n, depth)
        a = tracer.at(n, da)
        if ref is None:
            b = tracer.at(n, db)
        else:  # the outside's work (at no layers, on the line) and this one's layers
            b = a + a - (ref.at(n, da).scaled(2) - ref.at(n, db))
        return a + (b - a).scaled((depth - da) / (db - da))

    if len(lengths) == 1:
        return deep(seq_len)
    (na, nb), (wa, wb) = lengths, (deep(lengths[0]), deep(lengths[1]))
    values = {}
    for k in CLASSES:
        ya, yb = getattr(wa, k), getattr(wb, k)
        if k.startswith("attention"):  # c n^2 + d n through both counts
            c = (yb / nb - ya / na) / (nb - na)
            values[k] = c * seq_len ** 2 + (ya / na - c * na) * seq_len
        else:
            values[k] = ya + (yb - ya) * (seq_len - na) / (nb - na)
    return Work(**values)


def _work_jobs(config, sp, world: int, seq_len: int, *, shard: bool, compute_dtype):
    """The tracer, lengths and depths :func:`step_work` counts."""
    tracer = Tracer(config, sp, world, shard=shard, work=True, compute_dtype=compute_dtype)
    depth = text_config_of(config).num_hidden_layers
    da, db = work_depths(config)
    depths = (depth,) if depth <= db else (da, db)
    divisor = sp.dims(world).seq_len_divisor
    size = sp.sequence_parallel_size
    if seq_len // size <= WORK_TOKENS:
        lengths = (seq_len,)
    else:
        lengths = tuple(-(-n * size // divisor) * divisor for n in (WORK_TOKENS // 2, WORK_TOKENS))
    return tracer, lengths, depths


INSIDE_FIELDS = ("head_chunk_size", "fuse_projections", "seq_chunk", "recompute_attention",
                 "tiled_layer", "mixer_parallelism", "mixer_chunk")
"""The settings that change a step's work inside its decoder layers only (attention's
chunks and exchanges, what a layer keeps or recomputes, its tail, its token mixers), so that
two settings apart in these alone do the same work outside the layers (the embedding, the
last norm, the logits and loss, the optimizer, the first and last layers' edges). The others
change it outside too: the ring (the zigzag order of the labels), the tiled MLP (the last
norm's tiles), the offload and the checkpointing (the edges' copies), the loss tiles; the
ring by being there, not by its degree (:func:`outside_key`)."""


def outside_key(sp) -> tuple:
    """What the work outside the decoder layers depends on, of ``sp`` (settings, or a dict of
    every planned field): the planned fields but :data:`INSIDE_FIELDS`, the ring degree as
    whether there is a ring (rings of 2, 4 and 8 count the same outside, to the byte), and
    checkpointing and offload as whether layer inputs are offloaded (checkpointing without
    offload and neither count the same outside; the prefetch only with offload)."""
    get = sp.get if isinstance(sp, dict) else lambda k: getattr(sp, k)
    offloaded = bool(get("activation_checkpointing") and get("offload_activations"))
    key = {k: get(k) for k in PLANNED_FIELDS if k not in INSIDE_FIELDS}
    key.update(ring_degree=get("ring_degree") > 1, activation_checkpointing=offloaded,
               offload_activations=offloaded,
               offload_prefetch=get("offload_prefetch") if offloaded else None)
    return tuple(key.items())


def shares_outside(sp, other) -> bool:
    """Whether ``sp`` and ``other`` count the same work outside the decoder layers
    (:func:`outside_key`)."""
    return other is not None and outside_key(sp) == outside_key(other)


def _outside_jobs(config, sp, world: int, seq_len: int, outside, *, shard: bool,
                  compute_dtype) -> Tracer | None:
    """The tracer of ``outside`` when :func:`step_work` may take the work outside the layers
    from it: it shares the outside, the model is deeper than two counted depths, and both
    count the same lengths."""
    if outside is None or outside == sp or not shares_outside(sp, outside):
        return None
    mine, lengths, depths = _work_jobs(config, sp, world, seq_len, shard=shard,
                                       compute_dtype=compute_dtype)
    ref, ref_lengths, _ = _work_jobs(config, outside, world, seq_len, shard=shard,
                                     compute_dtype=compute_dtype)
    return ref if len(depths) == 2 and ref_lengths == lengths else None


def prefetch_work(config, pairs, world: int, seq_len: int, *, shard: bool = True,
                  compute_dtype=None, wait: bool = True) -> None:
    """Count the work of each ``(settings, outside)`` of ``pairs`` at ``seq_len`` ahead of
    :func:`step_work`, as it counts them (``outside``: its argument, or None), all their
    traces sharing the worker processes (``wait=False``: queued, as
    :func:`arctic.plan.traces.prefetch` says)."""
    jobs = []
    for sp, outside in pairs:
        n = _snapped(sp, world, seq_len)
        for one in (sp, outside):
            if one is None:
                continue
            tracer, lengths, depths = _work_jobs(config, one, world, n, shard=shard,
                                                 compute_dtype=compute_dtype)
            if one is sp and _outside_jobs(config, sp, world, n, outside, shard=shard,
                                           compute_dtype=compute_dtype):
                depths = depths[:1]
            jobs += [(tracer, m, d) for m in lengths for d in depths]
    prefetch(jobs, wait=wait)


def _snapped(sp, world: int, seq_len: int) -> int:
    """``seq_len`` rounded up to what ``sp``'s mesh divides (as :func:`predict_step` plans)."""
    divisor = sp.dims(world).seq_len_divisor
    return -(-seq_len // divisor) * divisor


def work_depths(config) -> tuple[int, int]:
    """The depths whose counts give a deeper model's work: one and two layers, or one and two
    periods of a hybrid's ``layer_types``. Work, unlike memory, has no peak to shift: it is
    affine in the depth from one layer on."""
    p = layer_period(config)
    return p, 2 * p




def predict_step(config, sp, world: int, seq_len: int, rates, *, shard: bool = True,
                 placement: Placement | None = None, peak: Peak | None = None,
                 compute_dtype=None, outside=None) -> Prediction:
    """The step's predicted time at ``rates`` (:mod:`arctic.plan.speed`): its counted work
    (:func:`step_work`), plus, when ``placement`` offloads the training state, what the
    offload adds: each step's gradients (fp32) go to the host and the parameters (bf16) come
    back, and the optimizer reads and writes its state there (at the host copy rate).
    ``outside``: as :func:`step_work` takes it."""
    rates = rates_from(rates)
    seq_len = _snapped(sp, world, seq_len)
    work = step_work(config, sp, world, seq_len, shard=shard, compute_dtype=compute_dtype,
                     outside=outside)
    if placement is not None and placement.offloaded and peak is not None:
        work.host_copy += 6 * peak.shard_params + 2 * peak.optimizer_state
    size = sp.sequence_parallel_size
    return predict(work, rates, seq_len=seq_len,
                   model_flops_per_rank=model_flops(config, seq_len // size, seq_len, size))
