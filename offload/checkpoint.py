"""Per-layer activation checkpointing, with the checkpointed inputs offloaded to the host.

Non-reentrant ``torch.utils.checkpoint`` keeps only a layer's inputs and recomputes the rest
in backward. It saves those inputs as autograd saved tensors *before* it installs its own
hooks, so a ``saved_tensors_hooks`` context around the checkpoint call sees exactly them:
that is where :mod:`offload.activations` moves them to the host. At S = 5M on 8 ranks they
are 5.1 GB per layer of Llama-3-8B (DESIGN.md), 164 GB for 32 layers, and live in host memory.

Tensors passed to a layer inside containers or as keyword arguments (HF passes RoPE's
``position_embeddings=(cos, sin)``) would be kept by the checkpoint's closure, out of reach of
the hooks; the wrapper flattens every tensor into a positional argument so all of them go
through the hooks.

Which modules are layers is the caller's knowledge, not this package's: it is given the
layers to wrap (``arctic.apply_activation_checkpointing`` finds a HF model's decoder layers and
enforces the order of the recipe's stages).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from offload.activations import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    HostBufferPool,
    OffloadSession,
)
from offload.disk import check_offload_dir, check_offload_io
from ulysses.patching import replace_method
from ulysses.torch_internals import tree_flatten, tree_unflatten


class _CheckpointedForward:
    """A layer instance's forward, replaced by the original under non-reentrant checkpoint."""

    def __init__(self, forward, session: OffloadSession | None, num_layers: int,
                 context_fn, drop_kwargs: tuple[str, ...], keep, name: str,
                 keeping: _Keeping) -> None:
        self.forward, self.session, self.num_layers = forward, session, num_layers
        self.context_fn, self.drop_kwargs = context_fn, drop_kwargs
        self.keep, self.name, self.keeping = keep, name, keeping

    def _checkpoint(self, run, tensors, store):
        """``checkpoint(run, *tensors)`` with the model's context and ``store``'s scopes."""
        fns = [f for f in (self.context_fn, None if store is None else store.contexts) if f]
        kwargs = {}
        if fns:
            kwargs["context_fn"] = fns[0] if len(fns) == 1 else _both(*fns)
        return checkpoint(run, *tensors, use_reentrant=False, **kwargs)

    def _check_kept(self, store) -> None:
        if not len(store):
            raise ValueError(f"{self.name} ran no attention that can keep its results "
                             f"(recompute_attention=False): only ulysses' attention (local, "
                             f"Ulysses, head-chunked, fused, ring) records them; switch the "
                             f"model's attention to it or recompute attention")

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to redo
            return self.forward(*args, **kwargs)
        # E.g. a KV cache: it would be written twice (forward and recompute) and would hold
        # every layer's k/v.
        for name in self.drop_kwargs:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        tensors = [leaves[i] for i in where]
        for i in where:  # the closure below must not hold the tensors themselves
            leaves[i] = None
        forward = self.forward

        def run(*ts):
            filled = list(leaves)
            for i, t in zip(where, ts):
                filled[i] = t
            a, kw = tree_unflatten(filled, spec)
            return forward(*a, **kw)

        store = None if self.keep is None else self.keep()
        if self.session is None:
            output = self._checkpoint(run, tensors, store)
            if store is not None:
                self._check_kept(store)  # the store holds the results until the recompute
            return output
        first = self.session.starts_new_pass()
        per_layer = sum(t.numel() * t.element_size() for t in tensors
                        if t.numel() * t.element_size() >= self.session.min_bytes)
        if first:
            # The first layer of a forward: every layer will save about as much, so refuse
            # now if all of them cannot fit, before any layer has run.
            self.session.pool.plan(per_layer * self.num_layers,
                                   what=f"offloading the inputs of {self.num_layers} "
                                        f"checkpointed layers")
        if first:
            self.keeping.planned = False
        with self.session.group() as hooks:
            output = self._checkpoint(run, tensors, store)
            if store is not None:
                self._check_kept(store)
                if not self.keeping.planned:  # the kept results too, known now that one ran
                    self.keeping.planned = True
                    self.session.pool.plan(
                        per_layer * self.num_layers + store.nbytes() * self.keeping.layers,
                        what=f"offloading the inputs of {self.num_layers} checkpointed "
                             f"layers and the attention results of {self.keeping.layers}")
                # Not prefetched with the layer's inputs (one layer ahead, where they would
                # add a hidden-sized tensor to the backward's peak) but when this layer's
                # recompute starts: attention comes after its norm and projections.
                packed = [hooks.pack(t, with_group=False) for t in store.take()]
                store.reload_with(lambda: [hooks.unpack(p) for p in packed],
                                  prefetch=lambda: [hooks.prefetch(p) for p in packed])
            return output


