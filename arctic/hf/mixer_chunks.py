"""``mixer_chunk``: a hybrid's mixer layer in sequence chunks of this rank's piece.

A mixer layer (projections, causal convolution, scan, gates, gated norm, output projection)
holds, run whole, every intermediate of the whole piece at once: a recomputed gated delta
net at 225K tokens per rank holds gigabytes of projections, convolution outputs, per-chunk
states and its gated norm's float32 upcast. Run in chunks of ``size`` positions instead, the
model's own forward runs on one chunk at a time, under a checkpoint (its intermediates are
freed, and recomputed in the backward), with the convolution's window and the scan's state
carried from chunk to chunk: the same mechanism as passing the state between ranks
(:mod:`ulysses.state_passing`), within a rank. What a step holds is then one chunk's working
set, the chunk inputs (views of the layer's input) and a state per chunk.

Three passes over this rank's runs (one without a ring; a zigzag rank's two):

1. *tail*: the forward on each run's last positions, stopped at the convolution, gives the
   convolution inputs that the next runs (other ranks') need before them; one all-gather
   (:func:`ulysses.mixers.run_history`);
2. *summary* (more than one rank): per chunk, the forward stopped after the scan, which runs
   from a zero state with the extra channels that give the chunk's transition (``phi``) and
   final state; composed per run, exchanged between the ranks
   (:class:`ulysses.state_passing.Shared`), they give each run its incoming state;
3. *output*: per chunk, the whole forward, its scan from the state the chunk before it leaves
   (the scan's own initial state), its convolution after the chunk before it.

Packed documents restart both, inside chunks and on their boundaries, as everywhere.

The passes read the piece through :class:`_Piece` views, whose backwards add their
gradients into one buffer of the piece's shape (:class:`_Entry`): a plain slice's backward
makes a zero tensor of the whole piece for each chunk (two per chunk and pass at once, as they
are summed, and a fill of the whole piece per chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from arctic.hf.mixer_state import piece_states
from ulysses import trace_shortcuts
from ulysses.mesh import flat_mesh
from ulysses.mixers import Documents, conv_documents, row_runs, run_ends, run_history
from ulysses.sharding import sp_rank_of
from ulysses.state_passing import (Gathered, Shared, Tied, document_runs, incoming_states,
                                   summary_readers)

TAIL = 64
"""Positions of a run's end that the tail pass runs (at least the convolution's history)."""


@dataclass(slots=True)
class Chunk:
    """One chunk's pass: what the mixer's convolution and scan read (``mode``, the chunk's
    first global position ``lo``, the convolution input before it ``[B, C, h]``, the scan's
    incoming state) and what they leave (their input, the width, the summary or the final
    state, the state's shapes)."""

    mode: str
    lo: int
    history: Tensor | None = None
    state: Tensor | None = None
    conv_in: Tensor | None = None
    width: int = 1
    summary: Tensor | None = None
    final: Tensor | None = None
    shapes: tuple | None = None


class Stop(Exception):
    """Ends a forward where its pass has what it needs (tail: the convolution's input;
    summary: the scan's)."""


class _Grads:
    """The gradient of the chunked piece, written chunk by chunk."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer: Tensor | None = None


class _Entry(torch.autograd.Function):
    """``hidden`` itself, as the passes' :class:`_Piece` views read it; its backward (after
    theirs: they use its output) returns what they wrote, plus any other use's gradient."""

    @staticmethod
    def forward(ctx, hidden, grads):
        ctx.set_materialize_grads(False)
        ctx.grads = grads
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        buffer, ctx.grads.buffer = ctx.grads.buffer, None
        if grad is not None:
            buffer = grad if buffer is None else buffer.add_(grad)
        return buffer, None


class _Piece(torch.autograd.Function):
    """``x[:, a:b]``; its backward adds the gradient into ``grads``' buffer and returns none
    for ``x`` (:class:`_Entry` returns the buffer)."""

    @staticmethod
    def forward(ctx, x, a, b, grads):
        ctx.set_materialize_grads(False)
        ctx.a, ctx.b, ctx.grads, ctx.shape = a, b, grads, x.shape
        return x[:, a:b]

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            grads = ctx.grads
            if grads.buffer is None:
                grads.buffer = grad.new_zeros(ctx.shape)
            grads.buffer[:, ctx.a:ctx.b] += grad
        return None, None, None, None


class _StandIn(torch.autograd.Function):
    """A chunk that a memory trace leaves out (:func:`ulysses.trace_shortcuts.kept_growing`):
    results shaped as the chunk's before it (:func:`ulysses.trace_shortcuts.stand_in`), with
    a gradient where those have one; its inputs saved for its backward (as a checkpoint's
    recompute holds them), which gives them gradients of their shapes."""

    @staticmethod
    def forward(ctx, like, *inputs):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        out = tuple(trace_shortcuts.stand_in(t) for t in like)
        ctx.mark_non_differentiable(*(o for o, t in zip(out, like)
                                      if t is not None and not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(trace_shortcuts.stand_in(x) if need else None
                        for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])))


