"""Report: HF model families under sequence parallelism, against the unmodified model.

For each family of ``tests/test_arctic_hf_families.py`` (the same tiny configs, features on: a
window of 16 at S = 128, sinks, logit transforms, packed documents) and SP = 2 and 4, one
training step on gloo ranks is compared with the unmodified model on one process:

- ``loss rel``: ``|loss_sp - loss_ref| / |loss_ref|``;
- ``grad max``: the largest absolute difference over every parameter gradient (after a
  DDP-style average), next to the largest gradient;
- ``off``: the same distance between the reference with and without the feature: what a run
  that dropped the feature would be off by.

It reuses the test module's rank functions and worker pools, so it measures exactly what the
tests assert. Prints a table and writes ``benchmarks/results/hf_families_cpu.json``.

    python3 benchmarks/hf_families.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import dist_pool  # noqa: E402
import test_hf_families as fam  # noqa: E402
import torch  # noqa: E402

# Gradients come back from the worker ranks through queues; file descriptors would run out.
torch.multiprocessing.set_sharing_strategy("file_system")

CASES = [(f, False) for f in fam.HONOURED] + [(f, True) for f in ("stablelm", "nemotron",
                                                                   "mistral")]


def _distance(a, b):
    return max((a[1][n] - b[1][n]).abs().max().item() for n in a[1] if n in b[1])


def main() -> None:
    rows = []
    for family, documents in CASES:
        ref = fam._reference(family, True, documents)
        off = fam._reference(family, True, False) if documents else fam._reference(family, False)
        for sp in (2, 4):
            results = dist_pool.run(fam._rank_step, family, sp, documents=documents,
                                    world_size=sp)
            rows.append({
                "family": family, "feature": ("packed documents" if documents
                                              else fam.HONOURED[family]), "sp": sp,
                "loss_ref": ref[0],
                "loss_rel": max(abs(r[0] - ref[0]) / abs(ref[0]) for r in results),
                "grad_max_diff": max(_distance(r, ref) for r in results),
                "grad_max": max(g.abs().max().item() for g in ref[1].values()),
                "off_grad_max_diff": _distance(ref, off),
                "off_loss_rel": abs(off[0] - ref[0]) / abs(ref[0]),
            })
            r = rows[-1]
            print(f"{family:<9} sp={sp} | loss rel {r['loss_rel']:.1e} | grad max "
                  f"{r['grad_max_diff']:.1e} (of {r['grad_max']:.2f}) | off: loss rel "
                  f"{r['off_loss_rel']:.1e}, grad {r['off_grad_max_diff']:.1e} | {r['feature']}",
                  flush=True)
    dist_pool.shutdown()
    out = ROOT / "benchmarks" / "results" / "hf_families_cpu.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
