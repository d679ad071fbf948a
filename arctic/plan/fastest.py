"""The fastest settings that fit one length: a descent over settings one trade apart.

Apart from :mod:`arctic.plan.search` (the longest length) because it ranks settings by their
predicted step time, which the longest-length search never reads; both call back into the
CLI's ``plan_with`` for each setting's :class:`~arctic.plan.estimate.Estimate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from arctic.config import SequenceParallelConfig
from arctic.hf.mixer_kinds import FAMILIES
from arctic.plan.counts import shares_outside
from arctic.plan.estimate import Estimate
from arctic.plan.search import MIXER_CHUNK, factorizations
from arctic.plan.step import PLANNED_FIELDS
from ulysses.chunk_schedule import valid_chunk_sizes
from ulysses.sharding import head_layout

TRADES = ("ring_degree", "head_chunk_size", "fuse_projections", "seq_chunk",
          "recompute_attention", "offload_activations", "activation_checkpointing",
          "tiled_mlp", "tiled_layer", "loss_tiles", "mixer_parallelism", "mixer_chunk")
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
    by ``"auto"``, the all-to-all where the heads split; its mixer layers in chunks of
    :data:`~arctic.plan.search.MIXER_CHUNK` or whole), each a valid
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
        if new.get("mixer_parallelism") == "all_to_all":  # chunks pass the state
            new["mixer_chunk"] = None
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
    if ring == 1 and f.get("mixer_chunk") is None and \
            any(FAMILIES[name].scan for name, _, _ in mixers):
        # (with mixer chunks "auto" passes the state already: the same setting twice)
        add(mixer_parallelism="state_passing" if f.get("mixer_parallelism", "auto") == "auto"
            else "auto")  # auto: the all-to-all where the heads split (on a ring: state passing)
    if mixers and f.get("mixer_parallelism", "auto") != "all_to_all":
        add(mixer_chunk=None if f.get("mixer_chunk") is not None else MIXER_CHUNK)
    if "offload_state" in fields:  # a fallback's: the state back on the device
        out.append({k: v for k, v in f.items() if k != "offload_state"})
    return out


def references(options: list[dict], current: dict) -> list[dict | None]:
    """For each of ``options``, the settings whose work outside the decoder layers its work
    may be counted against (:func:`arctic.plan.counts.step_work`'s ``outside``): the current
    settings when they share it, else the first option before it that does and is counted
    whole; None: counted whole (the ring's three degrees share one outside: the first is
    counted whole, the other two against it)."""
    whole, refs = [current], []
    for o in options:
        ref = next((f for f in whole if shares_outside(o, f)), None)
        if ref is None:
            whole.append(o)
        refs.append(ref)
    return refs


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
    (``predict_with(fields, outside)``: a :class:`~arctic.plan.speed.Prediction`, from the
    step's counted work, which may take the work outside the layers from the settings
    ``outside``, :func:`references`' choice: :func:`arctic.plan.counts.step_work`) and
    plans the memory of those predicted faster, fastest first (``plan_with(fields)``: an
    :class:`Estimate`), moving to the first that fits; it stops when no neighbour is both
    faster (by ``min_gain`` of the current time: less is within the model's error, and not
    worth a memory plan) and fits, or after ``rounds`` rounds. ``prefetch(list of (fields,
    outside), wait=True)``, if given, is called with each round's neighbours and their
    :func:`references` before they are predicted (to count their work in parallel), and
    with the start and its neighbours, ``wait=False``, before the start's memory is planned
    (to count them meanwhile). ``fallbacks``: changes to ``base`` tried in turn when it
    does not fit (sequence blocks, the optimizer's state on the host,
    ``{"offload_state": "optimizer"}``, which ``plan_with`` and ``predict_with`` read as the
    training state's placement); the descent starts from the first that fits, and may take
    the change back (:func:`neighbours`).

    Returns the chosen settings' estimate (None if ``base`` does not fit) and every setting
    predicted, as ``(fields, predicted s, verdict)``."""
    seen: dict[str, tuple[dict, float, str]] = {}

    def key(fields: dict) -> str:
        return repr(sorted(fields.items()))

    def predicted(fields: dict, ref: dict | None = None) -> float:
        k = key(fields)
        if k not in seen:
            seen[k] = (fields, predict_with(fields, ref).step_s, "predicted")
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
        if prefetch is not None:  # their work is counted while the memory is planned
            options = neighbours(current, sp_size=sp_size, heads=heads, mixers=mixers,
                                 unsupported=unsupported)
            prefetch([(current, None), *zip(options, references(options, current))],
                     wait=False)
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
        refs = references(options, current)
        if prefetch is not None:
            prefetch(list(zip(options, refs)))
        faster = sorted((predicted(o, r), i, o) for i, (o, r) in enumerate(zip(options, refs))
                        if predicted(o, r) < t_best * (1 - min_gain))
        moved = False
        plans = _ahead([lambda o=o: plan_with(o) for _, _, o in faster], LOOKAHEAD)
        for (t, _, o), planned in zip(faster, plans):
            e = planned()
            verdict(o, "fits" if e.fits else f"does not fit ({e.limit()})")
            log(f"  {_short(o, current)}: {t:.3f} s predicted, "
                f"{'fits' if e.fits else 'does not fit (' + e.limit() + ')'}")
            if e.fits:
                current, best, t_best, moved = o, e, t, True
                break
        if not moved:
            break
    return best, list(seen.values())


LOOKAHEAD = 1
"""How many of the neighbours predicted faster :func:`fastest` plans beyond the one it needs
(the next is needed when that one does not fit): their traces fill the workers while the
first plan's stages wait on each other. Llama-3-8B at 4M tokens on 8 GPUs: the two faster
neighbours, both misfits, planned side by side."""


def _ahead(calls: list, lookahead: int) -> list:
    """For each of ``calls``, a function that returns its result: each call runs in a
    thread of its own from when the one ``lookahead`` before it is asked for (the first
    ``1 + lookahead`` at once). The threads are daemons: one left running when the caller
    stops asking keeps no process alive (its traces run in the workers)."""
    import threading

    started: list[tuple[threading.Thread, dict]] = []

    def run(call, box: dict) -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # raised where it is asked for
            box["error"] = error

    def result(i: int):
        while len(started) < min(len(calls), i + 1 + lookahead):
            box: dict = {}
            thread = threading.Thread(target=run, args=(calls[len(started)], box),
                                      daemon=True)
            started.append((thread, box))
            thread.start()
        thread, box = started[i]
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return [lambda i=i: result(i) for i in range(len(calls))]


def _short(fields: dict, ref: dict | None = None) -> str:
    """The settings (or those that differ from ``ref``'s) as ``key=value`` pairs."""
    items = {k: v for k, v in fields.items() if k != "sequence_parallel_size" and
             (ref is None or ref.get(k) != v)}
    return ", ".join(f"{k}={v}" for k, v in items.items()) or "(the same)"
