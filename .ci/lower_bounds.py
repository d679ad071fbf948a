"""Print setup.py's lower bounds of the HF-facing packages as exact pins (``pkg==X``), for
.ci/run's job on the oldest supported releases: what setup.py claims is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGES = ("transformers", "accelerate", "deepspeed")


def lower_bounds(setup_py: str) -> dict[str, str]:
    found: dict[str, set[str]] = {}
    for pkg, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)"', setup_py):
        found.setdefault(pkg, set()).add(version)
    bounds = {}
    for pkg in PACKAGES:
        versions = found.get(pkg, set())
        if len(versions) != 1:
            raise SystemExit(f"setup.py must state one lower bound for {pkg}, found {versions}")
        bounds[pkg] = versions.pop()
    return bounds


if __name__ == "__main__":
    text = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    print(" ".join(f"{pkg}=={v}" for pkg, v in lower_bounds(text).items()))
