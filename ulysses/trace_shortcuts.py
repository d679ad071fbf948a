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

Inside :func:`memory_trace`, :func:`skip` is true for fake tensors, and the code that does
such work skips it. It is false for any real tensor, so no real step can run short, and the
planner's tests hold a shortcut trace to the full one, byte for byte.
"""

from __future__ import annotations

import contextlib
import contextvars

from torch import Tensor

from ulysses.torch_internals import is_fake, unset_fake_temporarily

_SHORTCUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("memory_trace_shortcuts",
                                                                  default=False)
"""Inside :func:`memory_trace` (scoped to the block, not the process)."""


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


def kept(index: int, count: int, same_as_two_before: bool, x: Tensor) -> bool:
    """Whether iteration ``index`` of ``count`` of a loop runs in a trace: all do, unless
    :func:`skip` (``x``) and it repeats the two before it and is not the last."""
    return not (same_as_two_before and 2 <= index < count - 1 and skip(x))
