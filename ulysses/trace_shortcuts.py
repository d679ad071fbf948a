"""What the runtime asks about the memory planner's traces, in one place.

The memory planner (:mod:`arctic.plan`) traces a real training step under ``FakeTensorMode``
and records every allocation and free. The runtime asks three things of it, here and nowhere
else:

- :func:`is_traced`: whether a tensor belongs to such a trace (a fake tensor: shapes, no
  values). Code that would read values (document starts, a mask's content, a kernel's
  first-use check) takes the trace's path instead;
- :func:`real_values`: a block that computes on real tensors even inside a trace (the
  weight-free probes of a model's forward);
- :func:`skip` and :func:`kept`: work a trace of the step's allocations may skip.

Two kinds of work cost a trace most of its time and change nothing it records:

- repeats: a tile of a tiled MLP or loss, a period of the head-chunk schedule, a ring hop
  that has the shapes of those before it allocates and frees exactly what they did (the
  first repeat is kept: it shows what accumulating into the first one's outputs allocates,
  and the last is always kept);
- in-place copies and adds into buffers that already exist (packing an exchange's send
  buffer, placing received blocks): they allocate nothing.

A loop whose iterations each leave something alive (a hybrid's mixer chunks:
:mod:`arctic.hf.mixer_chunks`) keeps the iterations where the step holds most
(:func:`kept_growing`) and stands in for the others: their results are made with the shapes
of those before them, uncomputed (:func:`stand_in`), and kept as long as computed ones.

Inside :func:`memory_trace`, :func:`skip` is true for fake tensors, and the code that does
such work skips it. It is false for any real tensor, so no real step can run short, and the
planner's tests hold a shortcut trace to the full one, byte for byte.

A trace that counts a step's work (:func:`work_trace`) may leave repeats out too, but not
their work: the loops that support it (:func:`repeats`, and the head-chunk schedule of
:mod:`ulysses.chunk_loop`) run the iteration before a left-out run under :func:`weighted`, and
the counter multiplies what that iteration does by :func:`work_weight` (1 + the iterations
it stands for). In-place copies stay in a work trace (they move bytes), but of a loop of
copies alike in shape only the first runs, weighed (:func:`alike`: packing an exchange,
placing its blocks); loops that do not weigh their iterations run whole. The planner's tests
hold such a count to the full one.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import Tensor

from ulysses.torch_internals import is_fake, unset_fake_temporarily

_SHORTCUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("memory_trace_shortcuts",
                                                                  default=False)
"""Inside :func:`memory_trace` (scoped to the block, not the process)."""
_REPEATS: contextvars.ContextVar[bool] = contextvars.ContextVar("work_trace_repeats",
                                                               default=False)
"""Inside :func:`work_trace`."""
_NOTE_STAND_IN: contextvars.ContextVar = contextvars.ContextVar("stand_in_noted",
                                                             default=None)
"""Told of each :func:`stand_in` (:func:`stand_ins_noted`): the planner's tracker."""
_WEIGHT: contextvars.ContextVar[int] = contextvars.ContextVar("work_weight", default=1)
"""What the work counted now stands for (:func:`weighted`)."""


def is_traced(x: Tensor) -> bool:
    """Whether ``x`` belongs to the planner's trace: a fake tensor, with a shape and no
    values."""
    return is_fake(x)


def real_values():
    """A block whose new tensors are real even inside the planner's trace (a probe that needs
    values); a no-op outside one."""
    return unset_fake_temporarily()


def skip(x: Tensor) -> bool:
    """Whether work on ``x`` that allocates nothing, or repeats, may be skipped: inside
    :func:`memory_trace` and ``x`` is a fake tensor."""
    return _SHORTCUTS.get() and is_fake(x)


@contextlib.contextmanager
def memory_trace():
    """Let :func:`skip` answer true for fake tensors inside the block."""
    token = _SHORTCUTS.set(True)
    try:
        yield
    finally:
        _SHORTCUTS.reset(token)


@contextlib.contextmanager
def work_trace():
    """Let :func:`skip_repeats` answer true for fake tensors inside the block, for a trace
    that counts work (the loops then weigh what they run: :func:`weighted`)."""
    token = _REPEATS.set(True)
    try:
        yield
    finally:
        _REPEATS.reset(token)


