"""``arctic.initialize``: ``deepspeed.initialize`` with sequence parallelism applied.

From one DeepSpeed JSON it builds the mesh, makes the HF model sequence-parallel (attention,
MLP tiling, checkpointing, loss), and hands DeepSpeed an ``mpu`` built from the mesh. The
model's forward becomes the SP training step's loss:

    engine, optimizer, loader, scheduler = arctic.initialize(
        model=model, config="configs/cpu_demo.json", training_data=dataset)
    for batch in loader:                 # this rank's shards: input_ids, position_ids,
        loss = engine(**batch)           # shift_labels -> the SP group's token-mean loss
        engine.backward(loss)
        engine.step()

The loss goes through module calls only (base model, then the lm_head running the tiled
logits + loss), so ZeRO-3's hooks gather every parameter where it is used, also in the
backward recompute of tiles.
"""

from __future__ import annotations

import atexit
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from arctic.config import SequenceParallelConfig, load_ds_config, zero_stage
from arctic.data.loader import SequenceParallelDataLoader
from arctic.hf.vlm import is_vlm, vision_inputs
from arctic.memory import allocator
from arctic.memory.placement import offload_pool_limit, placement_from_ds_config
from arctic.recipe import apply_sp_recipe
from arctic.train.ds_shm import release_deepspeed_shm
from ulysses import DeepSpeedMPU, flat_mesh


def _zero3_reduction_settings(ds_config: dict, model: nn.Module, sp_size: int) -> dict:
    """Pin ZeRO-3 to its SP-aware gradient reduction; returns the (copied) config.

    DeepSpeed 0.19.8's stage 3 reduces a gradient bucket one of two ways
    (``stage3.py:__reduce_and_partition_ipg_grads``): the contiguous path divides by
    ``world / sequence_parallel_size`` like stages 0-2, but the reduce-scatter path divides by
    ``world``, ignoring SP. The second runs when ``reduce_scatter`` is true (the default) or a
    bucket exceeds ``reduce_bucket_size`` (one parameter larger than it, e.g. Llama-3's 525M
    element embedding against the 500M default). With SP both must be avoided, or gradients
    come out 1/sp too small.
    """
    if sp_size == 1 or zero_stage(ds_config) != 3:
        return ds_config
    zero = dict(ds_config["zero_optimization"])
    if zero.get("reduce_scatter") is True:
        raise ValueError("zero_optimization.reduce_scatter=true with sequence_parallel_size > 1: "
                         "DeepSpeed's stage-3 reduce-scatter path ignores sequence parallelism "
                         "and would scale gradients by 1/sp; remove the key or set it to false")
    if zero.get("contiguous_gradients") is False:
        raise ValueError("zero_optimization.contiguous_gradients=false with sequence_parallel_size "
                         "> 1 selects DeepSpeed's stage-3 path that ignores sequence parallelism; "
                         "remove the key or set it to true")
    largest = max(p.numel() for p in model.parameters())
    bucket = int(float(zero.get("reduce_bucket_size", 5e8)))
    if bucket < largest:
        if "reduce_bucket_size" in zero:
            raise ValueError(f"zero_optimization.reduce_bucket_size ({bucket}) is smaller than the "
                             f"largest parameter ({largest} elements); with sequence parallelism "
                             f"it must be at least that (DeepSpeed's stage-3 oversize path "
                             f"ignores SP)")
        bucket = largest
    zero.update(reduce_scatter=False, contiguous_gradients=True, reduce_bucket_size=bucket)
    return {**ds_config, "zero_optimization": zero}


def host_limit_beside_state(ds_config: dict, sp: SequenceParallelConfig, model: nn.Module,
                            mesh) -> int | None:
    """:func:`apply_sp_recipe`'s ``host_memory_limit`` under a DeepSpeed config: what the
    training state that ZeRO-3 offloads to the CPU leaves of the offload pool's default
    budget (:func:`arctic.memory.placement.offload_pool_limit`); ``None`` (the default) when the
    layer inputs are not offloaded or the state is not on the host. Call it on every rank
    (the budget is agreed over them), before DeepSpeed allocates the state."""
    if not (sp.activation_checkpointing and sp.offload_activations):
        return None
    zero = ds_config.get("zero_optimization") or {}
    blocks = [zero.get(k) for k in ("offload_optimizer", "offload_param")] \
        if isinstance(zero, dict) else [None, None]  # not a dict: refused just below
    devices = {b.get("device", "cpu") for b in blocks if isinstance(b, dict)}
    if "nvme" in devices or (blocks[1] and not blocks[0]):
        return None  # state on NVMe, or offload_param alone: not modelled; the pool's default
    placement = placement_from_ds_config(ds_config)  # a bad value here is the user's to fix
    return offload_pool_limit(placement, sum(p.numel() for p in model.parameters()),
                              dist.get_world_size(), group=flat_mesh(mesh, "dp_sp").get_group())


