"""The longest sequence that fits: a search over traced lengths.

Apart from :mod:`arctic.plan.estimate` because it knows nothing of tracing: it calls a
``plan_at(n)`` that returns an :class:`~arctic.plan.estimate.Estimate`, so the CLI and
``benchmarks/plan_headline.py`` choose what each length plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from arctic.config import SequenceParallelConfig
from arctic.plan.estimate import Estimate
from arctic.plan.units import format_gib


def find_max(plan_at, *, start: int, granule: int, log=print,
             tolerance: float = 0.02) -> tuple[int, list[Estimate]]:
    """The longest multiple of ``granule`` tokens that fits, to within ``tolerance`` (or one
    granule). ``plan_at(n)`` plans ``n`` tokens. Returns it (0 if one granule does not fit)
    and every estimate made.

    Device and host memory grow about linearly with the length, so the search steps to where
    the line through the last two traces crosses the budget (regula falsi, kept inside the
    bracket of the longest length that fits and the shortest that does not), and halves the
    bracket when that step would not shrink it enough. Each step is one trace.
    """
    tried: list[Estimate] = []

    def load(e: Estimate) -> float:  # > 1: does not fit
        if e.refused is not None:
            return max(2.0, e.peak.host / max(1, e.host_budget))
        return max(e.peak.total / e.device_budget, e.peak.host / max(1, e.host_budget))

    def at(n: int) -> Estimate:
        e = plan_at(n)
        tried.append(e)
        log(f"  {n:>12,} tokens: peak {format_gib(e.peak.total)}, "
            f"host {format_gib(e.peak.host)} -> "
            f"{'fits' if e.fits else 'does not fit (' + e.limit() + ')'}")
        return e

    snap = lambda n: max(granule, int(n) // granule * granule)  # noqa: E731
    lo, hi = None, None  # (n, load) of the longest fit / shortest misfit
    e = at(snap(start))
    if e.fits:
        lo = (e.seq_len, load(e))
    else:
        hi = (e.seq_len, load(e))
    while lo is None or hi is None:
        # Bracket. Memory is about a + b n with a > 0 (parameters, optimizer state), so scaling
        # by the line through the origin lands short of the crossing: step 5% past it when
        # growing, 2% short of it when shrinking, so the next trace lands on the other side.
        n, f = lo or hi
        if lo is not None:
            target = snap(n / f * 1.05) if f > 0 else 2 * n
            target = max(target, n + granule)
        else:
            target = min(snap(n / f * 0.98), snap(n // 2) if f > 2 else n - granule)
        if target == n or target < granule:
            break
        e = at(target)
        if e.fits:
            lo = (e.seq_len, load(e))
        else:
            hi = (e.seq_len, load(e))
        if hi is not None and hi[0] <= granule and not e.fits:
            return 0, tried
    if lo is None:  # not even one granule fits
        return 0, tried
    while hi[0] - lo[0] > max(granule, int(lo[0] * tolerance)):
        (n0, f0), (n1, f1) = lo, hi
        guess = n0 + (1 - f0) * (n1 - n0) / (f1 - f0) if f1 > f0 else (n0 + n1) / 2
        width = n1 - n0
        if not (n0 + width / 10 < guess < n1 - width / 10):
            guess = min(max(guess, n0 + width / 10), n1 - width / 10)
        n = snap(guess)
        if n <= n0 or n >= n1:
            n = snap((n0 + n1) / 2)
            if n <= n0 or n >= n1:
                break
        e = at(n)
        if e.fits:
            lo = (e.seq_len, load(e))
        else:
            hi = (e.seq_len, load(e))
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


def factorizations(sp_size: int, num_heads: int, num_kv_heads: int) -> list[Candidate]:
    """Every ring x Ulysses split of ``sp_size``, with the model's reason to skip it, if any:
    :func:`ulysses.sharding.head_layout` refuses Ulysses degrees the heads cannot split over
    (more ranks than query heads; kv heads that neither divide nor are divided by the degree).
    """
    from ulysses.sharding import head_layout

    out = []
    for ring in (r for r in range(1, sp_size + 1) if sp_size % r == 0):
        c = Candidate(ring=ring, ulysses=sp_size // ring, fields={})
        try:
            head_layout(num_heads, num_kv_heads, c.ulysses)
        except ValueError as e:
            c.pruned = str(e).split(";")[0]
        out.append(c)
    return out


def search(plan_with, *, base: dict, sp_size: int, heads: tuple[int, int], start: int,
           granule: int, log=print) -> tuple[Candidate, list[Candidate]]:
    """The longest length over the ring x Ulysses factorizations of ``sp_size``, each with the
    other settings of ``base``; ``plan_with(n, fields)`` plans ``n`` tokens with ``fields``.
    Returns the winner (ties: the smaller ring degree, fewer ring hops) and every candidate,
    each planned at the winner's length too.

    The other settings are not varied where one value holds less device memory at every
    length than the others, which the recipe guarantees: one head per chunk (the chunk
    buffers scale with the chunk), fused projections (the unfused keep each chunk's q, k, v),
    "auto" tiles (bounded temporaries), checkpointing with offload (the layer inputs on the
    host) and recomputed attention (nothing kept). Only when the winner is held back by host
    memory does the search try the settings that trade host for device bytes: recompute
    attention (if ``base`` keeps it), then no offload.
    """
    candidates = factorizations(sp_size, *heads)
    for c in candidates:
        c.fields = dict(base, sequence_parallel_size=sp_size, ring_degree=c.ring)
        if c.pruned:
            log(f"ring {c.ring} x ulysses {c.ulysses}: skipped ({c.pruned})")
            continue
        log(f"ring {c.ring} x ulysses {c.ulysses}:")
        c.best, c.tried = find_max(lambda n, f=c.fields: plan_with(n, f), start=start,
                                   granule=granule, log=log, tolerance=0)
    traced = [c for c in candidates if not c.pruned]
    if not traced:
        raise ValueError(f"no ring x Ulysses factorization of {sp_size} suits the model's "
                         f"{heads[0]} query / {heads[1]} kv heads")
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
        # It matters only if it goes past the winner: one plan tells, and only then is its
        # longest length searched.
        past = plan_with(winner.best + granule, alt.fields)
        log(f"    {past.seq_len:>11,} tokens: "
            f"{'fits' if past.fits else 'does not fit (' + past.limit() + ')'}")
        alt.tried = [past]
        if past.fits:
            alt.best, tried = find_max(lambda n, f=alt.fields: plan_with(n, f),
                                       start=past.seq_len, granule=granule, log=log,
                                       tolerance=0)
            alt.tried += tried
        candidates.append(alt)
        if alt.best > winner.best:
            winner, host_bound = alt, "host" in alt.limit()
    for c in candidates:
        if not c.pruned and c.best and winner.best:
            c.at_winner = plan_with(winner.best, c.fields)
    return winner, candidates
