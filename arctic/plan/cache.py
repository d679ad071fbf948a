"""A disk cache of traced steps, so a length, a search or a plot never traces the same step twice.

A trace is keyed by everything that changes it: the model's transformers config, the planned
settings, the world size, the sequence length, the layer count, whether parameters are
sharded, the torch and transformers versions, and a hash of this checkout's code (``arctic``,
``ulysses`` and ``offload``: a change to the recipe must not be answered from an old trace).
Entries are small JSON files under ``$ARCTIC_PLAN_CACHE`` (default
``~/.cache/arctic/plan``); ``ARCTIC_PLAN_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from arctic.plan.tracing import Peak

_PACKAGES = ("arctic", "ulysses", "offload")


PINNED: list[str] = []
"""Set in a tracing process to the code version of the process that queued its traces,
which reads them under that version's keys (its files may have changed since it started)."""


def code_version() -> str:
    """A hash of the checkout's planner-relevant source files (their paths and bytes), as
    this process first read them (or as :data:`PINNED` says)."""
    return PINNED[-1] if PINNED else _hashed()


@functools.cache
def _hashed() -> str:
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path | None:
    """The cache directory, or None when ``ARCTIC_PLAN_CACHE=off``."""
    where = os.environ.get("ARCTIC_PLAN_CACHE", "")
    if where.lower() in ("off", "0", "none", "no"):
        return None
    return Path(where).expanduser() if where else Path.home() / ".cache" / "arctic" / "plan"


def trace_key(config, sp_fields: dict, *, world: int, seq_len: int, shard: bool) -> str:
    """The cache key of one trace: a hash of what it depends on."""
    import torch
    import transformers

    what = {"config": config.to_dict(), "sp": sp_fields, "world": world, "seq_len": seq_len,
            "shard": shard, "torch": torch.__version__, "transformers": transformers.__version__,
            "code": code_version()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


_FIELDS = ("total", "host", "stateless", "shard_params", "optimizer_state")


def _encode(phases: dict[str, Peak]) -> dict:
    return {k: {**{f: getattr(p, f) for f in _FIELDS}, "by_kind": p.by_kind,
                "largest": [list(x) for x in p.largest]} for k, p in phases.items()}


def _decode(data: dict) -> dict[str, Peak]:
    return {k: Peak(by_kind=dict(v["by_kind"]), largest=[tuple(x) for x in v["largest"]],
                    **{f: v[f] for f in _FIELDS}) for k, v in data.items()}


def is_cached(key: str) -> bool:
    where = cache_dir()
    return where is not None and (where / f"{key}.json").is_file()


def cached(key: str, trace, *, encode=_encode, decode=_decode) -> tuple[dict[str, Peak], bool]:
    """``trace()``'s phases, from the cache when there (``(phases, True)``), else traced and
    stored (``(phases, False)``). ``encode``/``decode``: another result's JSON form (a
    counted step's :class:`arctic.plan.work.Work`)."""
    where = cache_dir()
    path = where / f"{key}.json" if where is not None else None
    if path is not None and path.is_file():
        try:
            return decode(json.loads(path.read_text())), True
        except (ValueError, KeyError, TypeError):
            pass  # a torn or old entry: trace again and overwrite it
    phases = trace()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(encode(phases)))
        tmp.replace(path)  # atomic: parallel planners never read half an entry
    return phases, False


__all__ = ["cache_dir", "cached", "code_version", "is_cached", "trace_key"]
