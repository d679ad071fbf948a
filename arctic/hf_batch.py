"""The batch a HF model is running, as its sequence-parallel attention modules see it.

A forward pre-hook on the base model (:func:`install_batch_hook`) checks that ``position_ids``
are given (without them every rank would start RoPE at 0, silently) and records them in a
:class:`BatchState` shared by the model's attention modules. The attention reads the
documents of the batch (packed sequences: a position that does not follow its predecessor
starts a document) from there, not from keyword arguments, so they arrive however a model's
decoder layers pass arguments on (StableLM and Nemotron layers drop them).

The documents are found lazily, at the first attention call of a forward: finding them
gathers the position ids across the sequence-parallel ranks, and every check of the
attention call runs before that first collective.

Activation checkpointing recomputes a layer in backward, when the state may already hold a
later forward's batch. :func:`recompute_context` restores the layer's own batch around the
recompute (``arctic.apply_activation_checkpointing`` passes it to ``torch.utils.checkpoint``
as its ``context_fn``). HF's own ``gradient_checkpointing_enable`` offers no such hook, so
under it a second forward with other documents, before the first forward's backward, is
refused instead of recomputed with the wrong documents.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

from arctic.anatomy import base_model, hf_checkpointing
from arctic.hf_binding import of_module
from ulysses import gather_sequence


def document_starts(position_ids_BS: Tensor) -> tuple[tuple[int, ...], ...] | None:
    """Per row, where a document starts: position 0, and wherever a position id is not its
    predecessor's + 1. ``None`` when every row is one document.

    Fake position ids (the memory planner's trace, :mod:`arctic.plan`) hold no values: each
    row is planned as one document, the case that needs the most attention memory."""
    if is_fake(position_ids_BS):
        return None
    breaks = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    if not bool(breaks.any()):
        return None
    return tuple((0,) + tuple((row.nonzero().squeeze(1) + 1).tolist()) for row in breaks)


def chunk_starts(starts, chunk: int, batch: int,
                 full_len: int) -> tuple[tuple[int, ...], ...]:
    """Llama4's chunked attention as documents: each document (``starts`` per row, None: one
    per row) cut every ``chunk`` positions from its own start, as transformers'
    ``chunked_overlay`` compares positions within a packed document; a query then attends
    causally within its chunk only."""
    rows = ((0,),) * batch if starts is None else starts
    return tuple(tuple(p for a, e in zip(row, row[1:] + (full_len,)) for p in range(a, e, chunk))
                 for row in rows)


class _Batch:
    """One forward's batch: this rank's position ids until the documents are found."""

    __slots__ = ("position_ids", "starts", "awaiting_backward")

    def __init__(self, position_ids: Tensor) -> None:
        self.position_ids: Tensor | None = position_ids
        self.starts = None
        self.awaiting_backward = False


class BatchState:
    """The batch of the model's latest forward, shared by its SP attention modules."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        self.model, self.mesh = model, mesh
        self.current: _Batch | None = None

    def segments(self):
        """The current batch's document starts in the full sequence (``None``: one document
        per row). The first call of a forward gathers the position ids (a collective that
        every rank makes at the same point: the first attention call). An attention module
        called on its own, outside any model forward, has no batch: like HF's attention
        with no mask, it attends causally over each whole row."""
        batch = self.current
        if batch is None:
            return None
        if batch.position_ids is not None:
            batch.starts = self._find(batch.position_ids)
            batch.position_ids = None
        return batch.starts

    def _find(self, position_ids: Tensor):
        full = gather_sequence(position_ids, self.mesh, dim=1)
        # torch's fake process group (the planner, benchmarks/scale_gpu.py) moves no data:
        # what came back is not the positions, so plan one document.
        if dist.get_backend(self.mesh.get_group(0)) == "fake":
            return None
        return document_starts(full)

    def start(self, position_ids: Tensor) -> None:
        """A new forward: refuse it if HF checkpointing would recompute the previous one's
        layers with this batch's documents; then make it current."""
        prev, new = self.current, _Batch(position_ids)
        if prev is not None and prev.awaiting_backward and hf_checkpointing(self.model):
            # Same control flow on every rank: the gathers below happen everywhere or nowhere.
            new.starts, new.position_ids = self._find(position_ids), None
            if self.segments() != new.starts:
                raise ValueError(
                    "a forward with other documents ran before the previous forward's "
                    "backward, under HF gradient checkpointing: its recompute would use the "
                    "new documents. Run backward before the next forward, or checkpoint with "
                    "arctic.apply_activation_checkpointing, which keeps each layer's batch")
        if torch.is_grad_enabled():
            new.awaiting_backward = True
        self.current = new

    @contextlib.contextmanager
    def _restored(self, batch: _Batch | None):
        saved, self.current = self.current, batch
        try:
            yield
        finally:
            self.current = saved

    def recompute_context(self):
        """``torch.utils.checkpoint`` ``context_fn``: the forward runs as it is; the recompute
        sees the batch the forward saw."""
        return contextlib.nullcontext(), self._restored(self.current)


def install_batch_hook(model: nn.Module, state: BatchState) -> None:
    """Record each forward's ``position_ids`` in ``state`` (a pre-hook on the base model, so
    that calling it directly for a tiled loss is checked as well). Applying again replaces the
    hook rather than stacking a second."""
    base = base_model(model)
    for name in ("_sp_batch_hook", "_sp_batch_done"):
        old = getattr(base, name, None)
        if old is not None:
            old.remove()

    def before(module, args, kwargs):
        # Bound through the installed forward: position ids given positionally count too.
        position_ids = of_module(module).bind(args, kwargs).role("position_ids")
        if position_ids is None:
            raise ValueError("position_ids are required under sequence parallelism: pass this "
                             "rank's shard of the full sequence's position_ids (arctic.data "
                             "builds them); without them every rank would start RoPE at 0")
        state.start(position_ids)

    def after(module, args, output):
        batch = state.current
        hidden = output[0] if isinstance(output, (tuple, list)) else getattr(
            output, "last_hidden_state", None)
        if batch is not None and batch.awaiting_backward and isinstance(hidden, Tensor) and \
                hidden.requires_grad:
            # Backward reaches the last hidden state before it recomputes any layer.
            def clear(grad, batch=batch):
                batch.awaiting_backward = False
                return grad
            hidden.register_hook(clear)
        elif batch is not None:
            batch.awaiting_backward = False

    base._sp_batch_hook = base.register_forward_pre_hook(before, with_kwargs=True)
    base._sp_batch_done = base.register_forward_hook(after)
    model.checkpoint_context_fn = state.recompute_context
