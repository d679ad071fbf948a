"""Ulysses attention: all-to-all to full-sequence/local-heads, attend, all-to-all back.

When the mesh has a ring (R > 1), "attend" is ring attention across the ring axis, which
makes this hybrid Ulysses x Ring (see :mod:`ulysses.hybrid`).

Shape legend: B batch, s this rank's sequence piece, S = U s the rows of this rank's ring
position (the full sequence when R = 1), H all query heads, K all kv heads, h / k this rank's
query / kv heads, D head dim, U / R the mesh's ``"ulysses"`` / ``"ring"`` axis sizes.
``q_BsHD`` is sharded on the sequence; ``q_BShD`` (after the all-to-all) on heads.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.all_to_all import all_to_all, check_comm_dtype
from ulysses.band import check_window
from ulysses.blocks import BlockAttention, check_blocks
from ulysses.buffer_pool import BufferPool
from ulysses.head_chunking import (DEFAULT_CHUNK_BUDGET_BYTES, head_chunked_attention,
                                   resolve_chunk_size)
from ulysses.hybrid import check_hybrid, inner_attention
from ulysses.kernels import (LocalAttention, attention_with_lse, check_qkv, common_head_dim,
                             default_scale, select_backend)
from ulysses.mesh import axis_group, axis_rank, axis_size, check_mesh, mesh_dims
from ulysses.segments import check_segments
from ulysses.self_check import verify, verify_call
from ulysses.seq_chunk import check_seq_chunk, resolve_seq_chunk
from ulysses.sharding import HeadLayout, head_layout
from ulysses.sinks import check_sinks
from ulysses.softcap import check_softcap


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                    softmax_scale: float | None = None, backend: str | None = None,
                    return_lse: bool = False, self_check: bool = True):
    """Single-rank attention with autograd, shaped like ``flash_attn_func``.

    Args:
        q: ``[B, S, H, D]``; k, v: ``[B, S, K, D]`` with ``H % K == 0``; v may have a head
            dim of its own (multi-head latent attention): the output then has it.
        causal: mask future keys.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        backend: a name from :data:`BACKENDS`, or ``None`` to choose by device and dtype.
        return_lse: also return ``lse_BHS`` (float32, not differentiable).
        self_check: check the kernel against the float64 reference at its first use with
            this device, dtype and mask (:mod:`ulysses.self_check`).

    Returns:
        ``out_BSHD``, or ``(out_BSHD, lse_BHS)`` when ``return_lse``.
    """
    check_qkv(q, k, v, causal=causal)
    scale = default_scale(q.shape[-1], softmax_scale)
    q, k, v, value_dim = common_head_dim(q, k, v)
    backend = select_backend(q.device, q.dtype, q.shape[-1], backend)
    if self_check:
        verify(backend, q, causal=causal)
    attn = LocalAttention(causal=causal, scale=scale, backend=backend)
    out, lse = attention_with_lse(q, k, v, attn)
    out = out[..., :value_dim]
    return (out, lse) if return_lse else out



def _validate(q: Tensor, k: Tensor, v: Tensor, mesh: DeviceMesh, causal: bool,
              backend: str | None, unpadded_len: int | None) -> tuple[HeadLayout, str]:
    """Every check ``ulysses_attention`` makes, before any collective runs."""
    check_mesh(mesh)
    check_qkv(q, k, v, causal=causal)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same sequence piece, got lengths {q.shape[1]} "
                         f"and {k.shape[1]}")
    degree = axis_size(mesh, "ulysses")
    full = q.shape[1] * degree * axis_size(mesh, "ring")
    if unpadded_len is not None and not 0 < unpadded_len <= full:
        raise ValueError(f"unpadded_len ({unpadded_len}) must be in [1, {full}] "
                         f"(the padded full sequence length)")
    check_hybrid(q.shape[1], mesh)
    layout = head_layout(q.shape[2], k.shape[2], degree)
    head_dim = max(q.shape[-1], v.shape[-1])  # the one the kernel runs (common_head_dim)
    return layout, select_backend(q.device, q.dtype, head_dim, backend)


def between_exchanges(mesh: DeviceMesh, *, batch: int, local_len: int, causal: bool,
                      scale: float, backend: str, unpadded_len: int | None, segments,
                      window: int | None = None,
                      comm_dtype: torch.dtype | None = None, softcap: float = 0.0,
                      layout_segments=None, blocks=None):
    """The attention that runs between the two all-to-alls, on ``[B, S, h, D]`` tensors:
    within documents (``segments``), the ring (R > 1), or the local kernel; each with a
    causal sliding ``window`` when one is given, and ``blocks`` seen whole by their own
    queries (:mod:`ulysses.blocks`; causal, no ring). ``comm_dtype``: what a ring's hops carry.
    ``softcap``: logit softcapping inside the softmax (0: none). On a mesh built with
    ``per_document``, a ring's rows were cut by ``layout_segments`` (default: ``segments``).

    Raises ``ValueError`` for bad segments or a bad window, before any collective.
    """
    window = check_window(window, causal)
    # Padded keys can only be seen without a causal mask (the padding is the sequence's tail).
    kv_len = unpadded_len if unpadded_len is not None and not causal else None
    full = local_len * axis_size(mesh, "ulysses") * axis_size(mesh, "ring")
    starts = None
    if segments is not None:
        if unpadded_len is not None:
            raise ValueError("pass either segments or unpadded_len: make the padded tail its "
                             "own segment instead")
        starts = check_segments(segments, batch, full)
    layout = None
    if layout_segments is not None and (starts is None or not mesh_dims(mesh).per_document):
        raise ValueError("layout_segments= names the documents a per_document mesh cut the "
                         "sequence by; it needs such a mesh and segments=")
    if starts is not None and mesh_dims(mesh).per_document_ring:
        layout = starts if layout_segments is None else check_segments(layout_segments, batch,
                                                                       full)
    if blocks is not None:
        if not causal:
            raise ValueError("blocks= widen a causal mask; a non-causal attention sees them "
                             "whole already")
        if axis_size(mesh, "ring") > 1:
            raise ValueError("blocks= (tokens that see their whole block, Gemma3's images) "
                             "are not implemented across a ring; use a mesh without one")
        blocks = check_blocks(blocks, batch, full, starts)
    attn = inner_attention(mesh, causal=causal, scale=scale, backend=backend, kv_len=kv_len,
                           window=window, comm_dtype=comm_dtype, softcap=softcap,
                           starts=starts, layout=layout)
    if blocks is not None and any(blocks):
        attn = BlockAttention(attn, blocks, scale, backend, softcap)
    return attn


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, causal: bool,
                      softmax_scale: float | None = None, head_chunk_size: int | str | None = None,
                      backend: str | None = None, unpadded_len: int | None = None,
                      buffer_pool: BufferPool | None = None,
                      chunk_budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
                      chunk_overlap: bool | None = None, segments=None,
                      window: int | None = None,
                      sinks: Tensor | None = None,
                      comm_dtype: torch.dtype | None = None,
                      seq_chunk: int | str | None = None, softcap: float | None = None,
                      layout_segments=None, blocks=None) -> Tensor:
    """Sequence-parallel attention over the mesh's ``"ulysses"`` and ``"ring"`` axes.

    Args:
        q: ``q_BsHD``, this rank's sequence piece (from :func:`shard_sequence`).
        k, v: ``k_BsKD``, ``v_BsKD``; GQA/MQA when ``K < H``. kv heads travel unrepeated;
            when ``K < U`` each kv head is replicated to the ranks that need it and the
            replicas' gradients are summed. v may have a head dim ``Dv`` of its own
            (multi-head latent attention): the kernels run at the larger of the two with the
            other zero-padded (exact; :func:`ulysses.kernels.common_head_dim`), and the output
            has ``Dv``. Plain Ulysses exchanges v and the output at ``Dv``; head chunks
            exchange the padded v.
        mesh: from :meth:`SequenceParallelDims.build_mesh`; it carries the sequence layout
            (zigzag or contiguous over the ring) that ``shard_sequence`` cut the inputs in.
        causal: causal mask over the full sequence.
            With R > 1 the attention between the all-to-alls is ring attention over the
            ``"ring"`` axis (hybrid Ulysses x Ring); R = 1 is plain Ulysses and U = 1 pure
            ring.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        head_chunk_size: query heads each rank attends at a time. ``None``: all of them (plain
            Ulysses). An int from :func:`ulysses.head_chunking.valid_chunk_sizes` (any
            divisor of the local head count that fits the GQA groups), or ``"auto"``: the
            largest whose chunk buffers fit ``chunk_budget_bytes`` (default 1 GiB); when that
            is every local head (short sequences) and no ``seq_chunk`` is asked, the plain
            Ulysses exchange runs instead of a one-chunk loop (it is faster).
        backend: attention kernel name (see :mod:`ulysses.kernels`), or ``None`` for automatic.
        unpadded_len: the real full-sequence length when the input was padded with
            ``shard_sequence(..., pad=True)``; padded keys are then masked out (only needed
            for non-causal attention, where the padded tail would otherwise be visible).
        buffer_pool: chunk buffers to reuse across calls (layers); chunking only.
        chunk_budget_bytes: the byte budget of ``head_chunk_size="auto"`` (and of
            ``seq_chunk="auto"``).
        chunk_overlap: exchange chunk i+1 while chunk i computes (chunking only). None: yes
            for head chunks; with ``seq_chunk``, whose block exchanges do not overlap compute
            yet, only None or False are accepted.
        segments: packed documents: per batch row, the start offsets (in the full sequence,
            beginning with 0) of its documents; no token attends across a boundary. On a
            ring, documents may cross ring blocks and zigzag halves, and block pairs whose
            documents do not meet are skipped. Needs no ``unpadded_len``. On a mesh built
            with ``per_document=True`` they are also the documents ``shard_sequence(...,
            segments=)`` cut the sequence by (none: each row was cut whole).
        window: causal sliding window: a query sees itself and the ``window - 1`` keys before
            it (HF's ``sliding_window``; :mod:`ulysses.band`). Needs ``causal``; works with
            head chunking, rings (blocks outside the window are skipped) and segments.
        sinks: ``[H]`` attention-sink logits (GPT-OSS's ``s_aux``), one per query head: each
            joins its head's softmax with a zero value (:mod:`ulysses.sinks`); differentiable.
        comm_dtype: the dtype every exchange carries, forward and backward (DeepSpeed's
            ``seq_parallel_communication_data_type``): tensors are cast to it before an
            all-to-all or ring hop and back after. Sums that the exchanges make (the
            gradients of replicated kv heads, dk/dv over head chunks and ring hops) are taken
            in the wider of it and the inputs' dtype, so float32 for bf16 inputs rounds them
            once. None: the inputs' dtype (no casts).
        seq_chunk: cut each rank's piece into this many sequence blocks inside every head
            chunk (:mod:`ulysses.seq_chunk`, FPDT-style): each exchange moves one block and
            device buffers are ``[B, U s / seq_chunk, c, D]`` instead of ``[B, S, c, D]``;
            the kv chunk and its dk/dv sums wait in host memory. An int in ``[1, s]``, or
            ``"auto"``: the fewest blocks whose buffers fit ``chunk_budget_bytes``. None: not
            cut. Needs ``head_chunk_size`` (``"auto"`` picks c as without blocks); its
            exchanges do not overlap compute (``chunk_overlap=True`` is refused). With a
            ring every ring rank's kv blocks of a chunk are gathered to the host. Not
            supported with ``segments`` (``ValueError``).
        softcap: attention logit softcapping (Gemma2's ``attn_logit_softcapping``): each
            scaled score ``z`` becomes ``softcap * tanh(z / softcap)`` inside the softmax,
            forward and backward; flash-attn 2/3 apply it in their kernels, other backends
            run :mod:`ulysses.softcap`'s blockwise kernel. None or 0: no cap.
        layout_segments: on a ``per_document`` mesh, the documents the sequence was cut by
            when the attention's ``segments`` cut them further (Llama4's chunks of each
            document); default ``segments``.
        blocks: per batch row, ``(first, end)`` full-sequence positions of blocks whose
            tokens also see every token of their own block (Gemma3's images,
            :mod:`ulysses.blocks`); needs ``causal``, no ring and no ``seq_chunk``; each
            block within one document of ``segments``.

    Returns:
        ``out_BsHD`` (``Dv`` wide), sharded like ``q``.

    Heads are split as in :func:`ulysses.sharding.head_layout`; head counts that do not
    divide ``U`` give uneven splits. Every ``ValueError`` is raised before any collective.
    """
    layout, backend = _validate(q, k, v, mesh, causal, backend, unpadded_len)
    softcap = check_softcap(softcap)
    check_sinks(sinks, q.shape[2], q.device)
    check_comm_dtype(comm_dtype)
    check_seq_chunk(seq_chunk, head_chunk_size=head_chunk_size, local_len=q.shape[1],
                    chunk_overlap=chunk_overlap)
    group = axis_group(mesh, "ulysses")
    rank = axis_rank(mesh, "ulysses")
    scale = default_scale(q.shape[-1], softmax_scale)
    value_dim = v.shape[-1]
    if value_dim > q.shape[-1] or head_chunk_size is not None or len(layout.q_sizes) == 1:
        # one head dim from here on; the plain exchange below pads v only after it travels
        q, k, v, _ = common_head_dim(q, k, v)
    attn = between_exchanges(mesh, batch=q.shape[0], local_len=q.shape[1], causal=causal,
                             scale=scale, backend=backend, unpadded_len=unpadded_len,
                             segments=segments, window=window,
                             comm_dtype=comm_dtype, softcap=softcap,
                             layout_segments=layout_segments, blocks=blocks)
    if blocks is not None and seq_chunk is not None:
        raise ValueError("blocks= are not implemented with seq_chunk; leave seq_chunk out")
    if mesh_dims(mesh).kernel_self_check:
        verify_call(backend, q, causal=causal, window=window, sinks=sinks is not None,
                    ring=axis_size(mesh, "ring") > 1, softcap=softcap)
    if sinks is not None:  # [H] -> [h]: this rank's query heads (autograd scatters the grad)
        first = sum(layout.q_sizes[:rank])
        sinks = sinks[first:first + layout.q_sizes[rank]]
    c = None if head_chunk_size is None else resolve_chunk_size(
        head_chunk_size, layout, q.shape[0], q.shape[1] * len(layout.q_sizes), q.shape[3],
        q.dtype, chunk_budget_bytes)
    if head_chunk_size == "auto" and seq_chunk is None and c == max(layout.q_sizes):
        c = None  # every local head fits at once: the plain exchange is faster
    if c is not None:
        blocks = resolve_seq_chunk(seq_chunk, layout, c, q.shape[0], q.shape[1], q.shape[3],
                                   q.dtype, chunk_budget_bytes)
        out = head_chunked_attention(q, k, v, group=group, rank=rank, layout=layout,
                                     head_chunk_size=c, attn=attn, pool=buffer_pool,
                                     overlap=chunk_overlap is not False, sinks=sinks,
                                     comm_dtype=comm_dtype, seq_chunk=blocks)
        return out[..., :value_dim]
    if len(layout.q_sizes) == 1:  # U = 1: nothing to exchange (pure ring, or one rank)
        out, _ = attention_with_lse(q, k, v, attn, sinks)
        return out[..., :value_dim]
    # Casts to the comm dtype and back are no-ops without one; autograd casts the gradients
    # the same way, so the backward's exchanges (and the replicas' sum) run in it too.
    dtype, comm = q.dtype, q.dtype if comm_dtype is None else comm_dtype
    if layout.replicated:
        # [B, s, K, D] -> [B, s, sum(kv_sizes), D]: each rank's kv range in send order. The
        # backward sums the replicas' gradients, in the wider dtype.
        acc = torch.promote_types(dtype, comm)
        index = torch.tensor(layout.kv_index(), device=k.device)
        k, v = k.to(acc).index_select(2, index), v.to(acc).index_select(2, index)
    q, k, v = q.to(comm), k.to(comm), v.to(comm)
    # [B, s, H, D] -> [B, S, h, D]
    q_BShD = all_to_all(q, group, scatter_dim=2, gather_dim=1, scatter_sizes=layout.q_sizes)
    # [B, s, K', D] -> [B, S, k, D]
    k_BSkD = all_to_all(k, group, scatter_dim=2, gather_dim=1, scatter_sizes=layout.kv_sizes)
    v_BSkD = all_to_all(v, group, scatter_dim=2, gather_dim=1, scatter_sizes=layout.kv_sizes)
    q_BShD, k_BSkD, v_BSkD = q_BShD.to(dtype), k_BSkD.to(dtype), v_BSkD.to(dtype)
    # v travelled at its own head dim; the kernel takes q's (zero columns, sliced off again)
    q_BShD, k_BSkD, v_BSkD, _ = common_head_dim(q_BShD, k_BSkD, v_BSkD)
    out_BShD, _ = attention_with_lse(q_BShD, k_BSkD, v_BSkD, attn, sinks)
    # [B, S, h, Dv] -> [B, s, H, Dv]
    return all_to_all(out_BShD[..., :value_dim].to(comm), group, scatter_dim=1, gather_dim=2,
                      gather_sizes=layout.q_sizes).to(dtype)
