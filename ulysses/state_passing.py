"""Linear recurrences along a sequence-sharded sequence, by passing their state between ranks
(LASP-2's all-gather of per-rank summaries), not by an all-to-all over heads.

A gated delta net, Kimi's delta attention and Mamba2's SSD keep, per head and per value
channel ``j``, a state vector ``s_j`` of ``K`` entries that evolves linearly:
``s_j(t) = T(t) s_j(t-1) + b(t) v_j(t)``, read out as ``o_j(t) = q(t) . s_j(t)`` (plus terms
in ``v_j(t)`` alone). The value channels never mix. A rank that scans its own piece from a
zero state is therefore off, at every position, by a term linear in the state ``S_in`` that
the earlier pieces leave (``K x V`` per head):

    o(t) = o_0(t) + c(t) S_in        S_out = Phi S_in + S_0

The model's own scan gives all four at once: ``K`` more value channels, zero, whose initial
state is the identity, come out as ``c(t)`` (their outputs) and ``Phi`` (their final state);
the first ``V`` channels are ``o_0`` and ``S_0``. One all-gather of every rank's ``(Phi,
S_0)``, a few ``K x K`` products in sequence order, and ``S_in`` is known on every rank. The
bytes sent are ``K x (K + V)`` per head and rank, whatever the sequence length; gradients
reach the earlier ranks' pieces through the gather's backward.

Packed documents (per row, the first position of each document over the whole sequence)
restart the state: the positions before this piece's first document start continue the
incoming state, the others do not, and a piece in which a document starts passes on only
what follows that start (``Phi = 0``).

Scans here take and return states ``[B, H, K, V]`` (the delta rules' layout; Mamba2's ``[B,
H, P, N]`` is its transpose, which the caller converts).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses.packing import Span

MODES = ("auto", "all_to_all", "state_passing")
"""How a hybrid's linear mixers run their scans under SP (``mixer_parallelism``): an
all-to-all over heads, their state passed between the ranks' pieces (here), or (auto) the
all-to-all where the heads split over the degree and there is no ring, else state passing
(also where flash-linear-attention's own context parallelism runs the scan:
:mod:`arctic.hf.mixer_fla`)."""

Documents = Sequence[Sequence[int]] | None
class Scan(Protocol):
    """The model's scan on this rank's piece. ``scan(rows, positions, values, initial)``: over
    the local ``positions`` of ``rows``, with ``values`` ``[b, n, H, V']`` in place of the
    value input (None: the input itself) from ``initial`` (``[b, H, K, V']``, None: zeros);
    returns the output ``[b, n, H, V']`` and the final state ``[b, H, K, V']``.
    ``scan.outputs(spans)``: the outputs alone of :data:`ulysses.packing.Span` s each from a
    zero state, in a few calls (:func:`ulysses.packing.batched`). ``scan.key_dim``: ``K``."""

    key_dim: int

    def __call__(self, rows: slice, positions: slice, values: Tensor | None,
                 initial: Tensor | None) -> tuple[Tensor, Tensor]: ...

    def outputs(self, spans: Sequence[Span]) -> list[Tensor]: ...


class Gathered(torch.autograd.Function):
    """Every rank's ``x``, stacked in rank order; the backward sends each rank the gradients
    of its ``x`` (an all-to-all: gloo has no reduce-scatter; an all-reduce would send every
    rank's) and sums them."""

    @staticmethod
    def forward(ctx, x, group, rank, world):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group = group
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty_like(grad)
        dist.all_to_all_single(mine, grad.contiguous(), group=ctx.group)
        return mine.sum(0), None, None, None


class Shared(torch.autograd.Function):
    """Every rank's ``x``, stacked in rank order, each sent only where it is used:
    ``needs[r][q]``, rank ``q`` reads rank ``r``'s (the rows of the others are zeros). One
    all-to-all with uneven splits; its backward returns each rank the gradients of its ``x``
    from the ranks that read it, and sums them. A rank sends at most ``W - 1`` copies, and
    the ranks that send many in the forward (the first in the sequence) send few back."""

    @staticmethod
    def forward(ctx, x, group, rank, needs):
        world, flat = len(needs), x.contiguous().reshape(-1)
        sends = [needs[rank][q] and q != rank for q in range(world)]
        takes = [needs[r][rank] and r != rank for r in range(world)]
        got = _exchange(flat.repeat(sum(sends)), sends, takes, group, flat.numel())
        out = x.new_zeros(world, *x.shape)
        for r, part in got.items():
            out[r] = part.view_as(x)
        out[rank] = x
        ctx.group, ctx.rank, ctx.sends, ctx.takes = group, rank, sends, takes
        return out

    @staticmethod
    def backward(ctx, grad):
        own = grad[ctx.rank].contiguous()
        flat = torch.cat([grad[r].reshape(-1) for r in range(len(ctx.takes)) if ctx.takes[r]]
                         or [own.new_zeros(0)])
        parts = _exchange(flat, ctx.takes, ctx.sends, ctx.group, own.numel())
        return own + sum(p.view_as(own) for p in parts.values()), None, None, None


def _exchange(parts: Tensor, sends: Sequence[bool], takes: Sequence[bool], group,
              numel: int) -> dict[int, Tensor]:
    """An all-to-all of ``numel`` elements per pair: ``parts`` (one part per rank in
    ``sends``, in rank order) to those ranks; returns the parts of the ranks in ``takes``."""
    out = parts.new_empty(numel * sum(takes))
    dist.all_to_all_single(out, parts, output_split_sizes=[numel * t for t in takes],
                           input_split_sizes=[numel * s for s in sends], group=group)
    pieces = iter(out.split(numel)) if numel else iter([])
    return {r: next(pieces) for r, t in enumerate(takes) if t}


class Tied(torch.autograd.Function):
    """``out`` itself, made to depend on ``gathered``: every rank's backward then reaches the
    gather's (whose all-to-all each rank must join), also on a rank that uses no earlier
    state (the first; one whose piece starts a document)."""

    @staticmethod
    def forward(ctx, out, gathered):
        ctx.shape = gathered.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.shape)


def document_runs(starts: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(start, end, document start)`` of the positions ``[lo, hi)`` cut at the document
    starts ``starts`` (the first is 0)."""
    order = sorted(starts)
    i, j = bisect.bisect_right(order, lo), bisect.bisect_left(order, hi)
    cuts = [lo, *order[i:j], hi]
    return [(a, b, order[bisect.bisect_right(order, a) - 1]) for a, b in zip(cuts, cuts[1:])]


class Piece(NamedTuple):
    """One run of a piece scanned from a zero state: its ``out``put, ``fix`` (the term the
    incoming state adds to it, a function of that state ``[b, *state_shape]``; None where a
    document starts the run: nothing before passes on), its ``final`` state, and ``phi``
    (the map from the incoming state to the final one, applied by the scan's ``carry``; None:
    zero)."""

    out: Tensor
    fix: Callable[[Tensor], Tensor] | None
    final: Tensor
    phi: Tensor | None


class MatrixStates:
    """The delta rules' and Mamba2's states, ``K x V`` per head, from a :data:`Scan` that takes
    an initial state: ``c(t)`` and ``Phi`` from ``K`` more value channels started at the
    identity, in the same call."""

    def __init__(self, scan: Scan, value: Tensor) -> None:
        self.scan, self.value = scan, value
        H, V, K = value.shape[2], value.shape[3], scan.key_dim
        self.state_shape, self.phi_shape = (H, K, V), (H, K, K)

    def piece(self, rows: slice, positions: slice, continues: bool) -> Piece:
        if not continues:
            out, final = self.scan(rows, positions, None, None)
            return Piece(out, None, final, None)
        value = self.value[rows, positions]
        b, n, H, V = value.shape
        K = self.scan.key_dim
        extra = value.new_zeros(b, n, H, K)
        initial = value.new_zeros(b, H, K, V + K, dtype=torch.float32)
        initial[..., V:] = torch.eye(K, dtype=torch.float32, device=value.device)
        out, final = self.scan(rows, positions, torch.cat([value, extra], dim=-1), initial)
        o, c = out[..., :V], out[..., V:]
        return Piece(o, lambda state: torch.einsum("bshk,bhkv->bshv", c.float(),
                                                   state).to(o.dtype),
                     final[..., :V], final[..., V:])

    def outputs(self, spans: Sequence[Span]) -> list[Tensor]:
        return self.scan.outputs(spans)

    def from_state(self, rows: slice, positions: slice, state: Tensor) -> tuple[Tensor, Tensor]:
        """The output and final state of a run that starts from ``state`` (the scan's own
        initial state: no extra channels)."""
        return self.scan(rows, positions, None, state)

    @staticmethod
    def carry(phi: Tensor, state: Tensor) -> Tensor:
        return phi @ state


class PieceStates(Protocol):
    """What :func:`state_scan` needs of a recurrence: per row, the shapes of its state and of
    its ``phi``, a run's :class:`Piece`, the outputs alone of whole documents inside the
    piece (``outputs(spans)``, ``[1, n, ...]`` each, in a few calls), a run's output and final
    state from a known incoming state (``from_state``: a chunk of a piece,
    :mod:`arctic.hf.mixer_chunks`), and ``carry(phi, state)``."""

    state_shape: tuple[int, ...]
    phi_shape: tuple[int, ...]

    def piece(self, rows: slice, positions: slice, continues: bool) -> Piece: ...

    def outputs(self, spans: Sequence[Span]) -> list[Tensor]: ...

    def from_state(self, rows: slice, positions: slice,
                   state: Tensor) -> tuple[Tensor, Tensor]: ...

    def carry(self, phi: Tensor, state: Tensor) -> Tensor: ...


Runs = Sequence[Sequence[tuple[int, int]]]
"""Per SP rank, the ``(first position, length)`` runs of the sequence it holds, in the order
of its piece (one run without a ring; a zigzag ring's two chunks; a per-document ring's two
per document)."""


def state_scan(states: PieceStates, batch: int, *, group, rank: int, world: int,
               runs: Sequence[Runs], documents: Documents = None) -> Tensor:
    """The scan of the whole sequence at this rank's positions, ``[B, s, ...]``: every run of
    this rank's piece (``runs[b][rank]``, per row ``b``; laid out in the piece in that order)
    scanned from a zero state by ``states``, corrected by the state that the runs before it
    in sequence order leave. One all-gather brings every rank's ``(phi, final)`` per run."""
    P, F = math.prod(states.phi_shape), math.prod(states.state_shape)
    groups = [(slice(0, batch), (0,), runs[0])] if documents is None else \
        [(slice(b, b + 1), tuple(documents[b]), runs[b]) for b in range(batch)]
    width = max(len(own) for _, _, row in groups for own in row)
    summary, spans = None, []
    pieces = [[] for _ in groups]  # per row group: (output or span index, fix or None, run)
    for i, (rows, starts, row) in enumerate(groups):
        offset = 0
        for j, (g, n) in enumerate(row[rank]):
            for a, e, start in document_runs(starts, g, g + n):
                if start >= g and e < g + n:  # a document alone, inside the run: its output
                    spans.append((rows.start, offset + a - g, offset + e - g))
                    pieces[i].append((len(spans) - 1, None, j))
                    continue
                p = states.piece(rows, slice(offset + a - g, offset + e - g), start < g)
                pieces[i].append((p.out, p.fix, j))
            if summary is None:
                summary = p.final.new_zeros(batch, width, P + F, dtype=torch.float32)
            if p.phi is not None:  # the last document run: the one that reaches the run's end
                summary[rows, j, :P] = p.phi.float().flatten(1)
            summary[rows, j, P:] = p.final.float().flatten(1)
            offset += n
    alone = states.outputs(spans) if spans else []
    every = Shared.apply(summary, group, rank,
                         summary_readers(runs, world))  # [W, B, width, P + F]
    outs = []
    for i, (rows, _, row) in enumerate(groups):
        incoming = incoming_states(states, every[:, rows], row, rank, P)
        outs.append(torch.cat([alone[o] if isinstance(o, int) else
                               o if fix is None else o + fix(incoming[j])
                               for o, fix, j in pieces[i]], dim=1))
    return Tied.apply(torch.cat(outs, dim=0), every)


def summary_readers(runs: Sequence[Runs], world: int) -> list[list[bool]]:
    """``[r][q]``: rank ``q`` reads rank ``r``'s summary (in some row, a run of ``r`` starts
    before ``q``'s last; :func:`incoming_states`)."""
    return [[any(min(g for g, _ in row[r]) < max(g for g, _ in row[q]) for row in runs)
             for q in range(world)] for r in range(world)]


def incoming_states(states: PieceStates, every: Tensor, runs: Runs, rank: int,
              P: int) -> dict[int, Tensor]:
    """Per run index of ``rank``, the state that the runs before it in sequence order leave:
    one pass over every rank's runs in that order (``every``: ``[W, b, width, P + F]``)."""
    b = every.shape[1]
    order = sorted((g, r, j) for r, own in enumerate(runs) for j, (g, _) in enumerate(own))
    last = max(g for g, _ in runs[rank])
    state, incoming = every.new_zeros(b, *states.state_shape), {}
    for g, r, j in order:
        if r == rank:
            incoming[j] = state
        if g >= last:
            break
        phi = every[r, :, j, :P].reshape(b, *states.phi_shape)
        state = states.carry(phi, state) + every[r, :, j, P:].reshape(b, *states.state_shape)
    return incoming


__all__ = ["MODES", "Gathered", "MatrixStates", "Piece", "PieceStates", "Runs", "Scan", "Shared",
           "Tied", "document_runs", "incoming_states", "state_scan", "summary_readers"]