def skip_repeats(x: Tensor) -> bool:
    """Whether a loop that weighs its iterations (:func:`weighted`) may leave repeats out:
    inside :func:`memory_trace` or :func:`work_trace`, and ``x`` is a fake tensor."""
    return (_SHORTCUTS.get() or _REPEATS.get()) and is_fake(x)


def work_weight() -> int:
    """How many times the work done now counts (1 outside :func:`weighted`)."""
    return _WEIGHT.get()


def weighted(times: int):
    """A block whose work counts ``times`` times (nested blocks multiply): an iteration that
    stands for itself and ``times - 1`` left-out repeats of it. At 1 (every real run) a
    no-op context."""
    return contextlib.nullcontext() if times == 1 else _weighted(times)


@contextlib.contextmanager
def _weighted(times: int):
    token = _WEIGHT.set(_WEIGHT.get() * times)
    try:
        yield
    finally:
        _WEIGHT.reset(token)


def _left_out(index: int, count: int, same_as_two_before: bool) -> bool:
    """The shortcuts' rule: an iteration that repeats the two before it and is not the last."""
    return same_as_two_before and 2 <= index < count - 1


def repeats(count: int, same_as_two_before, x: Tensor) -> list[tuple[int, int]]:
    """``(index, times)`` of the iterations of a loop of ``count`` to run: all, once each; in
    a memory or work trace (:func:`skip_repeats` of ``x``), an iteration that repeats the two
    before it (``same_as_two_before(index)``) and is not the last is left out, and the one
    run before it counts ``times`` = 1 + the left-out iterations after it. The loop runs each
    under :func:`weighted` (``times``)."""
    if not skip_repeats(x):
        return [(i, 1) for i in range(count)]
    out: list[tuple[int, int]] = []
    for i in range(count):
        if _left_out(i, count, 2 <= i and same_as_two_before(i)):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def kept_growing(sizes: list, x: Tensor) -> list[bool]:
    """Which iterations of a loop whose iterations each leave something alive after them
    (a chunk's output and the inputs its checkpoint holds) run in a memory trace
    (:func:`skip` of ``x``); ``sizes[i]``: a key of iteration ``i``'s shapes. The left-out
    ones are stood in for (:func:`stand_in`): what they leave is made, not computed. A step
    holds most in such a loop at the last iteration of each size (the most left alive
    before it, and that size's working set), so the last of each run of one size is kept,
    as are the first two (the first repeat shows what following one leaves) and the last."""
    count = len(sizes)
    if not skip(x):
        return [True] * count

    def same(i: int) -> bool:
        return sizes[i] == sizes[i - 1] == sizes[i - 2] and sizes[i + 1] == sizes[i]
    return [not _left_out(i, count, 2 <= i < count - 1 and same(i)) for i in range(count)]


def stand_in(like: Tensor | None) -> Tensor | None:
    """For a left-out iteration in a memory trace: a tensor of ``like``'s shape, dtype and
    device, uncomputed, which the planner's tracker counts as made where ``like`` was."""
    if like is None:
        return None
    out = torch.empty_like(like)
    note = _NOTE_STAND_IN.get()
    if note is not None:
        note(out, like)
    return out


@contextlib.contextmanager
def stand_ins_noted(note):
    """Call ``note(new, like)`` for each :func:`stand_in` made in the block."""
    token = _NOTE_STAND_IN.set(note)
    try:
        yield
    finally:
        _NOTE_STAND_IN.reset(token)


def alike(keys: dict, x: Tensor) -> list[tuple[object, int]]:
    """``(index, times)`` of the iterations of a loop to run, given ``keys`` (index -> a key;
    iterations of one key do the same work: in-place copies of one shape): every index once;
    in a work trace (:func:`work_trace`) of fake ``x``, the first index of each key, which
    counts ``times`` = how many share the key (run it under :func:`weighted`). A memory trace
    skips such copies before (:func:`skip`)."""
    if not (_REPEATS.get() and is_fake(x)):
        return [(i, 1) for i in keys]
    first: dict = {}
    for i, key in keys.items():
        first.setdefault(key, [i, 0])[1] += 1
    return [(i, times) for i, times in first.values()]


def kept(index: int, count: int, same_as_two_before: bool, x: Tensor) -> bool:
    """Whether iteration ``index`` of ``count`` of a loop runs in a trace: all do, unless
    :func:`skip` (``x``) and it repeats the two before it and is not the last."""
    return not (_left_out(index, count, same_as_two_before) and skip(x))
