"""Sequence-parallel attention for HuggingFace models, through transformers' AttentionInterface.

Importing this module registers our attention under its own names; the stock ``"sdpa"`` and
``"flash_attention_2"`` entries are never touched, so SP and non-SP models can share a
process:

- ``"ulysses_sdpa"``: the backend is chosen by device and dtype (CPU flash, CUDA SDPA);
- ``"ulysses_flash_attention_2"``: the ``flash_attn`` package's kernels.

:func:`apply_sequence_parallel` switches a model to one of them and records, on every
attention module, what that module needs: the mesh, its head counts (checked against the
mesh when applied, not inside ``forward``), head chunking and the buffer pool. transformers
creates no mask for implementations it does not know, so each layer sees ``attention_mask``
None and the attention is causal over the whole (gathered) sequence.

A forward pre-hook on the model checks that ``position_ids`` are given (without them every
rank would apply RoPE from position 0, silently) and turns document boundaries in them
(packed sequences: a position that does not follow its predecessor) into ``sp_segments``,
which reach the attention as a keyword argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface

from arctic.hf_fused import check_fusable, fuse, unfuse
from offload.order import record_apply
from ulysses import BufferPool, gather_sequence, ulysses_attention
from ulysses.head_chunking import resolve_chunk_size
from ulysses.kernels import check_supported
from ulysses.mesh import axis_size, check_mesh
from ulysses.sharding import head_layout

IMPLEMENTATIONS = {"ulysses_sdpa": None, "ulysses_flash_attention_2": "flash_attn"}
"""Our attention names -> kernel backend (None: automatic)."""


@dataclass(slots=True)
class SPAttentionSettings:
    """What one attention module needs to run sequence-parallel."""

    mesh: DeviceMesh
    num_heads: int
    num_kv_heads: int
    head_chunk_size: int | str | None
    backend: str | None
    pool: BufferPool | None
    zigzag: bool
    fuse_projections: bool = False
    """The module's forward is the fused one (:mod:`arctic.hf_fused`)."""


def _sp_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling: float | None = None, sp_segments=None, **kwargs):
    """transformers' attention signature: q ``[B, H, s, D]``, k/v ``[B, K, s, D]`` (this rank's
    sequence piece); returns ``([B, s, H, D], None)``."""
    sp: SPAttentionSettings | None = getattr(module, "sp_attention", None)
    if sp is None:
        raise ValueError(f"{type(module).__name__} has no sequence-parallel settings; call "
                         f"arctic.apply_sequence_parallel(model, mesh=...) first")
    if attention_mask is not None:
        raise ValueError("an explicit attention mask is not supported under sequence "
                         "parallelism; mark padding with labels=-100 and documents with "
                         "position_ids (arctic.data does both)")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported; set "
                         f"config.attention_dropout=0")
    if query.shape[1] != sp.num_heads or key.shape[1] != sp.num_kv_heads:
        raise ValueError(f"{type(module).__name__} got {query.shape[1]} query / {key.shape[1]} kv "
                         f"heads, but was prepared for {sp.num_heads} / {sp.num_kv_heads}")
    # [B, H, s, D] -> [B, s, H, D] (views; the all-to-all packs them)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = ulysses_attention(q, k, v, mesh=sp.mesh, causal=True, softmax_scale=scaling,
                            head_chunk_size=sp.head_chunk_size, backend=sp.backend,
                            buffer_pool=sp.pool, zigzag=sp.zigzag, segments=sp_segments)
    return out, None


for _name in IMPLEMENTATIONS:
    AttentionInterface.register(_name, _sp_attention)


