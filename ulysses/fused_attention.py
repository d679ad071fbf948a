"""Head-chunked Ulysses with the q/k/v projections, RoPE and o_proj fused into the chunk loop.

:mod:`ulysses.head_chunking` exchanges c heads at a time, but its inputs are still the
all-heads, seq-local q, k, v that the attention module computed (and autograd saved), and its
output feeds o_proj whole. Here (UPipe's fused form) the inputs are the normed hidden states
``x_BsE`` and the projection weights, and each step computes only the heads this rank sends
at that step, from ``x`` (``x @ W[rows of those heads]^T + b``, per-head RMSNorm if given,
then RoPE), so no all-heads q, k or v ever exists, in forward or in backward.

Shape legend: B batch, s = S / U this rank's sequence piece, S the full sequence (of this
ring position), E hidden size, H / K all query / kv heads, D head dim, h this rank's query
heads, c query heads of one chunk, n the heads this rank sends at one step (every rank's
chunk of its piece: ``n <= U c``).

A step (the schedule, kv sharing, uneven heads, idle ranks, overlap and buffers are those of
:mod:`ulysses.chunk_schedule` and :mod:`ulysses.chunk_loop`):

1. ``q_Bsn = rope(x @ Wq[rows]^T + bq[rows])`` for the n heads that step j sends; seq -> head
   all-to-all gives ``q_BScD``. k and v likewise, at the steps where a kv chunk is new.
2. attend (local kernel, ring for hybrid meshes, or per document for packed sequences);
3. head -> seq: the chunk's output lands in its heads of ``out_BsHD``.

After the loop ``y = out @ Wo^T + bo`` is one GEMM. A gated block (Qwen3.5, Qwen3-Next:
``gated``) has, per head, D gate rows after the D query rows of ``Wq``, and its output is
``(out * sigmoid(x @ Wg^T + bg)) @ Wo^T + bo``: that runs in row tiles, so no all-heads gate
exists either; in backward a row-tiled pass gives the gate's and o_proj's gradients, and each
step's ``dout`` is ``(dy @ Wo[:, cols]) * sigmoid(gate of those heads)``, recomputed per step.

Trade-off (what backward keeps): ``x``, cos/sin, the fp32 lse ``[B, h, S]`` and ``out_BsHD``,
the one seq-local tensor of all-heads size. The kernel backward needs each chunk's ``out``,
and keeping it costs one all-heads tensor where recomputing it would cost a second attention
forward per chunk in backward (about +40% of the attention's backward FLOPs, on what is
already the dominant term at long sequences). Since ``out`` is kept anyway, o_proj is applied
to it in one GEMM rather than as H / c thin per-chunk GEMMs: the same memory, faster. Given
the layer's input norm (``input_norm``), ``x`` is the layer's input itself, which the layer
keeps anyway, and the norm runs on the rows each projection reads (:mod:`ulysses.input_norm`):
nothing normed is kept.

Backward, per step: recompute the chunk's q (and, where new, k/v) from ``x``, exchange it
with that chunk's ``out`` and ``dout = dy @ Wo[:, cols]`` (seq -> head), run the kernel
backward with the saved lse, and send dq (and, once per kv chunk, the summed dk/dv) back
(head -> seq). There the projection's backward runs at once for those heads: RoPE and norm
transposed, ``dW[rows] += g^T x``, ``db[rows] += sum(g)``, ``dx += g W[rows]``. What the
backward holds beyond chunk buffers is ``dx`` (the result), ``out`` and ``dWo`` (param size).
``dx`` is accumulated in its own dtype: under bf16 that is one rounding per q step and per kv
chunk (``H / (U c) + 2 K / (U ck)`` per element, e.g. 6 for Llama-3-8B at U=8, c=1), where the
unfused path sums three. At the worst case measured, U=1, c=1 (48 sums), dx's bf16 error
against fp64 was 1.2e-2 relative, the unfused path's 0.94e-2; an fp32 accumulator would cost
two more x-sized tensors at the end of the backward.

The weights are inputs of the autograd Function, so gradients reach them (and FSDP2's or
ZeRO-3's hooks) as those of any op. The Function never calls the Linear modules: a ZeRO-3
integration must gather them with the module that calls this (``arctic.hf.attention`` marks
the attention module a ZeRO-3 leaf for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.all_to_all import check_comm_dtype
from ulysses.attention import between_exchanges
from ulysses.buffer_pool import BufferPool
from ulysses.chunk_loop import ChunkConfig, run_backward, run_forward
from ulysses.chunk_schedule import (DEFAULT_CHUNK_BUDGET_BYTES, Step, build_schedule,
                                    resolve_chunk_size)
from ulysses.head_projection import (HeadSet, Projection, ProjectionGrads, gated_output,
                                     gated_output_backward, head_set, project, project_backward)
from ulysses.fused_checks import check_fused_inputs
from ulysses.hybrid import check_hybrid
from ulysses.input_norm import InputNorm, NormedRows, norm_backward
from ulysses.keep import kept_or_computed
from ulysses.kernels import default_scale, select_backend
from ulysses.mesh import axis_group, axis_rank, axis_size, check_mesh, mesh_dims
from ulysses.seq_chunk import (SeqChunking, check_seq_chunk, resolve_seq_chunk, seq_chunking)
from ulysses.seq_chunk import run_backward as run_seq_backward
from ulysses.seq_chunk import run_forward as run_seq_forward
from ulysses.self_check import verify_call
from ulysses.sharding import head_layout
from ulysses.softcap import check_softcap


@dataclass(frozen=True, slots=True)
class FusedConfig:
    """What one fused call needs besides tensors: the chunk schedule and, per step, the head
    sets of its exchanges (with their weight rows)."""

    chunks: ChunkConfig
    head_dim: int
    norm_eps: float
    q_heads: tuple[HeadSet, ...]
    """Per step: the query heads sent (and, in backward, their dq received back)."""
    kv_new: tuple[HeadSet | None, ...]
    """Per step: the kv heads sent, where some rank needs a new kv chunk."""
    kv_done: tuple[HeadSet | None, ...]
    """Per step: the kv heads whose summed dk/dv come back."""
    seq: SeqChunking | None = None
    """Sequence blocks per piece (:mod:`ulysses.seq_chunk`), or None: the head-chunk loop."""
    gated: bool = False
    """Wq holds each head's gate rows after its query rows; the output is gated."""
    zero_centered: bool = False
    """The per-head norms are Qwen3.5's (``1 + weight``)."""
    all_heads: HeadSet | None = None
    """Every query head (the gate's rows and o_proj's columns of the gated output)."""
    tile_rows: int = 1
    """Rows of ``x`` per tile of the gated output."""


