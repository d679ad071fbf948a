"""Taking sequence parallelism off a model, and putting it back.

Every ``apply_*`` of the recipe changes module *instances* only: an instance ``forward``, a
hook, an attribute, the config's attention implementation. Parameters, classes and
``state_dict`` keys stay as they were. :func:`journaled` records what one ``apply_*`` call
changed, by comparing each module's and each config's instance state before and after the
call; :func:`remove_sequence_parallel` undoes the recorded changes (newest first), so the
model runs its own forwards again: full sequences on one process, ``generate()``, HF's loss
and logits. :func:`restore_sequence_parallel` redoes them, exactly, in the order they were
made; the Trainer uses the pair to run SP in ``train()`` and ``evaluate()`` only.

Parameter sharding (FSDP2, DeepSpeed ZeRO) is not undone: it is how the parameters are
stored, and its hooks gather them for any forward. Under ZeRO-3 the ZeRO-3 leaf marks
(``_z3_leaf``) we set stay too: ZeRO-3 registered its hooks by them and gathers a leaf's
whole subtree in the leaf's hook, which the module's own forward then reads. The
``activation_offload`` session stays on the model as well, for its stats.

What someone else changed after us is not ours to overwrite: if a forward, hook or attribute
we set has since been replaced (e.g. by a wrapper installed on the instance), both calls
raise ``ValueError`` naming it, and change nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

_JOURNAL = "_sp_journal"
_REPORTS = ("activation_offload",)
"""Attributes that report on the run (the offload session and its stats): kept."""
_ABSENT = object()
_depth = 0  # journaled calls running: only the outermost records


@dataclass
class _Change:
    """One instance entry: ``owner.__dict__[key]`` (or, with ``table``, the entry ``key`` of
    the dict ``owner.__dict__[table]``, e.g. a hook of ``_forward_pre_hooks``) went from
    ``before`` to ``after`` (either may be absent)."""
    owner: Any
    table: str | None
    key: Any
    before: Any
    after: Any

    def _where(self) -> dict:
        return vars(self.owner) if self.table is None else vars(self.owner)[self.table]

    def _name(self) -> str:
        what = f"{self.table}[{self.key!r}]" if self.table else self.key
        return f"{type(self.owner).__name__}.{what}"

    def check(self, now: Any) -> None:
        """``ValueError`` unless the entry holds ``now`` (what we left there)."""
        held = self._where().get(self.key, _ABSENT)
        if held is not now:
            raise ValueError(f"{self._name()} was changed after sequence parallelism was "
                             f"applied (something else replaced it); removing or restoring "
                             f"SP would overwrite that change. Undo it first")

    def set(self, value: Any) -> None:
        where = self._where()
        if value is _ABSENT:
            where.pop(self.key, None)
            return
        where[self.key] = value
        if self.table is not None and all(isinstance(k, int) for k in where):
            # hooks run in the order of their handle ids: put this one back in its place
            items = sorted(where.items())
            where.clear()
            where.update(items)


class _Table:
    """A dict of an instance (a hook table): the dict itself and a copy of its entries."""

    def __init__(self, table: dict) -> None:
        self.table, self.entries = table, dict(table)


def _state(obj: Any) -> dict:
    """A shallow copy of an instance's ``__dict__``, its dicts (hook tables) copied too."""
    return {k: _Table(v) if isinstance(v, dict) else v for k, v in vars(obj).items()}


def _owners(model: nn.Module) -> list:
    """The modules of ``model`` and their configs (with the configs a config holds, e.g. a
    VLM's ``text_config``: each keeps its own attention implementation)."""
    owners, seen = [], set()

    def add(obj: Any) -> None:
        if obj is not None and hasattr(obj, "__dict__") and id(obj) not in seen:
            seen.add(id(obj))
            owners.append(obj)

    for m in model.modules():
        add(m)
        config = getattr(m, "config", None)
        add(config)
        if config is not None and hasattr(config, "__dict__"):
            for v in vars(config).values():
                if type(v).__name__.endswith("Config"):
                    add(v)
    return owners