def document_starts(position_ids_BS: torch.Tensor) -> tuple[tuple[int, ...], ...] | None:
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


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a HF decoder: they hold q/k/v projections."""
    return [m for m in model.modules()
            if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj")) and
            hasattr(m, "layer_idx")]


def apply_sequence_parallel(model: nn.Module, *, mesh: DeviceMesh,
                            head_chunk_size: int | str | None = None,
                            attn_implementation: str = "ulysses_sdpa",
                            zigzag: bool = True, fuse_projections: bool = False) -> nn.Module:
    """Switch a HF causal LM to sequence-parallel attention over ``mesh``; returns ``model``.

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``
            (Llama, Mistral, Qwen2, ... built from config or pretrained).
        mesh: from :meth:`ulysses.SequenceParallelDims.build_mesh`; Ulysses over its
            ``"ulysses"`` axis, ring attention over ``"ring"`` when that is > 1.
        head_chunk_size: ``None``, an int or ``"auto"``; see ``ulysses_attention``. One
            :class:`ulysses.BufferPool` is shared by all layers when chunking, emptied after
            each attention forward and backward (nothing is held between layers).
        attn_implementation: a name from :data:`IMPLEMENTATIONS`.
        zigzag: the ring layout; must match how batches are sharded (``arctic.data``).
        fuse_projections: compute q/k/v (with RoPE) per head chunk from the hidden states and
            apply o_proj to the chunks' output (:mod:`arctic.hf_fused`), so that no all-heads
            q/k/v exists; needs ``head_chunk_size`` and a Llama-family attention module
            (:data:`arctic.hf_fused.FUSABLE`). Replaces each attention module's forward (the
            instance's; class, parameters and state_dict keys unchanged) and marks it a
            ZeRO-3 leaf. Calls must pass ``use_cache=False``. False restores the stock forward.

    Raises ``ValueError`` (before any communication) when the head counts do not fit the
    mesh, the chunk size is invalid, attention dropout is on, no attention module exists, or
    ``fuse_projections`` is asked for without chunking or on a module it does not support.
    Inputs must then be this rank's shard, with ``position_ids``.
    """
    check_mesh(mesh)
    if attn_implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {sorted(IMPLEMENTATIONS)}, got "
                         f"{attn_implementation!r}")
    config = model.config
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout ({config.attention_dropout}) is not supported "
                         f"under sequence parallelism; set it to 0")
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module with q/k/v "
                         f"projections to make sequence-parallel")
    H = config.num_attention_heads
    K = getattr(config, "num_key_value_heads", None) or H
    layout = head_layout(H, K, axis_size(mesh, "ulysses"))  # ValueError names valid degrees
    backend = IMPLEMENTATIONS[attn_implementation]
    if backend is not None:
        param = next(model.parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // H
        check_supported(backend, param.device, param.dtype, head_dim)
    if head_chunk_size is not None and head_chunk_size != "auto":
        resolve_chunk_size(head_chunk_size, layout, 1, 1, 1, torch.float32)
    if not isinstance(fuse_projections, bool):
        raise ValueError(f"fuse_projections must be True or False, got {fuse_projections!r}")
    if fuse_projections:
        if head_chunk_size is None:
            raise ValueError("fuse_projections=True needs head_chunk_size (an int or 'auto'): "
                             "the projections are fused into the head-chunk loop")
        for m in modules:
            check_fusable(m, num_heads=H, num_kv_heads=K, hidden_size=config.hidden_size)
    # Shared by the layers, but emptied after each attention forward/backward: between calls
    # the MLP, the loss and checkpoint recomputes run, and held chunk buffers would only add
    # to their peak (benchmarks/memory.py measured +6.5% on the full stack).
    pool = BufferPool(keep_between_calls=False) if head_chunk_size is not None else None
    record_apply(model, "sp_attention")  # after the checks: a refused call changes nothing
    for m in modules:
        m.sp_attention = SPAttentionSettings(
            mesh=mesh, num_heads=H, num_kv_heads=K, head_chunk_size=head_chunk_size,
            backend=backend, pool=pool, zigzag=zigzag, fuse_projections=fuse_projections)
        if fuse_projections:
            fuse(m)
        else:
            unfuse(m)
    model.set_attn_implementation(attn_implementation)
    # On the base model, so that calling it directly (for a tiled loss) is checked as well.
    # Applying again (e.g. with another mesh) replaces the hook rather than stacking a second.
    base = getattr(model, "base_model", model)
    old = getattr(base, "_sp_batch_hook", None)
    if old is not None:
        old.remove()
    base._sp_batch_hook = base.register_forward_pre_hook(_make_batch_hook(mesh, zigzag),
                                                         with_kwargs=True)
    return model


def _make_batch_hook(mesh: DeviceMesh, zigzag: bool):
    def hook(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("position_ids are required under sequence parallelism: pass this "
                             "rank's shard of the full sequence's position_ids (arctic.data "
                             "builds them); without them every rank would start RoPE at 0")
        # Every rank gathers (the same collective everywhere), so every rank sees the same
        # document boundaries and raises, or not, together.
        full = gather_sequence(position_ids, mesh, dim=1, zigzag=zigzag)
        # torch's fake process group (the planner, benchmarks/scale_gpu.py) moves no data:
        # what came back is not the positions, so plan one document.
        fake = dist.get_backend(mesh.get_group(0)) == "fake"
        starts = None if fake else document_starts(full)
        if starts is not None:
            kwargs["sp_segments"] = starts
        return args, kwargs
    return hook