@dataclass(slots=True)
class _ProjectedChunks:
    """A :class:`ulysses.chunk_loop.ChunkSource` that computes each step's heads from ``x``:
    ``project`` right before they are sent (and dropped once packed), ``dout = dy @ Wo[:, cols]``
    for those heads only; a returning gradient runs the projection's backward at once,
    accumulating into ``grads`` and ``dx``."""

    x_NE: Tensor | NormedRows
    """The block's input; :class:`NormedRows` where its norm runs here (``input_norm``)."""
    rotary: tuple[Tensor, Tensor]
    proj: dict[str, Projection]
    """``"q"``, ``"k"``, ``"v"`` (and ``"gate"`` for a gated block)."""
    cfg: FusedConfig
    shape: tuple[int, int, int]
    """``(B, s, D)``."""
    dy_NE: Tensor | None = None
    wo: Tensor | None = None
    grads: dict | None = None
    dx_NE: Tensor | None = None

    def _heads(self, kind: str, j: int, sending: bool) -> HeadSet:
        if kind in ("q", "dout"):
            return self.cfg.q_heads[j]
        return (self.cfg.kv_new if sending else self.cfg.kv_done)[j]

    def send(self, kind: str, j: int, step: Step):
        return self.send_rows(kind, j, step, slice(0, self.shape[1]))  # views of all rows

    def take(self, kind: str, j: int, step: Step, blocks: list[Tensor]) -> None:
        heads = self._heads(kind, j, sending=False)
        project_backward(self.x_NE, self.proj[kind], heads, self.shape, self.rotary,
                         self.cfg.norm_eps, self._gathered(blocks, heads), self.grads[kind],
                         self.dx_NE)

    def _gathered(self, blocks: list[Tensor], heads: HeadSet) -> Tensor:
        blocks = [b for b, (_, n) in zip(blocks, heads.ranges) if n]
        g = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)  # [B, s, n, D]
        return g.to(self.x_NE.dtype)  # arrived in the exchange's dtype

    # Rows of the piece: all of them (send), or one sequence block at a time for the
    # sequence-chunked loop (ulysses.seq_chunk), which also takes gradients back per block.

    def _rows(self, t_NX, rows: slice):
        """Rows ``rows`` of each batch row of a ``[B s, X]`` tensor, as ``[B b, X]`` (of
        :class:`NormedRows`, still to be normed)."""
        B, s, _ = self.shape

        def pick(t: Tensor) -> Tensor:
            return t.view(B, s, -1)[:, rows].reshape(-1, t.shape[-1])

        return t_NX.narrowed(pick) if isinstance(t_NX, NormedRows) else pick(t_NX)

    def send_rows(self, kind: str, j: int, step: Step, rows: slice):
        heads = self._heads(kind, j, sending=True)
        B, _, D = self.shape
        shape = (B, rows.stop - rows.start, D)
        rotary = tuple(r[:, rows] for r in self.rotary)
        if kind == "dout":  # [B b, E] @ [E, n D] -> [B, b, n, D]
            g = self._rows(self.dy_NE, rows) @ self.wo.index_select(1, heads.rows)
            g = g.view(*shape[:2], heads.count, D)
            if "gate" in self.proj:  # times the gate of these heads, recomputed
                g = g * torch.sigmoid(project(self._rows(self.x_NE, rows), self.proj["gate"],
                                              heads, shape, rotary, self.cfg.norm_eps))
            return g, heads.local
        return project(self._rows(self.x_NE, rows), self.proj[kind], heads, shape, rotary,
                       self.cfg.norm_eps), heads.local

    def take_rows(self, kind: str, j: int, step: Step, blocks: list[Tensor],
                  rows: slice) -> None:
        heads = self._heads(kind, j, sending=False)
        B, _, D = self.shape
        b = rows.stop - rows.start
        dx = None if self.dx_NE is None else self.dx_NE.new_zeros(B * b, self.dx_NE.shape[-1])
        project_backward(self._rows(self.x_NE, rows), self.proj[kind], heads, (B, b, D),
                         tuple(r[:, rows] for r in self.rotary), self.cfg.norm_eps,
                         self._gathered(blocks, heads), self.grads[kind], dx)
        if dx is not None:
            self.dx_NE.view(B, self.shape[1], -1)[:, rows] += dx.view(B, b, -1)


