"""The recipe: everything a :class:`arctic.config.SequenceParallelConfig` asks of a HF model,
applied in the stage order (:mod:`arctic.order`), as torchtitan's ``parallelize.py`` calls its
``apply_*`` stages. The training glue (DeepSpeed, FSDP2, the HF Trainer: :mod:`arctic.train`)
calls it and then shards the parameters.
"""

from __future__ import annotations

from dataclasses import fields

from torch import nn

from arctic.config import SequenceParallelConfig
from arctic.hf.anatomy import attention_modules
from arctic.loss.head import apply_sp_loss
from arctic.memory.checkpointing import apply_activation_checkpointing
from arctic.tiling.layer import apply_tiled_layers
from arctic.tiling.mlp import apply_tiled_mlp, mlps_to_tile
from arctic.tiling.norms import apply_tiled_norms
from ulysses import flat_mesh, mesh_dims


def apply_sp_recipe(model: nn.Module, *, config: SequenceParallelConfig, mesh,
                    averaged_over_sp: bool | None = None,
                    host_memory_limit: int | None = None) -> nn.Module:
    """Apply everything ``config`` asks for to a HF causal LM, in the fixed order
    (:mod:`arctic.order`): SP attention, MLP tiling, the tiled SP loss, checkpointing with
    the layer inputs offloaded to the host when ``config.offload_activations`` (spilling
    past the host limit to ``config.offload_dir`` when set, with ``config.offload_io``'s
    I/O, and the attention results kept, not recomputed, when ``config.recompute_attention``
    is False). ``config.kernel_self_check`` is the mesh's (``config.dims(world).build_mesh``
    carries it to every attention on the mesh); a mesh built with another value is refused.
    Parameter sharding (ZeRO, FSDP2) comes after, from the caller. ``averaged_over_sp``: whether
    that gradient reduction averages the SP ranks' gradients (DDP, FSDP2) or adds them
    (DeepSpeed given an SP ``mpu``); None follows the reduction found on the model when the
    loss runs (:mod:`arctic.loss.reduction`), and a value given is checked against it.
    ``host_memory_limit`` (bytes per rank) caps the offload pool; default: 80% of the host's
    available memory per local rank, agreed over all ranks. Returns ``model``.

    A model without attention (Mamba, Mamba2, FalconMamba) is refused the settings that act
    on attention only (:func:`check_attention_settings`), and one without an MLP (the same)
    ``tiled_mlp``, before the model changes. Decoder layers include blocks of one sublayer
    (:func:`arctic.hf.anatomy.decoder_layers`): each is checkpointed, and Nemotron-H's MLP and
    MoE blocks are the MLPs tiled."""
    from arctic.hf.attention import apply_sequence_parallel, check_model_family

    if mesh_dims(mesh).kernel_self_check != config.kernel_self_check:
        raise ValueError(f"kernel_self_check is {config.kernel_self_check} in the config but "
                         f"{mesh_dims(mesh).kernel_self_check} on the mesh, which every "
                         f"attention on it reads; build the mesh from the config: "
                         f"config.dims(world_size).build_mesh(device_type)")
    check_model_family(model)  # a family SP cannot run: refused before any setting is checked
    # Settings that would have no effect on this model are refused before it changes.
    check_attention_settings(model, config)
    if config.tiled_mlp is not None:
        mlps_to_tile(model)
    apply_sequence_parallel(model, mesh=mesh, head_chunk_size=config.head_chunk_size,
                            seq_chunk=config.seq_chunk,
                            attn_implementation=config.attn_implementation,
                            fuse_projections=config.fuse_projections,
                            communication_dtype=config.comm_dtype,
                            attention_backend=config.attention_backend,
                            mixer_parallelism=config.mixer_parallelism,
                            mixer_chunk=config.mixer_chunk)
    if config.tiled_mlp is not None:
        apply_tiled_mlp(model, tiles=config.tiled_mlp)
        if config.tiled_norms:
            # With the MLP tiled, the RMSNorms' float32 temporaries set the step's peak (found
            # by the planner, arctic.plan); they are tiled with it, by their own byte budget.
            apply_tiled_norms(model)
        if config.tiled_layer:
            # The tail after attention as one tiled unit (its norm and MLP run untiled inside).
            apply_tiled_layers(model, tiles=config.tiled_mlp)
    if config.loss_tiles is not None:  # null: the model returns its logits
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(),
                      loss_tiles=config.loss_tiles, averaged_over_sp=averaged_over_sp)
    if config.activation_checkpointing:
        # The host limit is agreed over all ranks, so all refuse (or not) together.
        apply_activation_checkpointing(model, offload_to_cpu=config.offload_activations,
                                       host_memory_limit=host_memory_limit,
                                       offload_dir=config.offload_dir,
                                       offload_io=config.offload_io or "auto",
                                       recompute_attention=config.recompute_attention,
                                       group=flat_mesh(mesh, "dp_sp").get_group(),
                                       prefetch=config.offload_prefetch)
    return model


ATTENTION_SETTINGS = ("head_chunk_size", "attn_implementation", "attention_backend",
                      "recompute_attention")
"""The settings that act on attention only: the head chunks (and, through them, seq_chunk and
fuse_projections, which the config refuses without head chunks), the kernel, and keeping the
attention results under checkpointing. The token mixers run the model's own kernels on the
whole sequence of their heads and keep nothing."""


def check_attention_settings(model: nn.Module, config: SequenceParallelConfig) -> None:
    """``ValueError`` naming the :data:`ATTENTION_SETTINGS` that ``config`` sets away from
    their defaults, where ``model`` has no attention module (a state-space model), so that
    they would have no effect. A hybrid (Nemotron-H) has attention, where they act."""
    if attention_modules(model):
        return
    defaults = {f.name: f.default for f in fields(SequenceParallelConfig)}
    asked = {name: getattr(config, name) for name in ATTENTION_SETTINGS
             if getattr(config, name) != defaults[name]}
    if asked:
        given = ", ".join(f"{name}={value!r}" for name, value in asked.items())
        reset = ", ".join(f"{name}={defaults[name]!r}" for name in asked)
        raise ValueError(f"{type(model).__name__} has no attention module, so {given} would "
                         f"have no effect (its token mixers run all their heads at once with "
                         f"the model's own kernels); leave them at their defaults: {reset}")
