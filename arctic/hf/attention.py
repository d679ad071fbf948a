"""Sequence-parallel attention for HuggingFace models, through transformers' AttentionInterface.

Importing this module registers our attention under the name :data:`REGISTERED`; the stock
``"sdpa"`` and ``"flash_attention_2"`` entries are never touched, so SP and non-SP models can
share a process. The name contains neither "sdpa" nor "flash": transformers applies its SDPA
or flash-attn capability checks to any name containing those (Gemma2, whose
``_supports_sdpa`` is False, could not run under "ulysses_sdpa"). The kernel is chosen per
model by ``attn_implementation`` (:data:`IMPLEMENTATIONS`).

:func:`apply_sequence_parallel` switches a model to it and records, on every attention module,
what that module needs: the mesh, its head counts (checked against the mesh when applied, not
inside ``forward``), head chunking, the buffer pool and the model's batch state
(:mod:`arctic.hf.batch`: position ids and packed documents). transformers creates no mask for
implementations it does not know, so each layer sees ``attention_mask`` None and the attention
is causal over the whole (gathered) sequence, with the sliding window, sinks and documents
the model asks for (:mod:`arctic.hf.features` honours or refuses each feature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface

from arctic.hf.anatomy import attention_heads, attention_modules, language_model, text_config
from arctic.hf.batch import (
    BatchState,
    chunk_starts,
    document_starts,
    install_batch_hook,
    varlen_documents,
)
from arctic.hf.features import (
    attention_chunk,
    check_model_features,
    fix_temperature,
    loss_arguments,
    read_attention_kwargs,
    tunes_temperature,
)
from arctic.hf.fused import check_fusable, fuse, unfuse
from arctic.hf.mixers import (FAMILIES, check_token_mixers, install_mixers, mixer_passing,
                              token_mixers)
from arctic.hf.vlm import image_block_key, install_vision, is_vlm, vision_inputs
from arctic.loss.reduction import install_sp_gradient_average
from arctic.loss.token import install_sp_causal_lm_loss
from arctic.order import record_apply
from ulysses import BufferPool, shard_sequence, ulysses_attention
from ulysses.all_to_all import check_comm_dtype
from ulysses.head_chunking import resolve_chunk_size
from ulysses.kernels import check_supported
from ulysses.mesh import axis_size, check_mesh, mesh_dims
from ulysses.patching import journaled
from ulysses.seq_chunk import check_seq_chunk
from ulysses.sharding import head_layout

REGISTERED = "ulysses"
"""The name our attention function is registered under in transformers."""
IMPLEMENTATIONS = {"ulysses_sdpa": None, "ulysses_flash_attention_2": "flash_attn"}
"""``attn_implementation`` choices -> kernel backend (None: automatic by device and dtype)."""

__all__ = ["IMPLEMENTATIONS", "REGISTERED", "SPAttentionSettings", "apply_sequence_parallel",
           "document_starts"]


@dataclass(slots=True)
class SPAttentionSettings:
    """What one attention module needs to run sequence-parallel."""

    mesh: DeviceMesh
    num_heads: int
    num_kv_heads: int
    head_chunk_size: int | str | None
    backend: str | None
    pool: BufferPool | None
    batch: BatchState
    """The model's current batch: where its documents come from."""
    fuse_projections: bool = False
    """The module's forward is the fused one (:mod:`arctic.hf.fused`)."""
    communication_dtype: torch.dtype | None = None
    """What the exchanges carry; None: the activations' dtype."""
    seq_chunk: int | str | None = None
    """Sequence blocks per piece inside each head chunk (:mod:`ulysses.seq_chunk`)."""
    chunk_size: int | None = None
    """Llama4's chunked attention on this layer (``attention_chunk_size`` where ``layer_types``
    says ``"chunked_attention"``): queries see only their own chunk; None: not chunked."""
    loss_arguments: frozenset[str] = frozenset()
    """The model's loss arguments (``shift_labels``, ``num_items_in_batch``, ...), which
    transformers passes on to every attention call and the attention passes over."""
    ran: bool = False
    """Set by each call of the SP attention, checked after the module's forward."""


def settings(module: nn.Module) -> SPAttentionSettings:
    """The SP settings of an attention module; ``ValueError`` if it has none."""
    sp: SPAttentionSettings | None = getattr(module, "sp_attention", None)
    if sp is None:
        raise ValueError(f"{type(module).__name__} has no sequence-parallel settings; call "
                         f"arctic.apply_sequence_parallel(model, mesh=...) first")
    return sp