def _pieces(hidden: Tensor) -> Callable[[int, int], Tensor]:
    """``(a, b) -> hidden[:, a:b]``, through :class:`_Piece` where a gradient will flow."""
    if not (hidden.requires_grad and torch.is_grad_enabled()):
        return lambda a, b: hidden[:, a:b]
    grads = _Grads()
    x = _Entry.apply(hidden, grads)
    return lambda a, b: _Piece.apply(x, a, b, grads)


def chunk_conv(chunk: Chunk, conv: Callable[[Tensor], Tensor], x: Tensor, width: int,
               documents: Documents) -> Tensor:
    """The mixer's causal convolution on one chunk ``x`` ``[B, C, n]``, after
    ``chunk.history``."""
    chunk.conv_in, chunk.width = x, width
    if chunk.mode == "tail":
        raise Stop
    h = width - 1
    history = chunk.history if chunk.history is not None else x.new_zeros(*x.shape[:-1], h)
    return conv_documents(conv, torch.cat([history[..., history.shape[-1] - h:], x], dim=-1),
                          h, chunk.lo, documents)


def chunk_scan(chunk: Chunk, kind, original: Callable, inputs, params, options,
               documents: Documents):
    """The mixer's scan on one chunk: its summary (and :class:`Stop`), or its output from
    ``chunk.state`` (None: zeros) with its final state in ``chunk.final``."""
    states, finish = piece_states(kind, original, inputs, params, options)
    chunk.shapes = (states.phi_shape, states.state_shape)
    value = inputs[kind.output]
    B, n = value.shape[0], value.shape[-1 if kind.channels_first else 1]
    lo, P = chunk.lo, math.prod(states.phi_shape)
    groups = [(slice(0, B), (0,))] if documents is None else \
        [(slice(b, b + 1), tuple(documents[b])) for b in range(B)]
    if chunk.mode == "summary":
        summary = value.new_zeros(B, P + math.prod(states.state_shape), dtype=torch.float32)
        for rows, starts in groups:
            runs = document_runs(starts, lo, lo + n)
            a, e, start = runs[-1]
            p = states.piece(rows, slice(a - lo, e - lo), len(runs) == 1 and start < lo)
            if p.phi is not None:
                summary[rows, :P] = p.phi.float().flatten(1)
            summary[rows, P:] = p.final.float().flatten(1)
        chunk.summary = summary
        raise Stop
    final = value.new_zeros(B, *states.state_shape, dtype=torch.float32)
    outs = []
    for rows, starts in groups:
        runs, parts, spans = document_runs(starts, lo, lo + n), [], []
        for i, (a, e, start) in enumerate(runs):
            at = slice(a - lo, e - lo)
            if start < lo and chunk.state is not None:
                o, f = states.from_state(rows, at, chunk.state[rows])
            elif i == 0 or i == len(runs) - 1:
                p = states.piece(rows, at, False)
                o, f = p.out, p.final
            else:  # a document alone inside the chunk: its output
                spans.append((rows.start, a - lo, e - lo))
                parts.append(len(spans) - 1)
                continue
            parts.append(o)
            if i == len(runs) - 1:
                final[rows] = f.float()
        alone = states.outputs(spans) if spans else []
        outs.append(torch.cat([alone[x] if isinstance(x, int) else x for x in parts], dim=1))
    chunk.final = final
    out = finish(torch.cat(outs, dim=0))
    return (out, None) if kind.returns_state else out


