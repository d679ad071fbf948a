"""The longest sequence that fits: a search over traced lengths.

Apart from :mod:`arctic.plan.estimate` because it knows nothing of tracing: it calls a
``plan_at(n)`` that returns an :class:`~arctic.plan.estimate.Estimate`, so the CLI and
``benchmarks/plan_headline.py`` choose what each length plans.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from arctic.config import SequenceParallelConfig
from arctic.hf.mixer_kinds import FAMILIES
from arctic.plan import workers
from arctic.plan.estimate import Estimate
from arctic.plan.units import format_gib
from ulysses.sharding import head_layout, valid_degrees

MIXER_CHUNK = 16384
"""The mixer chunk (``mixer_chunk``) the searches try on a hybrid: 16K positions per chunk
bound a mixer layer's working set (a gated delta net's projections, convolution, per-chunk
states and gated norm) to about half a GiB at Qwen3.5-9B's widths, whatever the piece."""


def find_max(plan_at, *, start: int, granule: int, log=print,
             tolerance: float = 0.02, beaten=None) -> tuple[int, list[Estimate]]:
    """The longest multiple of ``granule`` tokens that fits, to within ``tolerance`` (or one
    granule). ``plan_at(n)`` plans ``n`` tokens. Returns it (0 if one granule does not fit)
    and every estimate made. ``beaten(n)``: whether to stop at the longest fit found, once
    ``n`` tokens, the shortest that does not fit, are known (another search fits them).

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
        if beaten is not None and beaten(hi[0]):
            break
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
    below: int | None = None
    """Set where its search stopped short: its longest is under this many tokens, which it
    does not fit and another factorization does."""

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
    each planned at the winner's length too. A factorization whose shortest misfit another
    fits stops there (it cannot win): its longest is a lower bound (:attr:`Candidate.below`).

    The other settings are not varied where one value holds less device memory at every
    length than the others, which the recipe guarantees: one head per chunk (the chunk
    buffers scale with the chunk), fused projections (the unfused keep each chunk's q, k, v),
    "auto" tiles (bounded temporaries), the layer's tail as one tile (one hidden-sized
    gradient less), checkpointing with offload (the layer inputs on the host) and recomputed
    attention (nothing kept). Only when the winner is held back by host memory does the
    search try the settings that trade host for device bytes: recompute attention (if
    ``base`` keeps it), then no offload. Only when it is held back by the device does it try
    the layer inputs copied back without prefetch (``offload_prefetch=False``: one layer
    input less at the backward's peak, for copies the step waits for; a disk tier's reads
    still run a layer ahead), then sequence chunks (``seq_chunk="auto"``, on a ring-only
    winner and on the best split with Ulysses ranks, which trade device bytes for host bytes
    and exchanges; :func:`_try_seq_chunks`). Last,
    with ``offload_state``, when the winner is still held back by the device, it tries the
    optimizer's state on the host (ZeRO-3's ``offload_optimizer``), then also the
    parameters (``offload_param``): ``fields["offload_state"] = "optimizer"`` or
    ``"optimizer+params"``, which ``plan_with`` must read as the placement of the training
    state.
    """
    candidates = factorizations(sp_size, *heads, mixers=mixers)
    for c in candidates:
        c.fields = dict(base, sequence_parallel_size=sp_size, ring_degree=c.ring)

    reached: dict[int, int] = {}  # the longest fit of each factorization so far
    lock = threading.Lock()

    def searched(c: Candidate) -> list[str]:  # one factorization, its log lines kept
        lines = [f"ring {c.ring} x ulysses {c.ulysses}:"]
        began = time.perf_counter()

        def plan_at(n: int) -> Estimate:
            e = plan_with(n, c.fields)
            if e.fits:
                with lock:
                    reached[id(c)] = max(n, reached.get(id(c), 0))
            return e

        def beaten(n: int) -> bool:  # it cannot reach n, which another fits: it cannot win
            with lock:
                if max((v for k, v in reached.items() if k != id(c)), default=0) < n:
                    return False
            c.below = n
            lines.append(f"  stopped: another factorization fits {n:,} tokens")
            return True

        c.best, c.tried = find_max(plan_at, start=start, granule=granule, log=lines.append,
                                   tolerance=0, beaten=beaten)
        return lines + [f"  ({len(c.tried)} plans, {time.perf_counter() - began:.1f} s)"]

    # Each factorization's plans wait on one trace at a time as often as not; searched side
    # by side, their traces keep every worker busy. The log reads as if one by one.
    traced = [c for c in candidates if not c.pruned]
    workers.start()
    with ThreadPoolExecutor(max(1, len(traced)) if workers.in_workers(2) else 1) as pool:
        logs = dict(zip(map(id, traced), pool.map(searched, traced)))
    for c in candidates:
        if c.pruned:
            log(f"ring {c.ring} x ulysses {c.ulysses}: skipped ({c.pruned})")
        for line in logs.get(id(c), ()):
            log(line)
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
    if not host_bound and winner.fields.get("offload_activations") and \
            winner.fields.get("offload_prefetch", True):
        alt = Candidate(ring=winner.ring, ulysses=winner.ulysses,
                        fields=dict(winner.fields, offload_prefetch=False))
        candidates.append(alt)
        log(f"ring {alt.ring} x ulysses {alt.ulysses}, {{'offload_prefetch': False}}:")
        _search_past(plan_with, alt, winner, granule, log)
        if alt.best > winner.best:
            winner, host_bound = alt, "host" in alt.limit()
    if not host_bound:
        winner = _try_seq_chunks(plan_with, candidates, winner, granule, log)
    # Device-bound: the optimizer's state (and its fp32 master weights) on the host frees
    # 14 of the 16 B/param it holds on the device, for the host's bytes; the parameters too
    # (ZeRO-Infinity's offload_param), the rest, for their gathers over PCIe.
    for mode in ("optimizer", "optimizer+params") if offload_state else ():
        if "host" in winner.limit():
            break
        alt = Candidate(ring=winner.ring, ulysses=winner.ulysses,
                        fields=dict(winner.fields, offload_state=mode))
        candidates.append(alt)
        log(f"ring {alt.ring} x ulysses {alt.ulysses}, {{'offload_state': '{mode}'}}:")
        _search_past(plan_with, alt, winner, granule, log)
        if alt.best > winner.best:
            winner = alt
    for c in candidates:
        if not c.pruned and c.best and winner.best:
            c.at_winner = plan_with(winner.best, c.fields)
    return winner, candidates


