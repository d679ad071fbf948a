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

flash-attn's varlen arguments (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``: the
cumulative document lengths of the full, flattened batch, as transformers'
``DataCollatorWithFlattening`` and :mod:`arctic.data` on a per-document mesh give them) name
the documents directly, as flash-attn reads them: they are then the documents, checked
against the position ids (which must count up by one within each). A mesh built with
``per_document`` cuts each row by its documents, which cannot be read back from the pieces'
position ids: there a batch with packed documents must carry them.

Activation checkpointing recomputes a layer in backward, when the state may already hold a
later forward's batch. :func:`recompute_context` restores the layer's own batch around the
recompute (``arctic.apply_activation_checkpointing`` passes it to ``torch.utils.checkpoint``
as its ``context_fn``). HF's own ``gradient_checkpointing_enable`` offers no such hook, so
under it a second forward with other documents, before the first forward's backward, is
refused instead of recomputed with the wrong documents.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from arctic.hf.anatomy import base_model, hf_checkpointing
from arctic.hf.binding import of_module
from ulysses import gather_sequence
from ulysses.mesh import axis_size, mesh_dims
from ulysses.trace_shortcuts import is_traced

VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""flash-attn's varlen arguments, as transformers passes them (``FlashAttentionKwargs``)."""


_SP_LOSS_CALL = contextvars.ContextVar("arctic_router_by_sp_loss", default=False)


@contextlib.contextmanager
def routed_by_sp_loss():
    """The SP loss's call of the base model: its router logits go to :func:`router_loss`."""
    token = _SP_LOSS_CALL.set(True)
    try:
        yield
    finally:
        _SP_LOSS_CALL.reset(token)


def check_router_logits_asked(kwargs: dict) -> None:
    """``ValueError`` when a base model call outside the SP loss asks for router logits: the
    HF forward around it would add a router loss of this rank's piece alone (a product of
    means over the piece, not the sequence's)."""
    if kwargs.get("output_router_logits") and not _SP_LOSS_CALL.get():
        raise ValueError("output_router_logits=True under sequence parallelism: the model's own "
                         "forward would add the MoE router loss of this rank's piece of the "
                         "sequence only. Use arctic.apply_sp_loss, which adds it over the "
                         "sequence-parallel group, or set output_router_logits=False")


def document_starts(position_ids_BS: Tensor) -> tuple[tuple[int, ...], ...] | None:
    """Per row, where a document starts: position 0, and wherever a position id is not its
    predecessor's + 1. ``None`` when every row is one document.

    Fake position ids (the memory planner's trace, :mod:`arctic.plan`) hold no values: each
    row is planned as one document, the case that needs the most attention memory."""
    if is_traced(position_ids_BS):
        return None
    breaks = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    if not bool(breaks.any()):
        return None
    return tuple((0,) + tuple((row.nonzero().squeeze(1) + 1).tolist()) for row in breaks)


