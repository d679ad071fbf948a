"""The longest sequence that fits: a search over traced lengths.

Apart from :mod:`arctic.plan.estimate` because it knows nothing of tracing: it calls a
``plan_at(n)`` that returns an :class:`~arctic.plan.estimate.Estimate`, so the CLI and
``benchmarks/plan_headline.py`` choose what each length plans.
"""

from __future__ import annotations

from arctic.plan.estimate import Estimate
from arctic.plan.units import format_gib


def find_max(plan_at, *, start: int, granule: int, log=print) -> tuple[int, list[Estimate]]:
    """The longest multiple of ``granule`` tokens that fits, to within 2%. ``plan_at(n)`` traces
    ``n`` tokens. Returns it (0 if one granule does not fit) and every estimate made.

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
    while hi[0] - lo[0] > max(granule, lo[0] // 50):
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
