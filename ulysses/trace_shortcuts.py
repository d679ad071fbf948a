"""Shortcuts for memory traces: work a trace of the step's allocations may skip.

The memory planner (:mod:`arctic.plan`) traces a training step under ``FakeTensorMode`` and
records every allocation and free. Two kinds of work cost it most of its time and change
nothing it records:

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

from torch import Tensor

from ulysses.torch_internals import is_fake

_ACTIVE = False


def skip(x: Tensor) -> bool:
    """Whether work on ``x`` that allocates nothing, or repeats, may be skipped: inside
    :func:`memory_trace` and ``x`` is a fake tensor."""
    if not _ACTIVE:
        return False
    return is_fake(x)


@contextlib.contextmanager
def memory_trace():
    """Let :func:`skip` answer true for fake tensors inside the block."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, True
    try:
        yield
    finally:
        _ACTIVE = saved


def kept(index: int, count: int, same_as_two_before: bool, x: Tensor) -> bool:
    """Whether iteration ``index`` of ``count`` of a loop runs in a trace: all do, unless
    :func:`skip` (``x``) and it repeats the two before it and is not the last."""
    return not (same_as_two_before and 2 <= index < count - 1 and skip(x))