def chunked_forward(run: Callable[[Tensor, Chunk], Tensor], hidden: Tensor, *, kind,
                    mesh: DeviceMesh, documents: Documents, size: int) -> Tensor:
    """The mixer's forward on this rank's piece ``hidden`` ``[B, s, E]`` in chunks of at most
    ``size`` positions; ``run(x, chunk)``: the model's forward on ``x`` in ``chunk``'s pass."""
    B, s = hidden.shape[:2]
    rows = row_runs(mesh, s, B, documents)
    if any(r != rows[0] for r in rows[1:]):
        raise ValueError("mixer_chunk on a ring cut document by document needs one row per "
                         "rank (each row's documents cut it otherwise); use a batch of one "
                         "row, or ring_layout='zigzag'")
    runs, rank, group = rows[0], sp_rank_of(mesh), flat_mesh(mesh, "sp").get_group()
    piece = _pieces(hidden)
    world, mine = len(runs), runs[rank]
    offsets = [sum(n for _, n in mine[:j]) for j in range(len(mine))]

    tails, h = [], 0
    widths = []

    def tail_of(x, lo):
        chunk = Chunk("tail", lo)
        try:
            run(x, chunk)
        except Stop:
            pass
        widths[:] = [chunk.width]
        return chunk.conv_in[..., max(0, x.shape[1] - (chunk.width - 1)):].clone()

    for (g, n), off in zip(mine, offsets):
        k = min(n, TAIL)
        t = checkpoint(tail_of, piece(off + n - k, off + n), g + n - k, use_reentrant=False)
        h = widths[0] - 1
        if h > TAIL:
            raise ValueError(f"{kind.conv}'s window ({widths[0]}) is wider than {TAIL} "
                             f"positions, which mixer_chunk carries")
        tails.append(t)
    width = max(len(own) for own in runs)
    tail = tails[0].new_zeros(width, *tails[0].shape[:-1], h)
    for j, t in enumerate(tails):
        tail[j, ..., h - t.shape[-1]:] = t
    every_tail = Gathered.apply(tail, group, rank, world)
    ending = run_ends(runs)
    cuts = [[(off + a, off + min(a + size, n), g + a) for a in range(0, n, size)]
            for (g, n), off in zip(mine, offsets)]

    def after(history: Tensor, conv_in: Tensor) -> Tensor:
        """The window after a chunk, a tensor of its own (a view would keep the chunk's whole
        convolution input alive, which each next chunk saves)."""
        if conv_in.shape[-1] >= h:
            return conv_in[..., conv_in.shape[-1] - h:].clone()
        return torch.cat([history, conv_in], dim=-1)[..., -h:].clone()

    shapes: list = []

    def summary_of(x, history, lo):
        chunk = Chunk("summary", lo, history)
        try:
            run(x, chunk)
        except Stop:
            pass
        shapes[:] = [chunk.shapes]
        return chunk.summary, after(history, chunk.conv_in)

    def output_of(x, history, state, lo):
        chunk = Chunk("output", lo, history, state)
        out = run(x, chunk)
        return out, chunk.final, after(history, chunk.conv_in)

    def passes(j: int):
        """``(a, b, lo, computed)`` of run ``j``'s chunks; ``computed`` False: stand in for it
        (:class:`_StandIn`; a memory trace, no packed documents)."""
        sizes = [b - a for a, b, _ in cuts[j]]
        kept = (trace_shortcuts.kept_growing(sizes, hidden) if documents is None
                else [True] * len(sizes))
        return [(a, b, lo, c) for (a, b, lo), c in zip(cuts[j], kept)]

    incoming, exchanged = {}, None
    if kind.scan is not None and world > 1:
        carrier = None
        summary = None
        for j, (g, _) in enumerate(mine):
            history, phi, final = run_history(every_tail, ending, g, h), None, None
            for a, b, lo, computed in passes(j):
                if computed:
                    part, history = checkpoint(summary_of, piece(a, b), history, lo,
                                               use_reentrant=False)
                else:
                    part, history = _StandIn.apply((part, history), piece(a, b), history)
                phi_shape, state_shape = shapes[0]
                if carrier is None:
                    carrier = SimpleNamespace(phi_shape=phi_shape, state_shape=state_shape,
                                              carry=(lambda p, x: p * x) if kind.diagonal
                                              else (lambda p, x: p @ x))
                    summary = part.new_zeros(B, width, part.shape[-1])
                P = math.prod(phi_shape)
                p_c = part[:, :P].reshape(B, *phi_shape)
                f_c = part[:, P:].reshape(B, *state_shape)
                final = f_c if final is None else carrier.carry(p_c, final) + f_c
                phi = p_c if phi is None else carrier.carry(p_c, phi)
            summary[:, j] = torch.cat([phi.flatten(1), final.flatten(1)], dim=1)
        exchanged = Shared.apply(summary, group, rank, summary_readers([runs], world))
        incoming = incoming_states(carrier, exchanged, runs, rank,
                                   math.prod(carrier.phi_shape))

    outs = []
    for j, (g, _) in enumerate(mine):
        history, state = run_history(every_tail, ending, g, h), incoming.get(j)
        for a, b, lo, computed in passes(j):
            if computed:
                out, state, history = checkpoint(output_of, piece(a, b), history, state, lo,
                                                 use_reentrant=False)
            else:
                out, state, history = _StandIn.apply((out, state, history), piece(a, b),
                                                     history, state)
            outs.append(out)
    out = Tied.apply(torch.cat(outs, dim=1), every_tail)
    return out if exchanged is None else Tied.apply(out, exchanged)


__all__ = ["TAIL", "Chunk", "Stop", "chunk_conv", "chunk_scan", "chunked_forward"]