class _Keeping:
    """What the layers that keep results share: how many they are, and whether this forward
    pass has planned the host bytes of what they keep (at the first of them to run)."""

    def __init__(self, layers: int) -> None:
        self.layers, self.planned = layers, False


def _both(first, second):
    """One ``context_fn`` entering ``first``'s contexts, then ``second``'s."""
    def context_fn():
        (f1, r1), (f2, r2) = first(), second()
        return _stacked(f1, f2), _stacked(r1, r2)
    return context_fn


@contextlib.contextmanager
def _stacked(a, b):
    with a, b:
        yield


def check_activation_checkpointing(layers, *, offload_to_cpu: bool = False,
                                   pool: HostBufferPool | None = None,
                                   offload_dir=None, offload_io: str = "auto",
                                   prefetch: bool = True) -> list[nn.Module]:
    """``ValueError`` unless :func:`apply_activation_checkpointing` can wrap ``layers``; returns
    them as a list.

    Separate so that a caller can check before it records anything on the model (the recipe's
    stage order, :mod:`arctic.order`): a refused call must leave the model as it was.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: pass layers=[...], the modules to checkpoint one by "
                         "one (e.g. a decoder's layers)")
    if any(isinstance(m.forward, _CheckpointedForward) for m in layers):
        raise ValueError("apply_activation_checkpointing was already applied to this model")
    if pool is not None and not offload_to_cpu:
        raise ValueError("a pool was given but offload_to_cpu=False")
    if offload_dir is not None:
        if not offload_to_cpu:
            raise ValueError(f"offload_dir={offload_dir!r} needs offload_to_cpu=True: the disk "
                             f"tier holds what the host offload pool cannot")
        if pool is not None:
            raise ValueError("offload_dir was given with a pool: give the pool its directory "
                             "instead (HostBufferPool(disk_dir=...))")
        check_offload_dir(offload_dir)
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
    if not prefetch and not offload_to_cpu:
        raise ValueError("prefetch=False needs offload_to_cpu=True: it is the copy back of "
                         "offloaded layer inputs that it stops starting a layer ahead")
    if check_offload_io(offload_io, name="offload_io") != "auto" and offload_dir is None:
        raise ValueError(f"offload_io={offload_io!r} needs offload_dir, the directory whose "
                         f"files it reads and writes")
    return layers


def apply_activation_checkpointing(model: nn.Module, *, layers, offload_to_cpu: bool = False,
                                   pool: HostBufferPool | None = None,
                                   host_memory_limit: int | None = None,
                                   offload_dir=None, offload_io: str = "auto",
                                   min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
                                   drop_kwargs: tuple[str, ...] = (),
                                   group=None, keep=None,
                                   keeping: list[nn.Module] | None = None,
                                   prefetch: bool = True) -> nn.Module:
    """Checkpoint each of ``layers`` (non-reentrant); optionally keep their inputs on the host.

    Args:
        model: the module that holds ``layers``; it carries the offload session and, if it
            has one, the ``checkpoint_context_fn`` (below).
        layers: the modules to checkpoint, each as one unit (required, not empty). For a HF
            model, ``arctic.apply_activation_checkpointing`` passes its decoder layers.
        offload_to_cpu: move the tensors each checkpointed layer saves (its inputs: hidden
            states ``[B, S_local, E]``, RoPE cos/sin, position ids) to pinned host buffers,
            asynchronously on a side stream on CUDA; in backward, layer i's recompute starts
            the copy back of layer i-1's inputs.
        pool: the host buffers; default a new :class:`HostBufferPool` with
            ``host_memory_limit`` (default 80% of available host memory per local rank,
            agreed over ``group``).
        offload_dir: an existing, writable directory (best on a local NVMe) for the pool's
            disk tier (``HostBufferPool(disk_dir=offload_dir)``): past the host limit, layer
            inputs spill to files there, whole layers at a time, and in backward are read back
            on an I/O thread one layer ahead (:mod:`offload.disk`). Needs
            ``offload_to_cpu=True``; with ``pool``, give the pool the directory instead.
        offload_io: how the disk tier does its I/O (``HostBufferPool(disk_io=)``): ``"auto"``,
            ``"aio"`` (DeepSpeed's async I/O op; ``ValueError`` where unusable) or
            ``"threads"``. Other than ``"auto"``, needs ``offload_dir``.
        min_offload_bytes: smaller saved tensors stay on the device.
        drop_kwargs: keyword arguments passed to a layer as ``None`` while checkpointing
            (state the layer would otherwise update twice, in forward and in the recompute,
            such as a KV cache).
        keep: results a layer's forward computes that its recompute reuses instead of
            recomputing: a class (or factory) making one store per layer call, such as
            :class:`ulysses.keep.KeptAttention` (no attention recompute). A store gives
            ``contexts()`` (the checkpoint's ``context_fn`` pair), its record count
            (``len``), ``nbytes()``, ``take()`` and ``reload_with(load, prefetch=)``. With
            offload, what it keeps goes to the host with the layer's inputs and is copied
            back when the layer's recompute starts. A layer whose forward records nothing is
            a ``ValueError``: the store would have no effect.
        keeping: the layers of ``layers`` that keep (``keep``); default all of them. The
            others recompute everything (a hybrid model's layers without attention: linear
            attention, state-space mixers). Needs ``keep``.
        prefetch: with ``offload_to_cpu``, start copying layer i-1's inputs back as layer i's
            recompute starts (default); False: each is copied back when the recompute needs
            it, on the compute's stream, and the backward's peak holds one layer's inputs
            less (:class:`offload.OffloadSession`); a disk tier's reads still start a layer
            ahead, into host memory. False needs ``offload_to_cpu``.

    A model may carry ``model.checkpoint_context_fn``, ``torch.utils.checkpoint``'s
    ``context_fn``: every checkpoint call passes it on, so state the model keeps outside the
    layer's inputs can be restored for the recompute (:mod:`arctic.hf.batch` keeps each
    forward's packed documents this way).

    Returns ``model``; ``model.activation_offload`` is the :class:`OffloadSession` (or
    ``None``) whose ``pool.stats`` report bytes offloaded and peak host bytes. Raises
    ``ValueError`` (:func:`check_activation_checkpointing`) when ``layers`` is empty or a
    layer is already checkpointed, or ``offload_dir`` is not a writable directory; and, at
    the first layer of a forward, when the inputs of all layers would exceed the host limit
    (plus the disk budget, with ``offload_dir``).
    """
    layers = check_activation_checkpointing(layers, offload_to_cpu=offload_to_cpu, pool=pool,
                                            offload_dir=offload_dir, offload_io=offload_io,
                                            prefetch=prefetch)
    if keeping is not None:
        if keep is None:
            raise ValueError("keeping= names the layers that keep results, and needs keep=")
        keeping = list(keeping)
        if not keeping or any(not any(m is layer for layer in layers) for m in keeping):
            raise ValueError("keeping= must be a non-empty subset of layers=")
    keeps = layers if keeping is None else keeping
    shared = _Keeping(len(keeps))
    session = None
    if offload_to_cpu:
        if pool is None:
            pool = HostBufferPool(limit_bytes=host_memory_limit, group=group,
                                  disk_dir=offload_dir, disk_io=offload_io)
        session = OffloadSession(pool, min_offload_bytes, prefetch=prefetch)
    context_fn = getattr(model, "checkpoint_context_fn", None)
    for layer in layers:
        kept = keep if any(layer is m for m in keeps) else None
        replace_method(layer, _CheckpointedForward(layer.forward, session, len(layers),
                                                   context_fn, tuple(drop_kwargs), kept,
                                                   type(layer).__name__, shared))
    model.activation_offload = session
    return model


__all__ = ["apply_activation_checkpointing", "check_activation_checkpointing"]
