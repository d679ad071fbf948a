"""Attention results kept from a checkpointed layer's forward, so its recompute skips them.

Per-layer checkpointing redoes a layer's whole forward in backward. At long context the
attention kernels are most of that forward's FLOPs (and, with Ulysses or a ring, all of its
exchanges), while what they produce is small: ``out``, one hidden-sized tensor per layer, and
the fp32 lse of this rank's heads. A :class:`KeptAttention` store, one per checkpointed layer
call, records those in the forward; in the recompute, each attention autograd Function
(local and plain Ulysses in :mod:`ulysses.kernels`, head-chunked in
:mod:`ulysses.head_chunking`, fused in :mod:`ulysses.fused_attention`) takes its recorded
result instead of running the kernels, and saves it for its backward exactly as before. The
backward itself is unchanged, so the gradients are bit-identical to a full recompute.

What each Function calls is :func:`kept_or_computed`; outside a store's scope it just
computes. The checkpoint wrapper (:mod:`offload.checkpoint`, ``keep=KeptAttention``) opens
the scopes through ``torch.utils.checkpoint``'s ``context_fn``: recording around the forward,
replaying around the recompute. The store is found through a context variable set only
inside those scopes (like autocast's state): one layer call's, never process-wide.

With plain Ulysses (no head chunking) the q/k/v exchanges still run in the recompute: the
Function saves the head-sharded q, k, v its backward needs. The head-chunked and fused paths
save sequence-sharded tensors, so their recompute runs no exchange at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar

from torch import Tensor

_ACTIVE: ContextVar[tuple["KeptAttention", bool] | None] = ContextVar(
    "ulysses_kept_attention", default=None)


class KeptAttention:
    """One checkpointed layer call's attention results, in call order.

    The checkpoint wrapper drives it: :meth:`contexts` for ``context_fn``; after the forward,
    :meth:`take` (the tensors, which the store then no longer holds) and :meth:`reload_with`
    when it moved them somewhere (host memory), so the recompute gets them back.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[tuple, tuple[Tensor, ...]]] = []
        self._next = 0
        self._load: Callable[[], list[Tensor]] | None = None
        self._prefetch: Callable[[], object] | None = None

    def contexts(self):
        """``(forward context, recompute context)``, as ``torch.utils.checkpoint``'s
        ``context_fn`` returns them."""
        return self._scope(recording=True), self._scope(recording=False)

    @contextlib.contextmanager
    def _scope(self, *, recording: bool):
        if not recording and self._prefetch is not None:
            self._prefetch()  # the recompute starts: bring the results back meanwhile
            self._prefetch = None
        token = _ACTIVE.set((self, recording))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def __len__(self) -> int:
        """Attention calls recorded."""
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, ts in self._entries for t in ts)

    def take(self) -> list[Tensor]:
        """Every recorded tensor, in order; the store keeps only their shapes until
        :meth:`reload_with` gives it a way to get them back."""
        tensors = [t for _, ts in self._entries for t in ts]
        self._entries = [(sig, (None,) * len(ts)) for sig, ts in self._entries]
        return tensors

    def reload_with(self, load: Callable[[], list[Tensor]],
                    prefetch: Callable[[], object] | None = None) -> None:
        """``load()`` returns what :meth:`take` returned; called once, when the recompute
        asks for its first result. ``prefetch()``, if given, is called as the recompute
        starts (to start the copies back early)."""
        self._load, self._prefetch = load, prefetch

    def _record(self, signature: tuple, result: tuple[Tensor, ...]) -> None:
        self._entries.append((signature, tuple(t.detach() for t in result)))

    def _replay(self, signature: tuple) -> tuple[Tensor, ...]:
        if self._load is not None:
            tensors, self._load = iter(self._load()), None
            self._entries = [(sig, tuple(next(tensors) for _ in ts)) for sig, ts in self._entries]
        if self._next >= len(self._entries):
            raise RuntimeError(f"the recompute ran more attention calls than the forward "
                               f"({len(self._entries)}): the layer's forward is not "
                               f"deterministic in its control flow")
        recorded, result = self._entries[self._next]
        if recorded != signature:
            raise RuntimeError(f"attention call {self._next} of the recompute is {signature}, "
                               f"but the forward recorded {recorded}")
        # Handed over: the Function saves it for its backward; the store lets go.
        self._entries[self._next] = (recorded, ())
        self._next += 1
        return result


def kept_or_computed(signature: tuple, compute: Callable[[], tuple[Tensor, ...]]
                     ) -> tuple[Tensor, ...]:
    """``compute()``, except inside a checkpointed layer's recompute with a
    :class:`KeptAttention` store, where it is the result the forward recorded.

    Args:
        signature: what identifies the call (kind, shapes, dtype), checked in the recompute.
        compute: runs the attention; returns ``(out, lse)`` (any tuple of tensors).
    """
    active = _ACTIVE.get()
    if active is None:
        return compute()
    store, recording = active
    if not recording:
        return store._replay(signature)
    result = compute()
    store._record(signature, result)
    return result


__all__ = ["KeptAttention", "kept_or_computed"]