def _sp_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature: q ``[B, H, s, D]``, k/v ``[B, K, s, D]`` (this rank's
    sequence piece); returns ``([B, s, H, D], None)``. Every keyword argument is honoured or
    refused (:func:`arctic.hf.features.read_attention_kwargs`) before any collective."""
    sp = settings(module)
    if attention_mask is not None:
        raise ValueError("an explicit attention mask is not supported under sequence "
                         "parallelism; mark padding with labels=-100 and documents with "
                         "position_ids (arctic.data does both)")
    call = read_attention_kwargs(module, kwargs, passed_over=sp.loss_arguments)
    if query.shape[1] != sp.num_heads or key.shape[1] != sp.num_kv_heads:
        raise ValueError(f"{type(module).__name__} got {query.shape[1]} query / {key.shape[1]} kv "
                         f"heads, but was prepared for {sp.num_heads} / {sp.num_kv_heads}")
    sp.ran = True
    # [B, H, s, D] -> [B, s, H, D] (views; the all-to-all packs them)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    full = q.shape[1] * axis_size(sp.mesh, "ulysses") * axis_size(sp.mesh, "ring")
    documents = sp.batch.segments()
    if call.varlen is not None and not sp.batch.forwarded(call.varlen) and \
            _whole(varlen_documents(call.varlen, q.shape[0], full)) != documents:
        raise ValueError(f"{type(module).__name__} got other flash-attn varlen arguments than "
                         f"the model's forward: its documents would differ from the batch's")
    # the rows of a per-document mesh were cut by the documents
    layout = None
    if mesh_dims(sp.mesh).per_document:
        layout = documents or ((0,),) * q.shape[0]
    # Llama4's NoPE temperature: the layer scaled q by its piece's positions, not the row's
    if tunes_temperature(module):
        rows = torch.arange(full).expand(q.shape[0], full)
        q = fix_temperature(module, q, shard_sequence(rows, sp.mesh, segments=layout))
    blocks = sp.batch.blocks()  # after the documents' gather, on every rank alike
    segments = documents
    if sp.chunk_size is not None:
        segments = chunk_starts(segments, sp.chunk_size, q.shape[0], full)
    # Not causal only where check_model_features honoured it (Gemma3's bidirectional flag):
    # full layers then attend without a mask, sliding ones within |q - k| < sliding_window.
    causal = getattr(module, "is_causal", True) is not False
    out = ulysses_attention(q, k, v, mesh=sp.mesh, causal=causal, softmax_scale=call.scaling,
                            head_chunk_size=sp.head_chunk_size, backend=sp.backend,
                            buffer_pool=sp.pool, segments=segments,
                            layout_segments=layout if sp.chunk_size is not None else None,
                            window=call.window, sinks=call.sinks,
                            comm_dtype=sp.communication_dtype, seq_chunk=sp.seq_chunk,
                            softcap=call.softcap, blocks=blocks)
    return out, None


def _whole(documents):
    """None for one document per row, as the batch state keeps it."""
    return None if documents is None or all(row == (0,) for row in documents) else documents


AttentionInterface.register(REGISTERED, _sp_attention)


def _before_attention(module, args, kwargs):
    module.sp_attention.ran = False


def _after_attention(module, args, output):
    """Refuse an attention module that computed its attention without ours (e.g. after the
    model was switched to another ``attn_implementation``): that would be local attention
    over this rank's piece, silently."""
    if not module.sp_attention.ran:
        now = getattr(getattr(module, "config", None), "_attn_implementation", None)
        raise ValueError(f"{type(module).__name__} ran without the sequence-parallel attention "
                         f"(config._attn_implementation is {now!r}, not {REGISTERED!r}); call "
                         f"arctic.apply_sequence_parallel again after changing it")


def check_model_family(model: nn.Module, modules=None) -> None:
    """``ValueError`` unless sequence parallelism can run ``model``'s family: it has attention
    or token mixers SP implements, no attention feature SP does not implement, and (a VLM) a
    vision tower whose inputs it knows. The first check of every entry point, before any
    setting is checked against the model: a family SP cannot run is the error that matters."""
    modules = attention_modules(model) if modules is None else modules
    if not modules and not token_mixers(model):
        raise ValueError(f"{type(model).__name__} has no attention module with q/k/v "
                         f"projections (or latent attention's) and no token mixer of "
                         f"{sorted(FAMILIES)} to make sequence-parallel")
    check_token_mixers(model)
    check_model_features(model, modules)
    if is_vlm(model):
        vision_inputs(model)  # ValueError for an unsupported family


