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

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

MODES = ("auto", "all_to_all", "state_passing")
"""How a hybrid's linear mixers run their scans under SP (``mixer_parallelism``): an
all-to-all over heads, their state passed between the ranks' pieces (here), or (auto) the
all-to-all where the heads split over the degree, else state passing."""

Documents = Sequence[Sequence[int]] | None
Scan = Callable[[slice, slice, Tensor | None, Tensor | None], tuple[Tensor, Tensor]]
"""``scan(rows, positions, values, initial)``: the scan of this rank's ``rows`` over its
piece's ``positions`` (local), with ``values`` ``[b, n, H, V']`` in place of the value input
(None: the input itself) from ``initial`` (``[b, H, K, V']``, None: zeros); returns the output
``[b, n, H, V']`` and the final state ``[b, H, K, V']``."""


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
    cuts = sorted({lo, hi, *(d for d in starts if lo < d < hi)})
    return [(a, b, max(d for d in starts if d <= a)) for a, b in zip(cuts, cuts[1:])]


def _augmented(scan: Scan, rows: slice, positions: slice, value: Tensor
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(o_0, c, S_0, Phi)`` of one run from a zero state, by one scan with ``K`` more value
    channels started at the identity."""
    b, n, H, V = value.shape
    K = scan.key_dim
    extra = value.new_zeros(b, n, H, K)
    initial = value.new_zeros(b, H, K, V + K, dtype=torch.float32)
    initial[..., V:] = torch.eye(K, dtype=torch.float32, device=value.device)
    out, final = scan(rows, positions, torch.cat([value, extra], dim=-1), initial)
    return out[..., :V], out[..., V:], final[..., :V], final[..., V:]


Runs = Sequence[Sequence[tuple[int, int]]]
"""Per SP rank, the ``(first position, length)`` runs of the sequence it holds, in the order
of its piece (one run without a ring; a zigzag ring's two chunks)."""


def _preceding(runs: Runs, rank: int) -> list[list[tuple[int, int]]]:
    """For each of ``rank``'s runs, the runs of every rank before it in sequence order, as
    ``(rank, index)``, first to last."""
    order = sorted((g, r, j) for r, own in enumerate(runs) for j, (g, _) in enumerate(own))
    return [[(r, j) for g2, r, j in order if g2 < g] for g, _ in runs[rank]]


def state_scan(scan: Scan, value: Tensor, *, group, rank: int, world: int, runs: Runs,
               documents: Documents = None) -> Tensor:
    """The scan of the whole sequence at this rank's positions; ``value`` ``[B, s, H, V]``
    is this rank's piece of the value input, laid out as ``runs[rank]`` says. ``scan``
    (:data:`Scan`, with ``scan.key_dim`` = ``K``) runs this rank's piece."""
    B, s, H, V = value.shape
    K = scan.key_dim
    mine, width = runs[rank], max(len(own) for own in runs)
    groups = [(slice(0, B), (0,))] if documents is None else \
        [(slice(b, b + 1), tuple(documents[b])) for b in range(B)]
    summary = value.new_zeros(B, width, H, K, K + V, dtype=torch.float32)
    pieces = [[] for _ in groups]  # per row group: (output, c or None, run index)
    for i, (rows, starts) in enumerate(groups):
        offset = 0
        for j, (g, n) in enumerate(mine):
            phi = final = None
            for a, e, start in document_runs(starts, g, g + n):
                positions = slice(offset + a - g, offset + e - g)
                if start < g:  # its document started before this run: the state continues
                    o, c, final, phi = _augmented(scan, rows, positions, value[rows, positions])
                else:
                    o, final = scan(rows, positions, None, None)
                    c, phi = None, None  # a document starts here: nothing before passes on
                pieces[i].append((o, c, j))
            if phi is not None:
                summary[rows, j, ..., :K] = phi
            summary[rows, j, ..., K:] = final.float()
            offset += n
    every = Gathered.apply(summary, group, rank, world)  # [W, B, width, H, K, K + V]
    incoming = []
    for before in _preceding(runs, rank):  # in sequence order
        state = summary.new_zeros(B, H, K, V)
        for r, j in before:
            state = every[r, :, j, ..., :K] @ state + every[r, :, j, ..., K:]
        incoming.append(state)
    rows_out = []
    for i, (rows, _) in enumerate(groups):
        fixed = [o if c is None else
                 o + torch.einsum("bshk,bhkv->bshv", c.float(), incoming[j][rows]).to(o.dtype)
                 for o, c, j in pieces[i]]
        rows_out.append(torch.cat(fixed, dim=1))
    return Tied.apply(torch.cat(rows_out, dim=0), every)


__all__ = ["MODES", "Gathered", "Runs", "Scan", "Tied", "document_runs", "state_scan"]
