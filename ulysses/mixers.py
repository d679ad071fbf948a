"""Sequence parallelism for token mixers other than attention: causal convolutions along the
sequence, and scans that run head by head (gated delta nets, Kimi's delta attention).

Both keep the model's own kernels: they are given the function the model would call (the
torch fallback, or flash-linear-attention's and causal-conv1d's kernels where installed) and
call it on what the whole sequence needs, so the result is the whole sequence's, exactly.

- :func:`causal_conv`: a depthwise causal convolution of width ``w`` needs, for this rank's
  first positions, the previous rank's last ``w - 1``. One all-gather of those tails (``[B, C,
  w - 1]`` from every rank) brings them, and its backward returns their gradients: the
  convolution runs on this rank's piece, sequence-sharded, with no all-to-all.
- :func:`head_scan`: a recurrence along the whole sequence, independent across heads, runs
  as Ulysses runs attention. An all-to-all makes every input head-sharded over the whole
  sequence; the scan runs on this rank's heads; an all-to-all brings its output back to this
  rank's piece. Inputs of the *grouped* heads (the keys and queries that several value heads
  share, as GQA's kv heads) follow their value heads by :func:`ulysses.sharding.head_layout`:
  split when there are at least as many as ranks, replicated otherwise.

Packed documents (``documents``: per row, the first position of each document over the whole
sequence, as the attention takes them) restart both: the convolution's window and the scan's
state never cross a document start. The convolution follows any layout of the mesh (each
rank's runs: contiguous, zigzag, or per document on a ring); :func:`head_scan` needs
contiguous pieces, rank ``r`` holding positions ``[r * s, (r + 1) * s)`` (no ring: on a ring
the scan passes its state, :mod:`ulysses.state_passing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.all_to_all import all_to_all
from ulysses.mesh import axis_rank, axis_size, flat_mesh, mesh_dims
from ulysses.packing import batched
from ulysses.sharding import head_layout, seq_split, sp_rank_of, valid_degrees
from ulysses.state_passing import Gathered, Tied, document_runs

Documents = Sequence[Sequence[int]] | None


def check_mixer_heads(what: str, num_heads: int, num_grouped: int, degree: int) -> None:
    """``ValueError`` naming the valid degrees when ``num_heads`` value heads and
    ``num_grouped`` key heads cannot be laid out over ``degree`` ranks."""
    if degree not in valid_degrees(num_heads, num_grouped):
        raise ValueError(f"{what} has {num_heads} value heads and {num_grouped} key heads, "
                         f"which cannot be split over ulysses_degree={degree}; valid degrees: "
                         f"{valid_degrees(num_heads, num_grouped)}")


def causal_conv(conv: Callable[[Tensor], Tensor], x_BCs: Tensor, width: int, *,
                mesh: DeviceMesh, documents: Documents = None) -> Tensor:
    """``conv`` (a causal convolution of width ``width`` along the last dim, ``[B, C, L]`` ->
    ``[B, C, L]``, zero history) of the whole sequence, at this rank's positions: ``x_BCs`` is
    this rank's piece. ``documents``: per row, where each document starts (whole sequence);
    None: one document per row."""
    h = width - 1
    if mesh_dims(mesh).sp == 1 or h == 0:
        return conv_documents(conv, x_BCs, 0, 0, documents)
    return _conv_over_runs(conv, x_BCs, h, mesh=mesh, documents=documents)


def sp_runs(mesh: DeviceMesh, piece: int,
            documents: Sequence[int] | None = None) -> list[list[tuple[int, int]]]:
    """Per SP rank (the flat ring x Ulysses group), the runs of the sequence it holds in the
    mesh's layout (zigzag, contiguous, or per document given one row's ``documents``;
    :meth:`ulysses.sharding._SeqSplit.runs`)."""
    split = seq_split(mesh)
    row = None if documents is None else tuple(documents)
    return [split.runs(piece * split.sp, r, row) for r in range(split.sp)]


def row_runs(mesh: DeviceMesh, piece: int, batch: int,
             documents: Documents) -> list[list[list[tuple[int, int]]]]:
    """:func:`sp_runs` per row: each row's own on a ring cut document by document, else the
    same for every row."""
    if documents is None or not mesh_dims(mesh).per_document_ring:
        return [sp_runs(mesh, piece)] * batch
    return [sp_runs(mesh, piece, row) for row in documents]


def _conv_over_runs(conv, x_BCs: Tensor, h: int, *, mesh: DeviceMesh,
                    documents: Documents) -> Tensor:
    """:func:`causal_conv` over several ranks: each run of this rank's piece (one without a
    ring; a zigzag rank holds two, a per-document ring two per document) gets the ``h``
    positions before it in the sequence, from the runs that end there, whichever ranks hold
    them (one all-gather of every run's last ``h`` positions; its backward returns each
    tail's gradient to its rank)."""
    B = x_BCs.shape[0]
    runs = row_runs(mesh, x_BCs.shape[-1], B, documents)
    rank, world = sp_rank_of(mesh), len(runs[0])
    groups = [(slice(0, B), runs[0], documents)] if runs[1:] == runs[:-1] else \
        [(slice(b, b + 1), runs[b], documents[b:b + 1]) for b in range(B)]
    width = max(len(own) for _, row, _ in groups for own in row)
    tails = x_BCs.new_zeros(width, *x_BCs.shape[:-1], h)
    for rows, row, _ in groups:
        off = 0
        for j, (g, n) in enumerate(row[rank]):
            k = min(h, n)
            tails[j, rows, :, h - k:] = x_BCs[rows, :, off + n - k:off + n]
            off += n
    every = Gathered.apply(tails, flat_mesh(mesh, "sp").get_group(), rank, world)
    outs = []
    for rows, row, docs in groups:
        off, pieces, ending = 0, [], run_ends(row)
        for g, n in row[rank]:
            ext = torch.cat([run_history(every[:, :, rows], ending, g, h),
                             x_BCs[rows, :, off:off + n]], dim=-1)
            pieces.append(conv_documents(conv, ext, h, g, docs))
            off += n
        outs.append(torch.cat(pieces, dim=-1))
    return Tied.apply(torch.cat(outs, dim=0), every)


def run_ends(runs) -> dict[int, tuple[int, int, int]]:
    """The ranks' ``runs`` by the position where each ends: ``(rank, index, length)``."""
    return {a + n: (r, j, n) for r, own in enumerate(runs) for j, (a, n) in enumerate(own)}


def run_history(every: Tensor, ending, g: int, h: int) -> Tensor:
    """The ``h`` positions before global position ``g`` (``[b, C, h]``, zeros before the
    sequence starts), from ``every`` (``[W, width, b, C, h]``: each rank's runs' last ``h``
    positions, right-aligned) and ``ending`` (:func:`run_ends`): the runs that end there,
    back to back, as many as ``h`` spans."""
    history, pos, have = [], g, 0
    while pos > 0 and have < h:
        r, j, m = ending[pos]
        k = min(m, h - have)
        history.insert(0, every[r, j][..., h - k:])
        pos, have = pos - m, have + k
    first = every[0, 0]
    return torch.cat([first.new_zeros(*first.shape[:-1], h - have), *history], dim=-1)


def conv_documents(conv, ext: Tensor, h: int, lo: int, documents: Documents) -> Tensor:
    """``conv`` on ``ext`` (``h`` positions of history, then the piece starting at global
    position ``lo``), each document on its own; the piece's outputs."""
    s = ext.shape[-1] - h
    if documents is None:
        return conv(ext)[..., h:]
    spans, backs = [], []
    for b, starts in enumerate(documents):
        for a, e, start in document_runs(starts, lo, lo + s):
            backs.append(min(h, a - start))  # history of the same document
            spans.append((b, h + a - lo - backs[-1], h + e - lo))
    outs = batched(lambda x: conv(x), {"x": ext}, spans, dim=-1)
    return torch.cat([torch.cat([o[..., back:] for (row, _, _), o, back in
                                 zip(spans, outs, backs) if row == b], dim=-1)
                      for b in range(len(documents))], dim=0)


def head_scan(scan: Callable[..., Tensor], grouped: Mapping[str, Tensor],
              per_head: Mapping[str, Tensor], *, mesh: DeviceMesh,
              documents: Documents = None,
              head_params: Mapping[str, Tensor] | None = None) -> Tensor:
    """``scan(heads=..., **grouped, **per_head)`` over the whole sequence, head-sharded;
    returns this rank's piece of its output ``[B, s, H, ...]``.

    ``per_head``: ``[B, s, H, ...]`` tensors of the ``H`` (value) heads, this rank's piece;
    ``grouped``: ``[B, s, K, ...]`` tensors of the ``K`` key heads, each shared by ``H / K``
    consecutive value heads; ``head_params``: ``[H, ...]`` tensors (per-head parameters),
    passed to ``scan`` as ``heads`` sliced to this rank's heads (their gradients reach only
    those rows; the ranks' gradients add up to the whole). ``scan`` takes them
    whole-sequence, this rank's heads, and returns ``[B, S, h, ...]``; packed documents go to
    it as rows, a few calls for all (:func:`ulysses.packing.batched`)."""
    group = mesh["ulysses"].get_group()
    world = axis_size(mesh, "ulysses")
    H = next(iter(per_head.values())).shape[2]
    K = next(iter(grouped.values())).shape[2] if grouped else H
    layout = head_layout(H, K, world)
    if layout.replicated:
        index = torch.tensor(layout.kv_index(), device=next(iter(per_head.values())).device)
        grouped = {n: t.index_select(2, index) for n, t in grouped.items()}
    inputs = {n: all_to_all(t, group, scatter_dim=2, gather_dim=1,
                            scatter_sizes=layout.kv_sizes) for n, t in grouped.items()}
    inputs.update({n: all_to_all(t, group, scatter_dim=2, gather_dim=1,
                                 scatter_sizes=layout.q_sizes) for n, t in per_head.items()})
    rank = axis_rank(mesh, "ulysses")
    first = sum(layout.q_sizes[:rank])
    heads = {n: t[first:first + layout.q_sizes[rank]] for n, t in (head_params or {}).items()}
    if documents is None:
        out = scan(heads=heads, **inputs)
    else:
        S = next(iter(inputs.values())).shape[1]
        spans = [(b, x, y) for b, starts in enumerate(documents)
                 for x, y in zip(starts, [*starts[1:], S])]
        outs = batched(lambda **t: scan(heads=heads, **t), inputs, spans)
        out = torch.cat([torch.cat([o for (row, _, _), o in zip(spans, outs) if row == b], dim=1)
                         for b in range(len(documents))], dim=0)
    return all_to_all(out, group, scatter_dim=1, gather_dim=2, gather_sizes=layout.q_sizes)


KERNEL_CHUNK = 64
"""The chunk length of the chunked scan kernels (flash-linear-attention's gated delta rule
and KDA, mamba_ssm's SSD scan): :func:`traced_scan` holds one state per chunk."""


class _TracedScan(torch.autograd.Function):
    """What a chunked scan kernel allocates, on the planner's fake tensors (shapes only)."""

    @staticmethod
    def forward(ctx, shapes, *inputs):
        out_shape, out_dtype, states_shape, block_shape, final_shape = shapes
        first = inputs[0]
        states = first.new_empty(states_shape, dtype=torch.float32)  # per chunk, transient
        block = first.new_empty(block_shape, dtype=torch.float32)    # kept for backward
        out = first.new_empty(out_shape, dtype=out_dtype)
        del states
        ctx.save_for_backward(*inputs, block)
        ctx.states_shape = states_shape
        ctx.set_materialize_grads(False)
        if final_shape is None:
            return out
        return out, first.new_empty(final_shape, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad, *_):
        *inputs, _ = ctx.saved_tensors
        states = inputs[0].new_empty(ctx.states_shape, dtype=torch.float32)
        grads = tuple(t.new_empty(t.shape) if need else None
                      for t, need in zip(inputs, ctx.needs_input_grad[1:]))
        del states
        return (None, *grads)


def traced_scan(inputs: Mapping[str, Tensor], *, out: str, key: str, heads: int,
                out_dtype: torch.dtype | None = None, initial: Tensor | None = None,
                final: tuple[int, ...] | None = None):
    """A chunked scan's allocations in the memory planner's trace, in place of the scan.

    The planner (:mod:`arctic.plan`) traces a step on fake tensors. The model's torch
    fallback for a chunked scan loops over every chunk in Python (slow to trace at long
    lengths) and holds blocks a GPU kernel never does, so the trace models the kernel that
    runs on a GPU (flash-linear-attention's chunked gated delta rule and KDA, mamba_ssm's SSD
    and selective scans): its inputs and one ``[B, S, h, 64]`` float32 block matrix kept for
    the backward, the output (shaped like ``inputs[out]``, last dim included), and one float32
    state ``[dk, dv]`` per chunk and head, transient, in the forward and again in the
    backward, which gives every input a gradient. ``inputs``: ``[B, S, h|k, X]`` (the layout
    of :func:`head_scan`); ``key``: the input whose last dim is the state's ``dk``; ``heads``:
    ``h``. ``initial``: the state the scan starts from (an input too, which the output depends
    on); ``final``: the shape of the float32 final state to return beside the output, which
    depends on the inputs (a real scan's does: state passing's summaries and carried states
    take gradients through it).
    """
    like = inputs[out]
    B, S = like.shape[:2]
    dk, dv = inputs[key].shape[-1], like.shape[-1]
    shapes = (tuple(like.shape), out_dtype or like.dtype,
              (B, -(-S // KERNEL_CHUNK), heads, dk, dv), (B, S, heads, KERNEL_CHUNK), final)
    given = [*inputs.values(), *([] if initial is None else [initial])]
    return _TracedScan.apply(shapes, *given)


__all__ = ["KERNEL_CHUNK", "causal_conv", "check_mixer_heads", "conv_documents", "head_scan",
           "row_runs", "run_ends", "run_history", "sp_runs", "traced_scan"]
