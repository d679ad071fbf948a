"""Benchmark: how evenly ring layouts spread causal attention work over packed documents.

A rank's attention work is the number of visible (query, key) pairs of the query rows it
holds: with packed documents a query at offset ``i`` of its document sees ``i + 1`` keys
(the ring's kernel calls cover exactly the visible pairs, :mod:`ulysses.ring`). The step waits
for the busiest rank, so the figure of merit is ``max / mean`` of the per-rank work (1.0:
perfect balance; R: one rank does everything).

Layouts of a packed sequence of ``R x L`` tokens over R ring ranks:

- ``contiguous``: rank r holds ``[r L, (r + 1) L)``;
- ``zigzag``: 2R chunks, rank r holds chunks r and 2R-1-r (:func:`ulysses.shard_sequence`);
- ``per_document``: every document cut into 2R chunks, rank r taking chunks r and 2R-1-r of
  each (``SequenceParallelDims(..., per_document=True)``; the rows each rank holds come from
  :func:`ulysses.sharding.ring_runs`, the function that cuts the batches).

Document-length mixes, drawn with a fixed seed and packed in order into sequences (a
document that does not fit is cut, its tail starting the next sequence):

- ``long-tail 1K-256K``: log-uniform lengths between 1K and 256K tokens;
- ``short 1K-8K``: log-uniform lengths between 1K and 8K;
- ``one long + short``: one 256K document, the rest log-uniform 1K-8K, the long one at a
  random place.

    python benchmarks/document_balance.py [--seq 1M --rings 4 8 --samples 32]

Prints a table (median and worst ``max / mean`` over the sampled sequences) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ulysses.sharding import ring_runs  # noqa: E402
K = 1024


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": K, "M": K * K}.get(text[-1], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def draw_lengths(kind: str, total: int, rng: np.random.Generator) -> list[int]:
    """Document lengths of one mix until ``total`` tokens are covered."""
    def log_uniform(lo, hi):
        return int(round(float(np.exp(rng.uniform(np.log(lo), np.log(hi))))))

    lengths, long_at = [], None
    if kind == "one long + short":
        long_at = int(rng.integers(0, max(1, total - 256 * K)))
    covered = 0
    while covered < total:
        if long_at is not None and covered >= long_at:
            n, long_at = 256 * K, None
        elif kind == "long-tail 1K-256K":
            n = log_uniform(K, 256 * K)
        else:
            n = log_uniform(K, 8 * K)
        lengths.append(n)
        covered += n
    return lengths


def offsets_in_document(lengths: list[int], total: int) -> np.ndarray:
    """For each of the sequence's ``total`` positions, its offset within its document (the
    documents packed in order, the last one cut at ``total``)."""
    starts = np.zeros(total, dtype=np.int64)
    pos = 0
    for n in lengths:
        if pos >= total:
            break
        starts[pos:min(pos + n, total)] = pos
        pos += n
    return np.arange(total, dtype=np.int64) - starts


def contiguous_work(work: np.ndarray, R: int) -> np.ndarray:
    return work.reshape(R, -1).sum(1)


def zigzag_work(work: np.ndarray, R: int) -> np.ndarray:
    chunks = work.reshape(2 * R, -1).sum(1)
    return np.array([chunks[r] + chunks[2 * R - 1 - r] for r in range(R)])


def document_starts(lengths: list[int], total: int) -> tuple[int, ...]:
    """The first position of each document packed into ``total`` positions."""
    starts = np.cumsum([0] + lengths[:-1])
    return tuple(int(a) for a in starts if a < total)


def per_document_work(work: np.ndarray, lengths: list[int], total: int, R: int) -> np.ndarray:
    """Each rank's work over the rows the per-document layout gives it (equal row counts)."""
    prefix = np.concatenate([[0], np.cumsum(work)])
    runs = [ring_runs(total, R, r, document_starts(lengths, total)) for r in range(R)]
    if len({sum(n for _, n in rr) for rr in runs}) != 1:
        raise SystemExit("the per-document layout gave the ranks different row counts")
    return np.array([sum(prefix[g + n] - prefix[g] for g, n in rr) for rr in runs],
                    dtype=np.float64)


def imbalance(per_rank: np.ndarray) -> float:
    return float(per_rank.max() / per_rank.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="1M", help="tokens per packed sequence (R x L)")
    p.add_argument("--rings", type=int, nargs="+", default=[4, 8])
    p.add_argument("--samples", type=int, default=32, help="packed sequences per mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path,
                   default=REPO / "benchmarks" / "results" / "document_balance.json")
    args = p.parse_args()
    total = parse_size(args.seq)
    mixes = ("long-tail 1K-256K", "short 1K-8K", "one long + short")
    rows = []
    for mix in mixes:
        rng = np.random.default_rng(args.seed)
        draws = [draw_lengths(mix, total, rng) for _ in range(args.samples)]
        for R in args.rings:
            if total % (2 * R):
                raise SystemExit(f"--seq {total} must divide by 2 x {R}")
            ratios: dict[str, list[float]] = {"contiguous": [], "zigzag": [],
                                              "per_document": []}
            for lengths in draws:
                work = offsets_in_document(lengths, total) + 1
                ratios["contiguous"].append(imbalance(contiguous_work(work, R)))
                ratios["zigzag"].append(imbalance(zigzag_work(work, R)))
                ratios["per_document"].append(
                    imbalance(per_document_work(work, lengths, total, R)))
            for layout, values in ratios.items():
                rows.append({"mix": mix, "ring": R, "layout": layout,
                             "median_max_over_mean": round(statistics.median(values), 4),
                             "worst_max_over_mean": round(max(values), 4)})
    print(f"{'mix':<20}{'R':>3}  {'layout':<17}{'median max/mean':>17}{'worst':>9}")
    for r in rows:
        print(f"{r['mix']:<20}{r['ring']:>3}  {r['layout']:<17}"
              f"{r['median_max_over_mean']:>17.3f}{r['worst_max_over_mean']:>9.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seq": total, "samples": args.samples, "seed": args.seed,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