@journaled
def apply_sequence_parallel(model: nn.Module, *, mesh: DeviceMesh,
                            head_chunk_size: int | str | None = None,
                            seq_chunk: int | str | None = None,
                            attn_implementation: str = "ulysses_sdpa",
                            fuse_projections: bool = False,
                            communication_dtype: torch.dtype | None = None,
                            attention_backend: str | None = None,
                            mixer_parallelism: str = "auto",
                            mixer_chunk: int | None = None) -> nn.Module:
    """Switch a HF causal LM to sequence-parallel attention over ``mesh``; returns ``model``.

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``
            (Llama, Mistral, Qwen2, ... built from config or pretrained).
        mesh: from :meth:`ulysses.SequenceParallelDims.build_mesh`; Ulysses over its
            ``"ulysses"`` axis, ring attention over ``"ring"`` when that is > 1, in the
            mesh's sequence layout (the one ``arctic.data`` shards batches in).
        head_chunk_size: ``None``, an int or ``"auto"``; see ``ulysses_attention``. One
            :class:`ulysses.BufferPool` is shared by all layers when chunking, emptied after
            each attention forward and backward (nothing is held between layers).
        seq_chunk: ``None``, an int or ``"auto"``: sequence blocks per rank's piece inside
            each head chunk (:mod:`ulysses.seq_chunk`); needs ``head_chunk_size``.
        attn_implementation: a name from :data:`IMPLEMENTATIONS` (the kernel).
        fuse_projections: compute q/k/v (with RoPE) per head chunk from the hidden states and
            apply o_proj to the chunks' output (:mod:`arctic.hf.fused`), so that no all-heads
            q/k/v exists; needs ``head_chunk_size`` and a Llama-family attention module
            (:data:`arctic.hf.fused.FUSABLE`). Replaces each attention module's forward (the
            instance's; class, parameters and state_dict keys unchanged) and marks it a
            ZeRO-3 leaf. Calls must pass ``use_cache=False``. False restores the stock forward.
        communication_dtype: the dtype the sequence-parallel exchanges carry (the
            ``comm_dtype`` of :func:`ulysses.ulysses_attention`); None: the activations'.
        attention_backend: the kernel by name (:data:`ulysses.BACKENDS`, e.g.
            ``"sdpa_cudnn"`` or ``"fa3"``); None: the one ``attn_implementation`` names, or
            the fastest for the device, dtype and head dim (:func:`ulysses.select_backend`).
            Checked here for the device and head dim (and the dtype: the parameters', or
            bf16 for fp32 parameters, which mixed precision computes in); each call checks
            the dtype it gets before any collective.
        mixer_parallelism: how a hybrid's linear mixers (gated delta nets, KDA, Mamba2,
            Mamba1) run their scans: ``"all_to_all"`` over heads (each rank scans the whole
            sequence for its heads; the degree must split the mixer's heads),
            ``"state_passing"`` (each rank scans its own piece, every head, from the state
            the earlier pieces leave: :mod:`ulysses.state_passing`), or ``"auto"``: the
            all-to-all where the heads split and there is no ring, else state passing.
        mixer_chunk: run each mixer layer (projections, convolution, scan, gated norm,
            output projection) in sequence chunks of at most this many positions of the
            rank's piece, each checkpointed, the window and state carried between them
            (:mod:`arctic.hf.mixer_chunks`; the scans pass their state); None: whole.

    Raises ``ValueError`` (before any communication) when the head counts do not fit the
    mesh, the chunk size is invalid, the config asks for an attention feature the SP attention
    does not implement (:func:`arctic.hf.features.check_model_features`), no attention module
    exists, or ``fuse_projections`` is asked for without chunking or on a module it does not
    support. Inputs must then be this rank's shard, with ``position_ids``.

    The model's ``loss_function`` becomes :class:`arctic.loss.SPCausalLMLoss`:
    ``model(..., labels=)`` on the pieces (HF's unshifted labels, cut as the inputs are) gives
    HF's loss of the whole sequence, equal on the SP ranks. Everything this changes on the
    model is undone by :func:`arctic.remove_sequence_parallel`.
    """
    check_mesh(mesh)
    if attn_implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {sorted(IMPLEMENTATIONS)}, got "
                         f"{attn_implementation!r}")
    config = text_config(model)
    modules = attention_modules(model)
    check_model_family(model, modules)
    vlm = is_vlm(model)
    vision = vision_inputs(model) if vlm else None
    chunks = {m: attention_chunk(config, m) for m in modules}
    heads = {m: attention_heads(m, config) for m in modules}
    layouts = {}
    for H, K, _, _ in set(heads.values()):  # ValueError names the valid degrees
        layouts[H, K] = head_layout(H, K, axis_size(mesh, "ulysses"))
    passing = mixer_passing(model, mesh, mixer_parallelism, mixer_chunk)
    backend = IMPLEMENTATIONS[attn_implementation]
    if attention_backend is not None:
        if backend is not None and attention_backend != backend:
            raise ValueError(f"attn_implementation={attn_implementation!r} runs the {backend!r} "
                             f"kernel, but attention_backend={attention_backend!r}; give one")
        backend = attention_backend
    if backend is not None:
        param = next(model.parameters())
        fp32_cuda = param.device.type == "cuda" and param.dtype == torch.float32
        dtype = torch.bfloat16 if fp32_cuda else param.dtype
        for head_dim in {max(d, dv) for _, _, d, dv in heads.values()}:  # common_head_dim's
            check_supported(backend, param.device, dtype, head_dim)
    if head_chunk_size is not None and head_chunk_size != "auto":
        for layout in layouts.values():
            resolve_chunk_size(head_chunk_size, layout, 1, 1, 1, torch.float32)
    check_comm_dtype(communication_dtype)
    check_seq_chunk(seq_chunk, head_chunk_size=head_chunk_size, local_len=None)
    if not isinstance(fuse_projections, bool):
        raise ValueError(f"fuse_projections must be True or False, got {fuse_projections!r}")
    if fuse_projections:
        if head_chunk_size is None:
            raise ValueError("fuse_projections=True needs head_chunk_size (an int or 'auto'): "
                             "the projections are fused into the head-chunk loop")
        for m in modules:
            check_fusable(m, num_heads=heads[m][0], num_kv_heads=heads[m][1],
                          hidden_size=config.hidden_size)
    # Shared by the layers, but emptied after each attention forward/backward: between calls
    # the MLP, the loss and checkpoint recomputes run, and held chunk buffers would only add
    # to their peak (benchmarks/memory.py measured +6.5% on the full stack).
    pool = BufferPool(keep_between_calls=False) if head_chunk_size is not None else None
    record_apply(model, "sp_attention")  # after the checks: a refused call changes nothing
    batch = BatchState(model, mesh, block_key=image_block_key(model) if vlm else None)
    passed_over = loss_arguments(model)
    for m in modules:
        m.sp_attention = SPAttentionSettings(
            mesh=mesh, num_heads=heads[m][0], num_kv_heads=heads[m][1],
            head_chunk_size=head_chunk_size,
            backend=backend, pool=pool, batch=batch, fuse_projections=fuse_projections,
            communication_dtype=communication_dtype, seq_chunk=seq_chunk,
            chunk_size=chunks[m], loss_arguments=passed_over)
        if fuse_projections:
            fuse(m)
        else:
            unfuse(m)
        for handle in getattr(m, "_sp_ran_hooks", ()):
            handle.remove()
        m._sp_ran_hooks = (m.register_forward_pre_hook(_before_attention, with_kwargs=True),
                           m.register_forward_hook(_after_attention))
    # A VLM's vision tower keeps its own attention: only the language model is switched.
    if modules:  # a state-space model (FalconMamba) has no attention to switch
        (language_model(model) if vlm else model).set_attn_implementation(REGISTERED)
    install_batch_hook(model, batch)
    install_mixers(model, mesh, batch, passed_over, passing, mixer_chunk)
    if vlm:
        install_vision(model, vision)
    # model(..., labels=) on the pieces: HF's loss of the whole sequence
    install_sp_causal_lm_loss(model, mesh)
    # any loss of the outputs gets the same gradients whether DeepSpeed adds or averages
    install_sp_gradient_average(model, axis_size(mesh, "ring") * axis_size(mesh, "ulysses"))
    return model
