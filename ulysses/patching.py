"""Instance patches of modules: the one way this project replaces a module's method, and the
journal that records what a call changed on a model, so that it can be undone.

- :func:`replace_method` installs a replacement of a module's ``forward`` (or another method)
  on the instance; :func:`restore_method` takes it off; :func:`swapped_method` replaces it for
  the duration of a block (a probe). The class, parameters and ``state_dict`` keys stay.
- :func:`journaled` records, on the model its decorated ``apply_*`` is called with, every
  instance entry the call changed (an instance method, a hook, an attribute, a config's
  attention implementation, whatever transformers' own setters change): each module's and
  config's instance state is compared before and after the call. :mod:`arctic.removal`
  undoes and redoes what the journal holds.

Only the outermost journaled call records (nested ``apply_*`` calls belong to it); which call
is outermost is scoped to the call (a ContextVar), not kept process-wide.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

JOURNAL = "_sp_journal"
_ABSENT = object()
_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "patching_recording", default=False)
"""Inside a journaled call: a nested one records nothing of its own."""


@dataclass
class Change:
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


def _diff(obj: Any, old: dict) -> list[Change]:
    new, changes = vars(obj), []
    for key in old.keys() | new.keys():
        if key == JOURNAL:
            continue
        was, now = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(was, _Table) and was.table is now:
            # the same dict, perhaps with entries added or removed
            for k in was.entries.keys() | now.keys():
                a, b = was.entries.get(k, _ABSENT), now.get(k, _ABSENT)
                if a is not b:
                    changes.append(Change(obj, key, k, a, b))
            continue
        if isinstance(was, _Table):
            was = was.table
        if was is not now:
            changes.append(Change(obj, None, key, was, now))
    return changes


def journaled(apply: Callable) -> Callable:
    """Record on the model (its first argument) what ``apply`` changed, for
    :func:`remove_sequence_parallel`. A refused call (``ValueError``) changes nothing and
    records nothing."""

    @functools.wraps(apply)
    def call(model: nn.Module, *args, **kwargs):
        if _RECORDING.get() or not isinstance(model, nn.Module):
            return apply(model, *args, **kwargs)
        if getattr(model, JOURNAL, None) is not None and not model._sp_journal.on:
            raise ValueError(f"{apply.__name__}: sequence parallelism was removed from this "
                             f"model; call arctic.restore_sequence_parallel(model) before "
                             f"applying more of it")
        owners = _owners(model)
        before = [_state(o) for o in owners]
        token = _RECORDING.set(True)
        try:
            result = apply(model, *args, **kwargs)
        finally:
            _RECORDING.reset(token)
            changes = [c for o, old in zip(owners, before) for c in _diff(o, old)]
            if changes:
                journal = getattr(model, JOURNAL, None) or Journal()
                journal.changes.extend(changes)
                vars(model)[JOURNAL] = journal
        return result

    return call


class Journal:
    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.on = True
        self.kept: list[Change] = []  # left in place by the last removal


def bound(module: nn.Module, fn: Callable) -> Callable:
    """``fn`` bound to ``module`` as its first argument, as a method of the instance."""
    return types.MethodType(fn, module)


def replace_method(module: nn.Module, fn: Callable, *, name: str = "forward",
                   bind: bool = False) -> None:
    """Make ``fn`` the instance's ``name`` (``forward`` by default; bound to ``module`` with
    ``bind``, else called as it is). Inside a :func:`journaled` call the change is recorded
    for :mod:`arctic.removal`, like every other change of that call."""
    setattr(module, name, bound(module, fn) if bind else fn)


def restore_method(module: nn.Module, name: str = "forward") -> None:
    """Take an instance replacement of ``name`` off: the class's method again."""
    vars(module).pop(name, None)


def instance_method(module: nn.Module, name: str = "forward") -> Callable | None:
    """The instance's replacement of ``name``, or None when the class's runs."""
    return vars(module).get(name)


def is_bound_replacement(module: nn.Module, name: str = "forward") -> bool:
    """Whether the instance's ``name`` is a function bound to it (see :func:`bound`), not a
    wrapper object (a checkpointing or tiling wrapper)."""
    return isinstance(vars(module).get(name), types.MethodType)


@contextlib.contextmanager
def swapped_method(module: nn.Module, fn: Callable, name: str = "forward") -> Iterator[None]:
    """``fn`` as the instance's ``name`` inside the block; what was there before (an instance
    replacement, or the class's method) afterwards."""
    had = name in vars(module)
    old = vars(module).get(name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        if had:
            setattr(module, name, old)
        else:
            vars(module).pop(name, None)


__all__ = ["Change", "JOURNAL", "Journal", "bound", "instance_method", "is_bound_replacement",
           "journaled", "replace_method", "restore_method", "swapped_method"]