def _diff(obj: Any, old: dict) -> list[_Change]:
    new, changes = vars(obj), []
    for key in old.keys() | new.keys():
        if key == _JOURNAL:
            continue
        was, now = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(was, _Table) and was.table is now:
            # the same dict, perhaps with entries added or removed
            for k in was.entries.keys() | now.keys():
                a, b = was.entries.get(k, _ABSENT), now.get(k, _ABSENT)
                if a is not b:
                    changes.append(_Change(obj, key, k, a, b))
            continue
        if isinstance(was, _Table):
            was = was.table
        if was is not now:
            changes.append(_Change(obj, None, key, was, now))
    return changes


def journaled(apply: Callable) -> Callable:
    """Record on the model (its first argument) what ``apply`` changed, for
    :func:`remove_sequence_parallel`. A refused call (``ValueError``) changes nothing and
    records nothing."""

    @functools.wraps(apply)
    def call(model: nn.Module, *args, **kwargs):
        global _depth
        if _depth or not isinstance(model, nn.Module):
            return apply(model, *args, **kwargs)
        if getattr(model, _JOURNAL, None) is not None and not model._sp_journal.on:
            raise ValueError(f"{apply.__name__}: sequence parallelism was removed from this "
                             f"model; call arctic.restore_sequence_parallel(model) before "
                             f"applying more of it")
        owners = _owners(model)
        before = [_state(o) for o in owners]
        _depth += 1
        try:
            result = apply(model, *args, **kwargs)
        finally:
            _depth -= 1
            changes = [c for o, old in zip(owners, before) for c in _diff(o, old)]
            if changes:
                journal = getattr(model, _JOURNAL, None) or _Journal()
                journal.changes.extend(changes)
                vars(model)[_JOURNAL] = journal
        return result

    return call


class _Journal:
    def __init__(self) -> None:
        self.changes: list[_Change] = []
        self.on = True
        self.kept: list[_Change] = []  # left in place by the last removal


def _journal(model: nn.Module, caller: str) -> _Journal:
    model = getattr(model, "module", model)  # a DeepSpeed engine or DDP wrapper: the model
    journal = vars(model).get(_JOURNAL)
    if journal is None:
        raise ValueError(f"{caller}: {type(model).__name__} has no sequence parallelism "
                         f"applied by arctic")
    return journal


def _first_per_entry(changes) -> list[_Change]:
    seen, first = set(), []
    for c in changes:
        entry = (id(c.owner), c.table, c.key)
        if entry not in seen:
            seen.add(entry)
            first.append(c)
    return first


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo every change the ``arctic.apply_*`` calls (and the Trainer, the recipe) made to
    ``model``: the instance forwards, hooks and attributes they set, and the attention
    implementation. The model's own forward runs again, on whole sequences, with its own
    attention, MLP and logits (parameter sharding stays, see the module docstring).
    Returns ``model``. Removing twice is a no-op; :func:`restore_sequence_parallel` puts SP
    back. ``ValueError`` (model unchanged) when SP was never applied, or when something has
    replaced one of the recorded entries since."""
    journal = _journal(model, "remove_sequence_parallel")
    if journal.on:
        model = getattr(model, "module", model)
        zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
        journal.kept = [c for c in journal.changes if c.table is None and (
            c.key in _REPORTS or (zero3 and c.key == "_z3_leaf"))]
        undo = [c for c in journal.changes if all(c is not k for k in journal.kept)]
        # an entry changed by several calls holds the newest change's value
        for change in _first_per_entry(reversed(undo)):
            change.check(change.after)
        for change in reversed(undo):
            change.set(change.before)
        journal.on = False
    return model


def restore_sequence_parallel(model: nn.Module) -> nn.Module:
    """Put back what :func:`remove_sequence_parallel` took off, exactly as it was applied.
    Returns ``model``; a no-op while SP is on."""
    journal = _journal(model, "restore_sequence_parallel")
    if not journal.on:
        redo = [c for c in journal.changes if all(c is not k for k in journal.kept)]
        for change in _first_per_entry(redo):
            change.check(change.before)
        for change in redo:
            change.set(change.after)
        journal.on, journal.kept = True, []
    return model


def sequence_parallel_on(model: nn.Module) -> bool | None:
    """True while SP applied by arctic is on, False when removed, None if never applied."""
    journal = vars(getattr(model, "module", model)).get(_JOURNAL)
    return None if journal is None else journal.on


__all__ = ["journaled", "remove_sequence_parallel", "restore_sequence_parallel",
           "sequence_parallel_on"]