def _try_seq_chunks(plan_with, candidates: list[Candidate], winner: Candidate, granule: int,
                    log) -> Candidate:
    """The device-bound search's last step: ``seq_chunk="auto"`` on the winner's split when
    it is ring-only, and on the best factorization with more than one Ulysses rank (each
    appended to ``candidates``); returns the one that goes furthest past ``winner``, else
    ``winner``.

    Where the head-chunk buffers already span one ring block, sequence blocks cut little on
    a ring-only split (Llama-3-8B); with wider heads they cut the ring backward's moment
    (Qwen3.5-9B's 256-wide heads: 69.14 -> 66.62 GiB at 1.39M tokens per rank, ring 8), so
    the ring-only winner is tried too. Of the splits with Ulysses ranks only the longest is,
    because a trace with blocks costs one to three minutes at Llama-3-8B's scale. Not tried
    where the settings cannot take blocks (no head chunks) or already set them, or where the
    host holds the split back. Like the host-side variants, each is searched only if it fits
    a granule past the winner (:func:`_search_past`)."""
    def takes_blocks(c: Candidate) -> bool:
        return (not c.pruned and bool(c.best) and c.fields.get("seq_chunk") is None
                and c.fields.get("head_chunk_size") is not None and "host" not in c.limit())

    tries = [winner] if winner.ulysses == 1 and takes_blocks(winner) else []
    split = [c for c in candidates if c.ulysses > 1 and takes_blocks(c)]
    if split:
        # (one that stopped short may reach up to its shortest misfit: not passed over for less)
        tries.append(max(split, key=lambda c: (c.below - granule if c.below else c.best,
                                               -c.ring)))
    best = winner
    for base in tries:
        alt = Candidate(ring=base.ring, ulysses=base.ulysses,
                        fields=dict(base.fields, seq_chunk="auto"))
        candidates.append(alt)
        log(f"ring {alt.ring} x ulysses {alt.ulysses}, {{'seq_chunk': 'auto'}}:")
        _search_past(plan_with, alt, best, granule, log)
        if alt.best > best.best:
            best = alt
    return best


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
