"""Activation checkpointing (and host offload) of a HF model's decoder layers, as a recipe stage.

:func:`offload.apply_activation_checkpointing` is torch-only: it wraps the layers it is given.
This is the one-call form for HF causal LMs: it finds the decoder layers
(:func:`arctic.hf.anatomy.decoder_layers`), refuses a model already under HF's own gradient
checkpointing, records the stage in the recipe's order (:mod:`arctic.order`) and drops the
KV cache under checkpointing, as HF's own checkpointing does: a cache would be written twice
(forward and recompute) and would hold every layer's k/v. The cache argument is found by its
role in each layer's installed forward (:mod:`arctic.hf.binding`), under any of its names.
"""

from __future__ import annotations

from torch import nn

from arctic.hf.anatomy import attention_modules, decoder_layers, hf_checkpointing
from arctic.hf.binding import ROLE_NAMES, of_module
from arctic.order import record_apply
from offload import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    HostBufferPool,
    check_activation_checkpointing,
)
from offload import apply_activation_checkpointing as _checkpoint_layers
from ulysses.keep import KeptAttention
from ulysses.patching import journaled


@journaled
def apply_activation_checkpointing(model: nn.Module, *, offload_to_cpu: bool = False,
                                   layers: list[nn.Module] | None = None,
                                   pool: HostBufferPool | None = None,
                                   host_memory_limit: int | None = None,
                                   offload_dir=None, offload_io: str = "auto",
                                   min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
                                   recompute_attention: bool = True,
                                   group=None, prefetch: bool = True) -> nn.Module:
    """Checkpoint every decoder layer (non-reentrant); optionally keep their inputs on the host.

    Args:
        model: a HF causal LM (or any module, with ``layers`` given), after SP attention and
            tiling and before parameter sharding (:mod:`arctic.order`).
        offload_to_cpu: move the tensors each checkpointed layer saves (its inputs: hidden
            states ``[B, S_local, E]``, RoPE cos/sin, position ids) to pinned host buffers,
            asynchronously on a side stream on CUDA; in backward, layer i's recompute starts
            the copy back of layer i-1's inputs.
        layers: the modules to checkpoint; default :func:`arctic.hf.anatomy.decoder_layers`.
        pool: the host buffers; default a new :class:`offload.HostBufferPool` with
            ``host_memory_limit`` (default 80% of available host memory per local rank,
            agreed over ``group``).
        offload_dir: a writable directory (best on a local NVMe) where layer inputs past the
            host limit spill, whole layers at a time, to be read back one layer ahead in
            backward (:mod:`offload.disk`); needs ``offload_to_cpu=True``.
        offload_io: the disk tier's I/O, ``"auto"``, ``"aio"`` (DeepSpeed's async I/O op) or
            ``"threads"``; other than ``"auto"``, needs ``offload_dir``.
        min_offload_bytes: smaller saved tensors stay on the device.
        prefetch: with ``offload_to_cpu``, layer i's recompute starts the copy back of layer
            i-1's inputs (default). False: each layer's inputs come back when its recompute
            needs them, on the compute's stream: the backward's peak holds one layer's inputs
            less, and the step waits for each copy. Needs ``offload_to_cpu`` and no
            ``offload_dir``.
        recompute_attention: False keeps each layer's attention results (``out``, one
            hidden-sized tensor, and the fp32 lse of this rank's heads) from the forward, on
            the host with the layer input when offloading, and the recompute in backward skips
            the attention kernels and exchanges (:mod:`ulysses.keep`): norms, projections,
            RoPE and MLP are recomputed, attention is not. Gradients are bit-identical. It
            needs the model's attention to be ours (:func:`arctic.apply_sequence_parallel`).
            A hybrid model's layers without attention (linear attention, state-space and
            convolution mixers) have nothing to keep: they recompute as they would with True.

    Returns ``model``; ``model.activation_offload`` is the :class:`offload.OffloadSession` (or
    ``None``) whose ``pool.stats`` report bytes offloaded and peak host bytes. Raises
    ``ValueError``, leaving the model as it was, when no layer is found, when a layer is
    already checkpointed (here or with HF's ``gradient_checkpointing_enable``), or out of
    order, or when ``offload_dir`` is not a writable directory; and, at the first layer of a
    forward, when the inputs of all layers would exceed the host limit (plus the disk budget
    with ``offload_dir``). See :func:`offload.apply_activation_checkpointing` for the rest.
    """
    layers = decoder_layers(model) if layers is None else list(layers)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layer (a module with a token "
                         f"mixer and an mlp, or a block of one mixer) to checkpoint; pass "
                         f"layers=[...]")
    if hf_checkpointing(model):
        raise ValueError("HF gradient checkpointing is already enabled on this model; call "
                         "model.gradient_checkpointing_disable() first (checkpointing twice "
                         "recomputes every layer twice)")
    check_activation_checkpointing(layers, offload_to_cpu=offload_to_cpu, pool=pool,
                                   offload_dir=offload_dir, offload_io=offload_io,
                                   prefetch=prefetch)
    if not isinstance(recompute_attention, bool):
        raise ValueError(f"recompute_attention must be True or False, got "
                         f"{recompute_attention!r}")
    keeping = None
    if not recompute_attention:
        missing = [type(m).__name__ for layer in layers for m in attention_modules(layer)
                   if getattr(m, "sp_attention", None) is None]
        keeping = [layer for layer in layers if attention_modules(layer)]
        if missing or not keeping:
            which = sorted(set(missing)) or "none found"
            raise ValueError("recompute_attention=False keeps the results of ulysses' attention "
                             "only; call arctic.apply_sequence_parallel(model, mesh=...) first "
                             f"(attention modules without it: {which})")
    record_apply(model, "checkpointing")  # after the checks: a refused call changes nothing
    return _checkpoint_layers(model, layers=layers, offload_to_cpu=offload_to_cpu, pool=pool,
                              host_memory_limit=host_memory_limit, offload_dir=offload_dir,
                              offload_io=offload_io,
                              min_offload_bytes=min_offload_bytes, drop_kwargs=cache_kwargs(layers),
                              group=group, keep=None if recompute_attention else KeptAttention,
                              keeping=keeping, prefetch=prefetch)


def cache_kwargs(layers: list[nn.Module]) -> tuple[str, ...]:
    """The keyword names under which ``layers`` may get a KV cache: each layer class's own
    name for the cache role (found by name or by its ``Cache`` annotation), and the role's
    other names, which the installed forward renames to it."""
    names = dict.fromkeys(ROLE_NAMES["cache"])
    for layer in layers:
        own = of_module(layer).name_of("cache")
        if own is not None:
            names[own] = None
    return tuple(names)


__all__ = ["apply_activation_checkpointing", "cache_kwargs"]
