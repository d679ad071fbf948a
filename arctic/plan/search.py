"""The longest sequence that fits: a search over traced lengths.

Apart from :mod:`arctic.plan.estimate` because it knows nothing of tracing: it calls a
``plan_at(n)`` that returns an :class:`~arctic.plan.estimate.Estimate`, so the CLI and
``benchmarks/plan_headline.py`` choose what each length plans.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from arctic.config import SequenceParallelConfig
from arctic.hf.mixer_kinds import FAMILIES
from arctic.plan.estimate import Estimate
from arctic.plan.step import PLANNED_FIELDS
from arctic.plan.units import format_gib
from ulysses.chunk_schedule import valid_chunk_sizes
from ulysses.sharding import head_layout, valid_degrees


def find_max(plan_at, *, start: int, granule: int, log=print,
             tolerance: float = 0.02) -> tuple[int, list[Estimate]]:
    """The longest multiple of ``granule`` tokens that fits, to within ``tolerance`` (or one
    granule). ``plan_at(n)`` plans ``n`` tokens. Returns it (0 if one granule does not fit)
    and every estimate made.

    Device and host memory each grow about linearly with the length, so each step goes to
    where the first of the two lines through two estimates crosses its budget: outside the
    bracket, the last two (a little past the crossing, so that the next lands on the other
    side); inside it, the longest fit and the shortest misfit (regula falsi, with the Illinois
    rule: an end kept twice in a row has its distance to the budget halved, so a bent line
    cannot hold one end still). Each step is one plan; on exact lines the search ends in
    about five.
    """
    tried: list[Estimate] = []

    def at(n: int) -> tuple[int, tuple[float, float]]:
        """``(n, loads)``: device and host bytes over their budgets (> 1: over)."""
        e = plan_at(n)
        tried.append(e)
        log(f"  {n:>12,} tokens: peak {format_gib(e.peak.total)}, "
            f"host {format_gib(e.peak.host)} -> "
            f"{'fits' if e.fits else 'does not fit (' + e.limit() + ')'}")
        loads = e.loads()
        if not e.fits and max(loads) <= 1:
            loads = (loads[0], 1.0 + 1e-9)  # refused at the budget itself
        return e.seq_len, loads

    def crossing(a, b) -> float | None:
        """Where the first of the device and host lines through ``a`` and ``b`` crosses its
        budget (the two grow at different rates: the one over at ``b`` may not be the one
        nearest at ``a``)."""
        (na, fa), (nb, fb) = a, b
        xs = [na + (1 - ya) * (nb - na) / (yb - ya) for ya, yb in zip(fa, fb)
              if yb > ya and nb != na]
        return min(xs, default=None)

    def fits(point) -> bool:
        return max(point[1]) <= 1

    def toward_budget(point):  # Illinois: a kept end's loads halfway to the budget
        return point[0], tuple(1 + (y - 1) / 2 for y in point[1])

    snap = lambda n: max(granule, int(n) // granule * granule)  # noqa: E731
    points = [at(snap(start))]
    lo = points[0] if fits(points[0]) else None  # the longest fit
    hi = None if lo else points[0]  # the shortest misfit
    while lo is None or hi is None:
        n, f = points[-1][0], max(points[-1][1])
        # Memory is about a + b n with a > 0 (parameters, optimizer state), so from one point
        # the line through the origin is all there is; it lands short of the crossing, and
        # the lines through two points are used once there are two. Aim 2% past the crossing,
        # towards the other side.
        guess = crossing(points[-2], points[-1]) if len(points) > 1 else None
        if guess is None or guess <= 0:
            guess = n / f if f > 0 else 2 * n
        if lo is not None:
            target = max(snap(min(guess * 1.02, 4 * n)), n + granule)
        else:
            target = min(snap(max(guess * 0.98, n / 4)), n - granule)
        if target < granule:
            return 0, tried
        points.append(at(target))
        if fits(points[-1]):
            lo = points[-1] if lo is None or points[-1][0] > lo[0] else lo
        else:
            hi = points[-1] if hi is None or points[-1][0] < hi[0] else hi
    kept = None  # which end the last step kept
    while hi[0] - lo[0] > max(granule, int(lo[0] * tolerance)):
        guess = crossing(lo, hi) or (lo[0] + hi[0]) / 2
        point = at(min(max(snap(guess), lo[0] + granule), hi[0] - granule))
        if fits(point):
            lo, hi = point, toward_budget(hi) if kept == "hi" else hi
            kept = "hi"
        else:
            lo, hi = toward_budget(lo) if kept == "lo" else lo, point
            kept = "lo"
    return lo[0], tried


@dataclass
class Candidate:
    """One factorization of the SP degree in a settings search, and what it reached."""

    ring: int
    ulysses: int
    fields: dict
    pruned: str | None = None
    """Why it was not traced (the model's heads do not split over its Ulysses degree)."""
    best: int = 0
    tried: list = field(default_factory=list)
    at_winner: Estimate | None = None
    """Its plan at the winner's length (a loser's does not fit there)."""

    def limit(self) -> str:
        misfits = [e for e in self.tried if not e.fits]
        return min(misfits, key=lambda e: e.seq_len).limit() if misfits else "-"


def factorizations(sp_size: int, num_heads: int | None, num_kv_heads: int | None,
                   mixers: Sequence[tuple[str, int, int]] = ()) -> list[Candidate]:
    """Every ring x Ulysses split of ``sp_size``, with the model's reason to skip it, if any:
    :func:`ulysses.sharding.head_layout` refuses Ulysses degrees the heads cannot split over
    (more ranks than query heads; kv heads that neither divide nor are divided by the degree).
    ``mixers``: the model's token mixers as ``(class, heads, grouped heads)``
    (:func:`arctic.plan.models.token_mixer_heads`): scans that pass their state (every one
    now) and convolutions alone run on any split; one without would run under Ulysses only,
    over degrees its heads split over."""
    out = []
    for ring in (r for r in range(1, sp_size + 1) if sp_size % r == 0):
        c = Candidate(ring=ring, ulysses=sp_size // ring, fields={})
        try:
            if num_heads is not None:  # None: no attention (Mamba2)
                head_layout(num_heads, num_kv_heads, c.ulysses)
        except ValueError as e:
            c.pruned = str(e).split(";")[0]
        for name, heads, grouped in mixers:
            if c.pruned:
                break
            if FAMILIES[name].scan is None or FAMILIES[name].passes_state:
                continue  # a convolution alone, or state passing: any degree, any ring
            if ring > 1:
                c.pruned = f"{name} runs under Ulysses only (no ring)"
            elif c.ulysses not in valid_degrees(heads, grouped):
                c.pruned = (f"{name}'s {heads} heads over {grouped} grouped heads do not split "
                            f"over {c.ulysses}")
        out.append(c)
    return out


def search(plan_with, *, base: dict, sp_size: int, heads: tuple[int | None, int | None],
           start: int,
           granule: int, log=print,
           mixers: Sequence[tuple[str, int, int]] = (),
           offload_state: bool = False) -> tuple[Candidate, list[Candidate]]:
    """The longest length over the ring x Ulysses factorizations of ``sp_size``, each with the
    other settings of ``base``; ``plan_with(n, fields)`` plans ``n`` tokens with ``fields``.
    Returns the winner (ties: the smaller ring degree, fewer ring hops) and every candidate,
    each planned at the winner's length too.

    The other settings are not varied where one value holds less device memory at every
    length than the others, which the recipe guarantees: one head per chunk (the chunk
    buffers scale with the chunk), fused projections (the unfused keep each chunk's q, k, v),
    "auto" tiles (bounded temporaries), the layer's tail as one tile (one hidden-sized
    gradient less), checkpointing with offload (the layer inputs on the host) and recomputed
    attention (nothing kept). Only when the winner is held back by host memory does the
    search try the settings that trade host for device bytes: recompute attention (if
    ``base`` keeps it), then no offload. Only when it is held back by the device does it try
    sequence chunks (``seq_chunk="auto"``, which trade device bytes for host bytes and
    exchanges; :func:`_try_seq_chunks`). Last, with ``offload_state``, when the winner is
    still held back by the device, it tries the optimizer's state on the host (ZeRO-3's
    ``offload_optimizer``): ``fields["offload_state"] = "optimizer"``, which ``plan_with``
    must read as the placement of the training state.
    """
    candidates = factorizations(sp_size, *heads, mixers=mixers)
    for c in candidates:
        c.fields = dict(base, sequence_parallel_size=sp_size, ring_degree=c.ring)
        if c.pruned:
            log(f"ring {c.ring} x ulysses {c.ulysses}: skipped ({c.pruned})")
            continue
        log(f"ring {c.ring} x ulysses {c.ulysses}:")
        began = time.perf_counter()
        c.best, c.tried = find_max(lambda n, f=c.fields: plan_with(n, f), start=start,
                                   granule=granule, log=log, tolerance=0)
        log(f"  ({len(c.tried)} plans, {time.perf_counter() - began:.1f} s)")
    traced = [c for c in candidates if not c.pruned]
    if not traced:
        raise ValueError(f"no ring x Ulysses factorization of {sp_size} suits the model: "
                         + "; ".join(f"ring {c.ring} x ulysses {c.ulysses}: {c.pruned}"
                                     for c in candidates))
    winner = max(traced, key=lambda c: (c.best, -c.ring))
    host_bound = "host" in winner.limit()
    defaults = {f.name: f.default for f in dataclasses.fields(SequenceParallelConfig)}
    for change in ({"recompute_attention": True},
                   {"offload_activations": False, "recompute_attention": True}):
        if not host_bound or all(winner.fields.get(k, defaults[k]) == v
                                 for k, v in change.items()):
            continue
        alt = Candidate(ring=winner.ring, ulysses=winner.ulysses,
                        fields=dict(winner.fields, **change))
        log(f"ring {alt.ring} x ulysses {alt.ulysses}, {change}:")
        candidates.append(alt)
        if change.get("offload_activations") is False:
            alt.pruned = _inputs_overflow(plan_with(winner.best + granule, winner.fields))
            if alt.pruned:
                log(f"    skipped: {alt.pruned}")
                continue
        _search_past(plan_with, alt, winner, granule, log)
        if alt.best > winner.best:
            winner, host_bound = alt, "host" in alt.limit()
    if not host_bound:
        winner = _try_seq_chunks(plan_with, candidates, winner, granule, log)
    if offload_state and "host" not in winner.limit():
        # Device-bound: the optimizer's state (and its fp32 master weights) on the host frees
        # 14 of the 16 B/param it holds on the device, for the host's bytes.
        alt = Candidate(ring=winner.ring, ulysses=winner.ulysses,
                        fields=dict(winner.fields, offload_state="optimizer"))
        candidates.append(alt)
        log(f"ring {alt.ring} x ulysses {alt.ulysses}, {{'offload_state': 'optimizer'}}:")
        _search_past(plan_with, alt, winner, granule, log)
        if alt.best > winner.best:
            winner = alt
    for c in candidates:
        if not c.pruned and c.best and winner.best:
            c.at_winner = plan_with(winner.best, c.fields)
    return winner, candidates


def _try_seq_chunks(plan_with, candidates: list[Candidate], winner: Candidate, granule: int,
                    log) -> Candidate:
    """The device-bound search's last step: the best factorization with more than one
    Ulysses rank, with ``seq_chunk="auto"`` (appended to ``candidates``); returns it if it
    goes past ``winner``, else ``winner``.

    With one Ulysses rank the head-chunk buffers already span one ring block and sequence
    blocks cut nothing (docs/planner.md's headline notes show it at 9.44M), so ring-only splits
    are not tried; of the others only the longest is, because a trace with blocks costs one
    to three minutes at Llama-3-8B's scale. Not tried when the settings cannot take blocks
    (no head chunks) or already set them. Like the host-side variants, it is searched only
    if it fits a granule past the winner (:func:`_search_past`)."""
    split = [c for c in candidates if not c.pruned and c.best and c.ulysses > 1 and
             c.fields.get("seq_chunk") is None and c.fields.get("head_chunk_size") is not None
             and "host" not in c.limit()]
    if not split:
        return winner
    best = max(split, key=lambda c: (c.best, -c.ring))
    alt = Candidate(ring=best.ring, ulysses=best.ulysses,
                    fields=dict(best.fields, seq_chunk="auto"))
    candidates.append(alt)
    log(f"ring {alt.ring} x ulysses {alt.ulysses}, {{'seq_chunk': 'auto'}}:")
    _search_past(plan_with, alt, winner, granule, log)
    return alt if alt.best > winner.best else winner


def _search_past(plan_with, alt: Candidate, winner: Candidate, granule: int, log) -> None:
    """Fill ``alt.tried`` and ``alt.best``. A variant matters only if it goes past the
    winner: one plan a granule past it tells, and only then is its longest length searched."""
    past = plan_with(winner.best + granule, alt.fields)
    log(f"    {past.seq_len:>11,} tokens: "
        f"{'fits' if past.fits else 'does not fit (' + past.limit() + ')'}")
    alt.tried = [past]
    if past.fits:
        alt.best, tried = find_max(lambda n, f=alt.fields: plan_with(n, f),
                                   start=past.seq_len, granule=granule, log=log, tolerance=0)
        alt.tried += tried


def _inputs_overflow(e: Estimate) -> str | None:
    """Why turning offload off cannot fit where ``e`` (offloading) is: the layer inputs it
    holds on the host would stay on the device. The host pool reuses a buffer for a tensor of
    at least half its size, so the tensors are at least half the host bytes; when that half
    alone is over the device budget, no trace is needed."""
    held = e.peak.host - e.state_host
    if held // 2 <= e.device_budget:
        return None
    return (f"at {e.seq_len:,} tokens its layer inputs (at least {format_gib(held // 2).strip()}"
            f", offloaded there) would stay on the device, over its budget of "
            f"{format_gib(e.device_budget).strip()}")


# --- the fastest settings that fit one length -------------------------------------------------

TRADES = ("ring_degree", "head_chunk_size", "fuse_projections", "seq_chunk",
          "recompute_attention", "offload_activations", "activation_checkpointing",
          "tiled_mlp", "tiled_layer", "loss_tiles")
"""The settings :func:`fastest` varies: each trades device memory for time."""


def planned_fields(fields: dict, sp_size: int) -> dict:
    """Every planned field (:data:`arctic.plan.step.PLANNED_FIELDS`) of ``fields``, the
    config's defaults where it says nothing: one spelling per setting."""
    defaults = {f.name: f.default for f in dataclasses.fields(SequenceParallelConfig)}
    state = {"offload_state": fields["offload_state"]} if "offload_state" in fields else {}
    return {k: fields.get(k, defaults[k]) for k in PLANNED_FIELDS} | {
        "sequence_parallel_size": sp_size} | state


def neighbours(fields: dict, *, sp_size: int, heads: tuple[int | None, int | None],
               mixers: Sequence[tuple[str, int, int]] = (),
               unsupported: Sequence[str] = ()) -> list[dict]:
    """The settings one trade away from ``fields`` (a value of one of :data:`TRADES`, with
    what it needs: no head chunks also means no fused projections or sequence blocks; no
    checkpointing, no offload and recomputed attention; a hybrid's scans by state passing or
    by ``"auto"``, the all-to-all where the heads split), each a valid
    :class:`~arctic.config.SequenceParallelConfig` the model supports: ring x Ulysses
    splits that :func:`factorizations` allows, head chunk sizes that
    :func:`ulysses.chunk_schedule.valid_chunk_sizes` allows, and nothing in ``unsupported``
    (the model's :func:`arctic.plan.models.unsupported_settings`)."""
    f = planned_fields(fields, sp_size)
    out: list[dict] = []

    def add(**change) -> None:
        new = dict(f, **change)
        if new.get("head_chunk_size") is None:
            new.update(fuse_projections=False, seq_chunk=None)
        if not new.get("activation_checkpointing"):
            new.update(offload_activations=False, recompute_attention=True)
        if new.get("tiled_mlp") is None:
            new["tiled_layer"] = False
        if any(new.get(k) not in (None, False) for k in unsupported):
            return
        if not _valid(new, sp_size):
            return
        if new != f and new not in out:
            out.append(new)

    for c in factorizations(sp_size, *heads, mixers=mixers):
        if not c.pruned and c.ring != f.get("ring_degree", 1):
            add(ring_degree=c.ring)
    ring = f.get("ring_degree", 1)
    if heads[0] is not None:
        layout = head_layout(heads[0], heads[1] or heads[0], sp_size // ring)
        for c in [None, *valid_chunk_sizes(layout)]:
            if c != f.get("head_chunk_size"):
                add(head_chunk_size=c, fuse_projections=f.get("fuse_projections", False)
                    if c is not None else False)
        if f.get("head_chunk_size") is not None:
            add(fuse_projections=not f.get("fuse_projections", False))
            add(seq_chunk=None if f.get("seq_chunk") is not None else "auto")
    if f.get("activation_checkpointing"):
        add(recompute_attention=not f.get("recompute_attention", True))
        add(offload_activations=not f.get("offload_activations", False))
        add(activation_checkpointing=False)
    else:
        add(activation_checkpointing=True)
    add(tiled_mlp=None if f.get("tiled_mlp") is not None else "auto")
    if f.get("tiled_mlp") is not None:
        add(tiled_layer=not f.get("tiled_layer", False))
    add(loss_tiles=1 if f.get("loss_tiles", "auto") != 1 else "auto")
    if ring == 1 and any(FAMILIES[name].scan for name, _, _ in mixers):
        add(mixer_parallelism="state_passing" if f.get("mixer_parallelism", "auto") == "auto"
            else "auto")  # auto: the all-to-all where the heads split (on a ring: state passing)
    if "offload_state" in fields:  # a fallback's: the state back on the device
        out.append({k: v for k, v in f.items() if k != "offload_state"})
    return out


def _valid(fields: dict, sp_size: int) -> bool:
    try:
        SequenceParallelConfig(**{k: v for k, v in fields.items()
                                  if k != "offload_state"}).dims(sp_size)
        return True
    except ValueError:
        return False


def fastest(plan_with, predict_with, *, base: dict, sp_size: int,
            heads: tuple[int | None, int | None], seq_len: int,
            mixers: Sequence[tuple[str, int, int]] = (), unsupported: Sequence[str] = (),
            rounds: int = 4, min_gain: float = 0.005, prefetch=None,
            fallbacks: Sequence[dict] = (),
            log=print) -> tuple[Estimate | None, list[tuple[dict, float, str]]]:
    """The settings with the lowest predicted step time that fit ``seq_len`` tokens: a
    descent over :func:`neighbours` from ``base`` (the least-memory settings, which must
    fit). Each round predicts every neighbour of the current settings
    (``predict_with(fields)``: a :class:`~arctic.plan.speed.Prediction`, from the step's
    counted work) and plans the memory of those predicted faster, fastest first
    (``plan_with(fields)``: an :class:`Estimate`), moving to the first that fits; it stops
    when no neighbour is both faster (by ``min_gain`` of the current time: less is within
    the model's error, and not worth a memory plan) and fits, or after ``rounds`` rounds.
    ``prefetch(list
    of fields)``, if given, is called with each round's neighbours before they are predicted
    (to count their work in parallel). ``fallbacks``: changes to ``base`` tried in turn when
    it does not fit (sequence blocks, the optimizer's state on the host,
    ``{"offload_state": "optimizer"}``, which ``plan_with`` and ``predict_with`` read as the
    training state's placement); the descent starts from the first that fits, and may take
    the change back (:func:`neighbours`).

    Returns the chosen settings' estimate (None if ``base`` does not fit) and every setting
    predicted, as ``(fields, predicted s, verdict)``."""
    seen: dict[str, tuple[dict, float, str]] = {}

    def key(fields: dict) -> str:
        return repr(sorted(fields.items()))

    def predicted(fields: dict) -> float:
        k = key(fields)
        if k not in seen:
            seen[k] = (fields, predict_with(fields).step_s, "predicted")
        return seen[k][1]

    def verdict(fields: dict, what: str) -> None:
        f, t, _ = seen[key(fields)]
        seen[key(fields)] = (f, t, what)

    start = planned_fields(base, sp_size)
    best = None
    for extra in ({}, *fallbacks):  # the least-memory settings, then with more traded for memory
        current = dict(start, **extra)
        if extra and not _valid(current, sp_size):
            continue
        best = plan_with(current)
        t_best = predicted(current)
        verdict(current, "fits" if best.fits else f"does not fit ({best.limit()})")
        log(f"  start {_short(current)}: {t_best:.3f} s predicted, "
            f"{'fits' if best.fits else 'does not fit (' + best.limit() + ')'}")
        if best.fits:
            break
    if best is None or not best.fits:
        return None, list(seen.values())
    for _ in range(rounds):
        options = neighbours(current, sp_size=sp_size, heads=heads, mixers=mixers,
                             unsupported=unsupported)
        if prefetch is not None:
            prefetch(options)
        faster = sorted((predicted(o), i, o) for i, o in enumerate(options)
                        if predicted(o) < t_best * (1 - min_gain))
        moved = False
        for t, _, o in faster:
            e = plan_with(o)
            verdict(o, "fits" if e.fits else f"does not fit ({e.limit()})")
            log(f"  {_short(o, current)}: {t:.3f} s predicted, "
                f"{'fits' if e.fits else 'does not fit (' + e.limit() + ')'}")
            if e.fits:
                current, best, t_best, moved = o, e, t, True
                break
        if not moved:
            break
    return best, list(seen.values())


def _short(fields: dict, ref: dict | None = None) -> str:
    """The settings (or those that differ from ``ref``'s) as ``key=value`` pairs."""
    items = {k: v for k, v in fields.items() if k != "sequence_parallel_size" and
             (ref is None or ref.get(k) != v)}
    return ", ".join(f"{k}={v}" for k, v in items.items()) or "(the same)"