def _projections(cfg: FusedConfig, wq, bq, wk, bk, wv, bv, q_norm,
                 k_norm) -> dict[str, Projection]:
    z, half = cfg.zero_centered, 0 if cfg.gated else None
    proj = {"q": Projection(wq, bq, q_norm, True, z, half),
            "k": Projection(wk, bk, k_norm, True, z),
            "v": Projection(wv, bv, None, False)}
    if cfg.gated:
        proj["gate"] = Projection(wq, bq, None, False, half=1)
    return proj


def _input(x: Tensor, norm: InputNorm | None) -> Tensor | NormedRows:
    """``x`` as ``[B s, E]`` rows, to be normed where ``norm`` is given."""
    x_NE = x.reshape(-1, x.shape[-1])
    return x_NE if norm is None else NormedRows(x_NE, norm)


def _zeros_if(needed: bool, t: Tensor | None, dtype=None) -> Tensor | None:
    return torch.zeros_like(t, dtype=dtype) if needed and t is not None else None


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, wq, bq, wk, bk, wv, bv, wo, bo, q_norm, k_norm, cfg, pool,
                norm):
        B, s, E = x.shape
        x_in = _input(x, norm)

        def compute():
            rotary = (cos.unsqueeze(2), sin.unsqueeze(2))  # [B|1, s, D] -> [B|1, s, 1, D]
            src = _ProjectedChunks(x_in, rotary,
                                   _projections(cfg, wq, bq, wk, bk, wv, bv, q_norm, k_norm),
                                   cfg, (B, s, cfg.head_dim))
            out = x.new_empty(B, s, sum(cfg.chunks.layout.q_sizes), cfg.head_dim)
            if cfg.seq is None:
                lse = run_forward(src, out, cfg.chunks, pool)
            else:
                lse = run_seq_forward(src, out, cfg.chunks, pool, cfg.seq)
            pool.end_call()
            return out, lse

        # In a checkpointed layer's recompute with kept attention: the forward's result (no
        # projection, exchange or kernel runs).
        out, lse = kept_or_computed(("fused", tuple(x.shape), tuple(wq.shape), x.dtype), compute)
        # Kept for backward: x, cos/sin, the weights, out (the one all-heads seq-local tensor;
        # see the module docstring) and the fp32 lse.
        ctx.save_for_backward(x, cos, sin, wq, bq, wk, bk, wv, bv, wo, q_norm, k_norm, out, lse)
        ctx.cfg, ctx.pool, ctx.has_bo, ctx.norm = cfg, pool, bo is not None, norm
        B, s, H, D = out.shape
        if cfg.gated:
            gate = _projections(cfg, wq, bq, wk, bk, wv, bv, q_norm, k_norm)["gate"]
            return gated_output(x_in, out.view(B * s, H * D), gate,
                                cfg.all_heads, D, wo, bo, cfg.tile_rows).view(B, s, -1)
        return F.linear(out.view(B, s, H * D), wo, bo)

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin, wq, bq, wk, bk, wv, bv, wo, q_norm, k_norm, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad
        rotary = (cos.unsqueeze(2), sin.unsqueeze(2))
        grads = {
            "q": ProjectionGrads(_zeros_if(need[3], wq), _zeros_if(need[4], bq),
                                 _zeros_if(need[11], q_norm, torch.float32)),
            "k": ProjectionGrads(_zeros_if(need[5], wk), _zeros_if(need[6], bk),
                                 _zeros_if(need[12], k_norm, torch.float32)),
            "v": ProjectionGrads(_zeros_if(need[7], wv), _zeros_if(need[8], bv), None),
            "wo": _zeros_if(need[9], wo),
            "bo": (torch.zeros(wo.shape[0], dtype=wo.dtype, device=wo.device)
                   if ctx.has_bo and need[10] else None),
        }
        norm = ctx.norm
        # (with the input's norm here: the gradient of norm(x), then made that of x)
        dx = _zeros_if(need[0] or (norm is not None and len(norm.params) > 0), x)
        B, s, E = x.shape
        x_in = _input(x, norm)
        H, D = out.shape[2], out.shape[3]
        dy_NE = dy.contiguous().reshape(B * s, E)
        proj = _projections(ctx.cfg, wq, bq, wk, bk, wv, bv, q_norm, k_norm)
        # o_proj's gradients first: one GEMM over the saved all-heads out (row tiles, with
        # the gate's gradients, for a gated block).
        if ctx.cfg.gated:
            gated_output_backward(
                x_in, out.view(B * s, H * D), dy_NE, proj["gate"],
                ctx.cfg.all_heads, D, wo, ctx.cfg.tile_rows, grads["wo"],
                ProjectionGrads(grads["q"].weight, grads["q"].bias, None),
                None if dx is None else dx.view(B * s, E))
        elif grads["wo"] is not None:
            grads["wo"].addmm_(dy_NE.t(), out.view(B * s, H * D))
        if grads["bo"] is not None:
            grads["bo"] += dy_NE.sum(0)
        src = _ProjectedChunks(x_in, rotary, proj, ctx.cfg, (B, s, D), dy_NE, wo,
                               grads, None if dx is None else dx.view(B * s, E))
        if ctx.cfg.seq is None:
            run_backward(src, out, lse, ctx.cfg.chunks, ctx.pool)
        else:
            run_seq_backward(src, out, lse, ctx.cfg.chunks, ctx.pool, ctx.cfg.seq)
        del src
        ctx.pool.end_call()
        norms = [None if g is None else g.to(w.dtype)
                 for g, w in ((grads["q"].norm, q_norm), (grads["k"].norm, k_norm))]
        if norm is not None and dx is not None:
            norm_backward(x.reshape(B * s, E), norm, dx.view(B * s, E))
        if not need[0]:
            dx = None
        return (dx, None, None, grads["q"].weight, grads["q"].bias, grads["k"].weight,
                grads["k"].bias, grads["v"].weight, grads["v"].bias, grads["wo"], grads["bo"],
                *norms, None, None, None)