def varlen_documents(kwargs, batch: int, full_len: int):
    """The documents of a batch of ``batch`` rows of ``full_len`` tokens that flash-attn's
    varlen arguments in ``kwargs`` describe, per row (``((0,),) * batch`` for whole rows);
    None when none are given. ``cu_seq_lens_q`` holds the cumulative lengths over the
    flattened batch (0 first, ``batch * full_len`` last, every row's start among them);
    ``cu_seq_lens_k`` must equal it (self-attention) and ``max_length_q``/``_k`` be the
    longest document, as flash-attn reads them. ``ValueError`` otherwise, before any
    collective."""
    given = {n: kwargs[n] for n in VARLEN if kwargs.get(n) is not None}
    if not given:
        return None
    if "cu_seq_lens_q" not in given:
        raise ValueError(f"flash-attn varlen arguments {sorted(given)} without cu_seq_lens_q: "
                         f"give the documents' cumulative lengths")
    cu = torch.as_tensor(given["cu_seq_lens_q"])
    if is_traced(cu):
        return None
    other = given.get("cu_seq_lens_k")
    if other is not None and not torch.equal(torch.as_tensor(other).cpu(), cu.cpu()):
        raise ValueError("cu_seq_lens_k differs from cu_seq_lens_q: cross-attention between "
                         "other documents is not implemented; give the same for both")
    total = batch * full_len
    bounds = cu.cpu().tolist() if cu.dim() == 1 and not cu.is_floating_point() else None
    ok = bounds is not None and bounds and bounds[0] == 0 and bounds[-1] == total
    ok = ok and all(b > a for a, b in zip(bounds, bounds[1:]))
    if not ok or not set(range(0, total, full_len)) <= set(bounds):
        raise ValueError(f"cu_seq_lens_q must be the 1-D integer cumulative document lengths of "
                         f"the full batch ({batch} rows of {full_len} tokens, flattened): 0 "
                         f"first, {total} last, increasing, each row's start among them; got "
                         f"{bounds if bounds is not None else tuple(cu.shape)}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    for name in ("max_length_q", "max_length_k"):
        if name in given and int(given[name]) != longest:
            raise ValueError(f"{name}={int(given[name])} is not the longest document "
                             f"({longest}) of cu_seq_lens_q; flash-attn would attend with it")
    return tuple(tuple(c - b * full_len for c in bounds if b * full_len <= c < (b + 1) * full_len)
                 for b in range(batch))


def cut_documents(mesh: DeviceMesh, kwargs, batch: int, piece_len: int):
    """What ``shard_sequence``/``gather_sequence`` take as ``segments=`` for a batch of
    ``batch`` rows of ``piece_len`` tokens per rank, given its keyword arguments: on a mesh
    built with ``per_document`` (and a ring), the documents its varlen arguments give (whole
    rows without them); None on any other mesh."""
    if not mesh_dims(mesh).per_document_ring:
        return None
    full = piece_len * axis_size(mesh, "ulysses") * axis_size(mesh, "ring")
    return varlen_documents(kwargs, batch, full) or ((0,),) * batch


def chunk_starts(starts, chunk: int, batch: int,
                 full_len: int) -> tuple[tuple[int, ...], ...]:
    """Llama4's chunked attention as documents: each document (``starts`` per row, None: one
    per row) cut every ``chunk`` positions from its own start, as transformers'
    ``chunked_overlay`` compares positions within a packed document; a query then attends
    causally within its chunk only."""
    rows = ((0,),) * batch if starts is None else starts
    return tuple(tuple(p for a, e in zip(row, row[1:] + (full_len,)) for p in range(a, e, chunk))
                 for row in rows)


def text_positions(position_ids: Tensor) -> Tensor | None:
    """The positions that tell documents apart: ``position_ids`` themselves, or the text row
    of M-RoPE positions (Qwen2.5-VL, Qwen3-VL): ``[4, B, s]`` carries it first, as
    transformers' packed format; ``[3, B, s]`` has none (None: whole rows, as transformers
    then builds no packed mask either)."""
    if position_ids.dim() != 3:
        return position_ids
    if position_ids.shape[0] == 4:
        return position_ids[0]
    if position_ids.shape[0] == 3:
        return None
    raise ValueError(f"3-D position_ids must be M-RoPE's [3, batch, seq] or [4, batch, seq] "
                     f"(text positions first), got shape {tuple(position_ids.shape)}")


def image_blocks(token_types: Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per row of ``token_types [B, S]``, ``(first, end)`` of each run of 1 (an image's tokens,
    as transformers' ``get_block_sequence_ids_for_mask`` numbers them)."""
    marks = torch.nn.functional.pad((token_types == 1).int(), (1, 1))
    edges = marks[:, 1:] - marks[:, :-1]
    return tuple(tuple(zip((row == 1).nonzero().squeeze(1).tolist(),
                           (row == -1).nonzero().squeeze(1).tolist())) for row in edges)


class _Batch:
    """One forward's batch: this rank's position ids until the documents are found."""

    __slots__ = ("position_ids", "varlen", "varlen_given", "starts", "awaiting_backward",
                 "token_types", "blocks")

    def __init__(self, position_ids: Tensor, varlen=None, varlen_given=None,
                 token_types: Tensor | None = None) -> None:
        self.position_ids: Tensor | None = position_ids
        self.varlen = varlen
        """The documents the call's varlen arguments gave (:func:`varlen_documents`)."""
        self.varlen_given = varlen_given or {}
        """Those arguments as the forward got them (name -> object)."""
        self.starts = None
        self.awaiting_backward = False
        self.token_types = token_types
        """This rank's piece of the token types whose runs of 1 are image blocks (Gemma3's
        ``token_type_ids``), until :meth:`BatchState.blocks` reads them."""
        self.blocks = None


class BatchState:
    """The batch of the model's latest forward, shared by its SP attention modules."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, block_key: str | None = None) -> None:
        self.model, self.mesh = model, mesh
        self.block_key = block_key
        """The base model's argument whose 1s mark image blocks (:meth:`blocks`), or None."""
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
            batch.starts = self._find(batch.position_ids, batch.varlen)
            batch.position_ids = None
        return batch.starts

    def _gathered(self, piece: Tensor, varlen) -> Tensor | None:
        """The full sequence's ``[B, S]`` from each rank's ``piece`` (a collective; on a
        per-document mesh cut by the varlen arguments' documents). None on torch's fake
        process group (the planner, benchmarks/scale_gpu.py), which moves no data."""
        per_document = mesh_dims(self.mesh).per_document_ring
        cut = varlen if per_document and varlen is not None else None
        full = gather_sequence(piece, self.mesh, dim=1, segments=cut)
        return None if dist.get_backend(self.mesh.get_group(0)) == "fake" else full

    def _find(self, position_ids: Tensor | None, varlen):
        if position_ids is None:  # M-RoPE positions without a text row: what varlen says
            return None if varlen is None or all(row == (0,) for row in varlen) else varlen
        per_document = mesh_dims(self.mesh).per_document_ring
        full = self._gathered(position_ids, varlen)
        if full is None:  # no values: plan one document
            return None
        if varlen is not None:
            # Every rank gathered the same positions: all refuse alike.
            breaks = document_starts(full) or ((0,),) * full.shape[0]
            for b, (row, found) in enumerate(zip(varlen, breaks)):
                stray = sorted(set(found) - set(row))
                if stray:
                    raise ValueError(
                        f"position_ids of row {b} restart at {stray[:4]}, inside documents "
                        f"that cu_seq_lens_q gives ({list(row[:8])}...); the varlen arguments "
                        f"and the position ids must describe the same documents")
            return None if all(row == (0,) for row in varlen) else varlen
        starts = document_starts(full)
        if starts is not None and per_document:
            raise ValueError("the mesh cuts each packed document on its own (per_document), "
                             "which the pieces' position_ids cannot tell back: give the batch's "
                             "documents as cu_seq_lens_q (arctic.data does on such a mesh)")
        return starts

    def forwarded(self, varlen_kwargs: dict) -> bool:
        """Whether ``varlen_kwargs`` (what an attention call got) are the very objects the
        model's forward was called with: then they name the batch's documents, read once
        by the hook, and the call need not read them again (a device sync per layer)."""
        given = {} if self.current is None else self.current.varlen_given
        return given.keys() == varlen_kwargs.keys() and \
            all(varlen_kwargs[n] is given[n] for n in given)

    def blocks(self):
        """The current batch's image blocks in the full sequence (per row, ``(first, end)``
        of each run of token type 1), or None: no token types given. The first call of a
        forward gathers the token types (after :meth:`segments`' gather, on every rank)."""
        batch = self.current
        if batch is None:
            return None
        if batch.token_types is not None:
            batch.blocks = self._find_blocks(batch.token_types, batch.varlen)
            batch.token_types = None
        return batch.blocks

    def _find_blocks(self, token_types: Tensor, varlen):
        full = self._gathered(token_types, varlen)
        if full is None:  # no values: planned as text
            return None
        blocks = image_blocks(full)
        return blocks if any(e - a > 1 for row in blocks for a, e in row) else None

    def start(self, position_ids: Tensor, varlen=None, varlen_given=None,
              token_types: Tensor | None = None) -> None:
        """A new forward (``varlen``: the documents its varlen arguments gave, and
        ``varlen_given`` those arguments): refuse it if HF checkpointing would recompute the
        previous one's layers with this batch's documents; then make it current."""
        prev, new = self.current, _Batch(position_ids, varlen, varlen_given, token_types)
        if prev is not None and prev.awaiting_backward and hf_checkpointing(self.model):
            # Same control flow on every rank: the gathers below happen everywhere or nowhere.
            new.starts, new.position_ids = self._find(position_ids, varlen), None
            if token_types is not None:
                new.blocks, new.token_types = self._find_blocks(token_types, varlen), None
            if self.segments() != new.starts or self.blocks() != new.blocks:
                raise ValueError(
                    "a forward with other documents ran before the previous forward's "
                    "backward, under HF gradient checkpointing: its recompute would use the "
                    "new documents. Run backward before the next forward, or checkpoint with "
                    "arctic.apply_activation_checkpointing, which keeps each layer's batch")
        if position_ids is None:
            new.starts = self._find(None, varlen)
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
        check_router_logits_asked(kwargs)
        # arctic.data's token_mask (the padding of the cut) is the SP loss's, not the model's
        kwargs.pop("token_mask", None)
        # Bound through the installed forward: position ids given positionally count too.
        call = of_module(module).bind(args, kwargs)
        position_ids = call.role("position_ids")
        if position_ids is None:
            raise ValueError("position_ids are required under sequence parallelism: pass this "
                             "rank's shard of the full sequence's position_ids (arctic.data "
                             "builds them); without them every rank would start RoPE at 0")
        full = position_ids.shape[-1] * axis_size(state.mesh, "ulysses") * \
            axis_size(state.mesh, "ring")
        batch = position_ids.shape[-2] if position_ids.dim() >= 2 else 1
        types = None
        if state.block_key is not None:  # Gemma3: its token_type_ids mark image blocks
            types = call.named.get(state.block_key, call.extra.get(state.block_key))
        state.start(text_positions(position_ids), varlen_documents(kwargs, batch, full),
                    {n: kwargs[n] for n in VARLEN if kwargs.get(n) is not None}, types)
        return args, kwargs

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
