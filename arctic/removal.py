"""Taking sequence parallelism off a model, and putting it back.

Every ``apply_*`` of the recipe changes module *instances* only: an instance ``forward``, a
hook, an attribute, the config's attention implementation. Parameters, classes and
``state_dict`` keys stay as they were. :func:`ulysses.patching.journaled` records what one
``apply_*`` call changed, by comparing each module's and each config's instance state before
and after the call; :func:`remove_sequence_parallel` undoes the recorded changes (newest
first), so the model runs its own forwards again: full sequences on one process,
``generate()``, HF's loss and logits. :func:`restore_sequence_parallel` redoes them, exactly,
in the order they were made; the Trainer uses the pair to run SP in ``train()`` and
``evaluate()`` only.

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

from torch import nn

from ulysses.patching import JOURNAL, Change, Journal

_REPORTS = ("activation_offload",)
"""Attributes that report on the run (the offload session and its stats): kept."""

def _journal(model: nn.Module, caller: str) -> Journal:
    model = getattr(model, "module", model)  # a DeepSpeed engine or DDP wrapper: the model
    journal = vars(model).get(JOURNAL)
    if journal is None:
        raise ValueError(f"{caller}: {type(model).__name__} has no sequence parallelism "
                         f"applied by arctic")
    return journal


def _first_per_entry(changes) -> list[Change]:
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
    journal = vars(getattr(model, "module", model)).get(JOURNAL)
    return None if journal is None else journal.on


__all__ = ["remove_sequence_parallel", "restore_sequence_parallel",
           "sequence_parallel_on"]