def fused_attention(x: Tensor, cos: Tensor, sin: Tensor, *, wq: Tensor, wk: Tensor,
                    wv: Tensor, wo: Tensor, bq: Tensor | None = None, bk: Tensor | None = None,
                    bv: Tensor | None = None, bo: Tensor | None = None,
                    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None,
                    norm_eps: float = 1e-6, num_heads: int, num_kv_heads: int,
                    mesh: DeviceMesh, head_chunk_size: int | str, causal: bool = True,
                    softmax_scale: float | None = None, backend: str | None = None,
                    buffer_pool: BufferPool | None = None,
                    chunk_budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
                    chunk_overlap: bool | None = None, segments=None,
                    window: int | None = None,
                    comm_dtype: torch.dtype | None = None,
                    seq_chunk: int | str | None = None,
                    softcap: float | None = None, gated: bool = False,
                    norm_zero_centered: bool = False,
                    input_norm: InputNorm | None = None) -> Tensor:
    """A Llama-style attention block, ``o_proj(attn(rope(q_proj(x)), rope(k_proj(x)),
    v_proj(x)))``, sequence-parallel and head-chunked, with no all-heads q/k/v.

    Args:
        x: ``x_BsE``, this rank's sequence piece of the block's (normed) input.
        cos, sin: ``[B or 1, s, r]``, the rotary tables of this piece's positions (HF's
            ``position_embeddings``), rotate-half convention over the first ``r <= D`` dims of
            each head (partial rotary); no gradient.
        wq, wk, wv: ``[H D, E]``, ``[K D, E]``, ``[K D, E]`` (``nn.Linear`` weights);
            ``bq``/``bk``/``bv`` their optional biases (Qwen2).
        wo, bo: o_proj, ``[E, H D]`` and optional ``[E]``.
        q_norm_weight, k_norm_weight, norm_eps: optional per-head RMSNorm ``[D]`` applied to
            q and k before RoPE (Qwen3); both or neither. ``norm_zero_centered``: Qwen3.5's
            norm, ``x * rstd * (1 + weight)`` in fp32, then cast.
        gated: ``wq`` (and ``bq``) ``[2 H D, E]`` hold, per head, D query rows and then D gate
            rows, and the output is ``o_proj(attn(...) * sigmoid(gate))`` (Qwen3.5's and
            Qwen3-Next's gated attention).
        num_heads, num_kv_heads: H and K; heads are split over the mesh's ``"ulysses"`` axis
            as in :func:`ulysses.sharding.head_layout`.
        mesh: from :meth:`SequenceParallelDims.build_mesh`; with ``"ring"`` > 1 each chunk
            attends by ring attention (hybrid).
        head_chunk_size: an int from :func:`ulysses.chunk_schedule.valid_chunk_sizes`, or
            ``"auto"`` (within ``chunk_budget_bytes``).
        causal, softmax_scale, backend, buffer_pool, chunk_overlap, segments, window,
        comm_dtype, seq_chunk, softcap:
            as for :func:`ulysses.ulysses_attention`. With ``seq_chunk`` each step's heads are
            projected, and their gradients taken back, one sequence block at a time
            (``_ProjectedChunks.send_rows``/``take_rows``): no seq-local tensor of a step's
            heads exists either.

        input_norm: the block's input norm (:class:`ulysses.input_norm.InputNorm`), when
            ``x`` is the layer's input before it: each projection then norms the rows it
            reads, and ``norm(x)`` is never held whole (:mod:`ulysses.input_norm`).

    Returns:
        ``y_BsE``, sharded like ``x``. Gradients flow to ``x`` and every weight and bias
        (and into the ``.grad`` of ``input_norm``'s parameters).

    Every ``ValueError`` is raised before any collective.
    """
    weights = dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo,
                   q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    if norm_zero_centered and q_norm_weight is None:
        raise ValueError("norm_zero_centered=True needs q_norm_weight and k_norm_weight")
    D = check_fused_inputs(x, cos, sin, weights, num_heads, num_kv_heads, gated)
    if input_norm is not None and not (isinstance(input_norm, InputNorm) and
                                       callable(input_norm.fn)):
        raise ValueError(f"input_norm must be a ulysses.input_norm.InputNorm, got "
                         f"{type(input_norm).__name__}")
    check_comm_dtype(comm_dtype)
    softcap = check_softcap(softcap)
    check_mesh(mesh)
    B, s, _ = x.shape
    U = axis_size(mesh, "ulysses")
    layout = head_layout(num_heads, num_kv_heads, U)
    check_hybrid(s, mesh)
    if head_chunk_size is None:
        raise ValueError("fused_attention needs head_chunk_size (an int or 'auto'): the "
                         "projections are fused into the head-chunk loop")
    check_seq_chunk(seq_chunk, head_chunk_size=head_chunk_size, local_len=s,
                    chunk_overlap=chunk_overlap)
    c = resolve_chunk_size(head_chunk_size, layout, B, s * U, D, x.dtype, chunk_budget_bytes)
    blocks = resolve_seq_chunk(seq_chunk, layout, c, B, s, D, x.dtype, chunk_budget_bytes)
    backend = select_backend(x.device, x.dtype, D, backend)
    attn = between_exchanges(mesh, batch=B, local_len=s, causal=causal,
                             scale=default_scale(D, softmax_scale), backend=backend,
                             unpadded_len=None, segments=segments,
                             window=window, comm_dtype=comm_dtype, softcap=softcap)
    if mesh_dims(mesh).kernel_self_check:
        verify_call(backend, x, head_dim=D, causal=causal, window=window, sinks=False,
                    ring=axis_size(mesh, "ring") > 1, softcap=softcap)
    schedule = tuple(build_schedule(layout, c))
    chunks = ChunkConfig(group=axis_group(mesh, "ulysses"), rank=axis_rank(mesh, "ulysses"),
                         layout=layout, schedule=schedule, attn=attn,
                         overlap=chunk_overlap is not False,
                         comm_dtype=comm_dtype)

    def plan(ranges):
        return None if ranges is None else head_set(ranges, D, x.device)

    cfg = FusedConfig(
        chunks=chunks, head_dim=D, norm_eps=float(norm_eps),
        q_heads=tuple(plan(st.q) for st in schedule),
        kv_new=tuple(plan(st.kv_sent()) for st in schedule),
        kv_done=tuple(plan(st.kv_returned()) for st in schedule),
        seq=None if blocks is None else seq_chunking(attn, blocks),
        gated=gated, zero_centered=norm_zero_centered,
        all_heads=plan(((0, num_heads),)) if gated else None,
        # a tile's gate and gated output, [rows, H D] each, within the chunk budget
        tile_rows=max(1, chunk_budget_bytes // (2 * num_heads * D * x.element_size())))
    pool = BufferPool(keep_between_calls=False) if buffer_pool is None else buffer_pool
    return _FusedFn.apply(x, cos, sin, wq, bq, wk, bk, wv, bv, wo, bo, q_norm_weight,
                          k_norm_weight, cfg, pool, input_norm)