_LOADER_DEFAULTS = {"collate_fn": None, "shuffle": True, "seed": 0}


def _destroy_process_group() -> None:
    """At exit: the process group :func:`initialize` started, if the script left it up."""
    if dist.is_initialized():
        dist.destroy_process_group()


def initialize(*, model: nn.Module, config: str | Path | dict, model_parameters=None,
               training_data=None, optimizer=None, lr_scheduler=None, collate_fn=None,
               dist_init_required: bool | None = None, shuffle: bool = True, seed: int = 0):
    """``deepspeed.initialize`` for a HF causal LM, with sequence parallelism from ``config``.

    Args:
        model: a HF causal LM (``LlamaForCausalLM``, ...) on its device.
        config: the DeepSpeed JSON (path or dict) with ``sequence_parallel_size`` and the
            ``"ulysses"`` block (see :mod:`arctic.config`).
        model_parameters, optimizer, lr_scheduler: as for ``deepspeed.initialize``.
        training_data: a dataset; the returned dataloader is a
            :class:`arctic.data.SequenceParallelDataLoader` with the config's micro batch size
            (for a vision-language model, cutting with :func:`arctic.vision_inputs` of it).
        shuffle, seed: the loader's, as ``DistributedSampler``'s (over the data-parallel axis;
            ``loader.set_epoch(e)`` reshuffles). Without ``training_data`` they, and
            ``collate_fn``, must be left at their defaults.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` does.
        ``engine(**batch)`` returns the SP group's token-mean loss; ``engine.sp_mesh`` is the
        mesh. Every ``ValueError`` (bad config, heads that do not fit) is raised on every rank
        before DeepSpeed starts. On CUDA it turns on the allocator's expandable segments
        unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (:mod:`arctic.memory.allocator`). With ZeRO-3's
        ``offload_optimizer`` (and ``offload_param``) on the CPU, the activation offload
        pool's host limit is what that state leaves of it
        (:func:`arctic.memory.placement.offload_pool_limit`), as the planner counts them.
    """
    import deepspeed

    loader_settings = {"collate_fn": collate_fn, "shuffle": shuffle, "seed": seed}
    given = [k for k, v in loader_settings.items() if v != _LOADER_DEFAULTS[k]]
    if training_data is None and given:
        raise ValueError(f"{', '.join(given)}: the loader's settings, and initialize() builds "
                         f"no loader without training_data")
    allocator.use_expandable_segments()  # before DeepSpeed allocates its buffers
    ds_config = dict(load_ds_config(config))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        # Ours to end: a process group left to the interpreter's teardown can take its
        # backend's threads down with std::terminate after training has finished.
        atexit.register(_destroy_process_group)
    elif not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    release_deepspeed_shm()  # a CPU job's shared-memory buffers: mapped, their names go
    sp = SequenceParallelConfig.from_ds_config(ds_config, world_size=dist.get_world_size())
    ds_config = _zero3_reduction_settings(ds_config, model, sp.sequence_parallel_size)
    device = next(model.parameters()).device
    mesh = sp.dims(dist.get_world_size()).build_mesh(device.type)

    # DeepSpeed, given the SP mpu, sums gradients over the sp ranks and divides by dp only;
    # the model's outputs scale their gradients by 1/sp (arctic.loss.reduction), so that any
    # loss of them, ours or the user's, trains on the average over every rank.
    apply_sp_recipe(model, config=sp, mesh=mesh,
                    host_memory_limit=host_limit_beside_state(ds_config, sp, model, mesh))
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, config=ds_config,
        model_parameters=model.parameters() if model_parameters is None else model_parameters,
        optimizer=optimizer, lr_scheduler=lr_scheduler, mpu=DeepSpeedMPU(mesh),
        dist_init_required=dist_init_required)
    engine.sp_mesh = mesh
    loader = None
    if training_data is not None:
        # a VLM's batches are cut with its vision inputs (each rank's own images)
        loader = SequenceParallelDataLoader(
            training_data, mesh, batch_size=engine.train_micro_batch_size_per_gpu(),
            collate_fn=collate_fn, vision=vision_inputs(model) if is_vlm(model) else None,
            shuffle=shuffle, seed=seed)
    return engine, optimizer, loader, lr_scheduler


__all__ = ["apply_sp_recipe", "host_limit_beside_state", "initialize"]
