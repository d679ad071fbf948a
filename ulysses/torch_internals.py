"""Every piece of torch's private API this project reads, in one module.

torch renames its internals between releases (2.15 dropped FSDP2's ``_fsdp_param_group``
property and moved its mixed-precision policy onto each parameter), so nothing else in
``ulysses``, ``arctic``, ``offload``, the examples or the benchmarks imports a ``torch._*``
module or reads a private attribute of a torch object: they import it from here. A piece
that is not where it is looked for raises :class:`TorchInternalsError`, which names the torch
release and what was expected. ``tests/test_torch_internals.py`` checks each piece on every
torch CI runs.

What is read, and why:

- fake tensors (``torch._subclasses.fake_tensor``, ``torch._guards``,
  ``torch.utils._python_dispatch``): the planner traces a real step on fake tensors, and the
  runtime must tell a fake tensor from a real one and step out of fake mode for a probe;
- ``torch.utils._pytree``: activation checkpointing flattens a layer's arguments;
- the fake process group's store (``torch.testing._internal.distributed.fake_pg``): one rank
  of a large job, emulated by the planner and the GPU benchmarks;
- ``torch.distributed._tools.mem_tracker``: peak memory on CPU (the planner, benchmarks),
  with its step peak alone (:func:`step_mem_tracker`);
- torch's experimental context-parallel attention: the ring benchmark's peer;
- a module's forward hook dicts: the loss probe runs a head without its hooks, the tiled
  layer refuses hooks it would skip, and the SP loss finds DeepSpeed's engine hook;
- FSDP2's parameter groups: what a sharded unit was given (offload, reshard, dtype);
- ``DeviceMesh._flatten``: the mesh's "sp" and "dp_sp" axes as one group each;
- ``Tensor._base`` and ``Tensor._version``: a view's storage owner (buffer pools, the
  offload's choice of what stays) and the in-place counter (a re-saved tensor's host copy);
- ``torch.cuda.memory._set_allocator_settings``: expandable segments after CUDA started.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn


class TorchInternalsError(RuntimeError):
    """A private piece of torch is not where this release of the project reads it."""


def _missing(what: str, error: BaseException | None = None) -> TorchInternalsError:
    why = f" ({type(error).__name__}: {error})" if error is not None else ""
    return TorchInternalsError(f"torch {torch.__version__}: {what} is not where this package "
                               f"reads it{why}; this torch release changed an internal that "
                               f"ulysses/torch_internals.py must learn")


try:
    from torch._guards import active_fake_mode, detect_fake_mode
    from torch._subclasses.fake_tensor import (
        FakeTensorMode,
        is_fake,
        unset_fake_temporarily,
    )
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _disable_current_modes as disable_current_modes,
    )
    from torch.utils._pytree import tree_flatten, tree_unflatten
except ImportError as e:  # at import: every use of these runs on every step
    raise _missing("fake tensors or pytree (torch._subclasses, torch._guards, "
                   "torch.utils._python_dispatch, torch.utils._pytree)", e) from e


def fake_store():
    """torch's ``FakeStore``: ``init_process_group("fake", store=fake_store(), ...)`` makes a
    process group that moves no data (one rank of a large job)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise _missing("the fake process group's FakeStore "
                       "(torch.testing._internal.distributed.fake_pg)", e) from e
    return FakeStore()


def mem_tracker():
    """``(MemTracker, total_key, MemRefType, get_untyped_storages)`` from
    ``torch.distributed._tools``: MemTracker counts what is allocated inside its context, by
    module and kind; ``total_key`` indexes its totals."""
    try:
        from torch.distributed._tools.common_utils import get_untyped_storages
        from torch.distributed._tools.mem_tracker import (
            _TOTAL_KEY,
            MemTracker,
            _MemRefType,
        )
    except ImportError as e:
        raise _missing("torch.distributed._tools.mem_tracker", e) from e
    return MemTracker, _TOTAL_KEY, _MemRefType, get_untyped_storages


def _acyclic_module_hooks():
    """A context in which torch's ModTracker (MemTracker's module tracking) marks a module's
    backward done, for a module of one input that needs a gradient, with a hook that holds
    no autograd node. Its own (``register_multi_grad_hook``'s "all" mode, which counts the
    input nodes the engine will run) holds the input's node in the hook that the node
    holds: a reference cycle that keeps that node, and all it reaches (saved tensors, a
    checkpoint's recomputed ones), alive until the garbage collector runs, where a step
    without the tracker frees them at once. A traced step's peak then depended on when the
    collector ran: a second identical trace of a tiny Qwen3.5 in one process (4 layers, ring
    2, mixer chunks) held 15,421,500 bytes at the backward's peak against 15,029,820 in the
    first. With one input, "all" is the first call per backward (graph task): the same."""
    try:
        from torch.distributed._tools import mod_tracker as module

        original = module.register_multi_grad_hook
    except (ImportError, AttributeError) as e:
        raise _missing("torch.distributed._tools.mod_tracker.register_multi_grad_hook",
                       e) from e

    def register(tensors, fn, *, mode="all"):
        if mode != "all" or len(tensors) != 1:
            return original(tensors, fn, mode=mode)
        done: set[int] = set()

        def hook(grad):
            task = torch._C._current_graph_task_id()
            if task not in done:
                done.add(task)
                fn([grad])
        return tensors[0].register_hook(hook)

    @contextlib.contextmanager
    def swapped():
        module.register_multi_grad_hook = register
        try:
            yield
        finally:
            module.register_multi_grad_hook = original
    return swapped()


@functools.cache
def _step_mem_tracker_class():
    MemTracker, total_key, _, _ = mem_tracker()

    from torch.distributed.tensor import DTensor

    device_op = torch.ops.prim.device.default

    class StepMemTracker(MemTracker):
        def __enter__(self):
            self._acyclic = _acyclic_module_hooks()
            self._acyclic.__enter__()
            return super().__enter__()

        def __exit__(self, *args):
            try:
                super().__exit__(*args)
            finally:
                self._acyclic.__exit__(None, None, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # A fake tensor's ``.device`` reaches every dispatch mode as ``prim.device``
            # (half the ops of a planner's trace). It returns no tensor, so MemTracker's
            # tracking of its result does nothing: only the peak update after it is kept.
            if func is device_op and DTensor not in types:
                device = func(*args, **(kwargs or {}))
                if active_fake_mode() is self._fake_mode_on_entry:
                    self._update_peak_stats(None)
                return device
            return self._tracked_dispatch(func, types, args, kwargs)

        def _tracked_dispatch(self, func, types, args, kwargs):
            """MemTracker's dispatch of an op whose results it tracks; a subclass's hook."""
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                self._at_allocation(dev, snap[total_key])
                if self._peak_mem.get(dev, 0) < snap[total_key]:
                    self._peak_mem[dev] = snap[total_key]
                    self._peak_mem_snap[dev] = dict(snap)
                    self._at_new_peak(dev, snap[total_key])

        def _at_allocation(self, dev, total: int) -> None:
            """A subclass's note of each allocation's device total."""

        def _at_new_peak(self, dev, total: int) -> None:
            """A subclass's note of a new step peak."""

    return StepMemTracker


def step_mem_tracker_class():
    """The class of :func:`step_mem_tracker`'s trackers, to subclass (the planner's tracker
    notes more at each allocation and each new peak: ``_at_allocation``, ``_at_new_peak``)."""
    return _step_mem_tracker_class()


def step_mem_tracker():
    """A new :class:`MemTracker` that keeps the step's peak per device only: its
    ``get_tracker_snapshot("peak")`` is MemTracker's, byte for byte. MemTracker also keeps
    every module's own peak, walking all the modules it has seen at each allocation, which
    makes a long step quadratic (a quarter of benchmarks/memory.py's 4-layer step on CPU);
    nothing here reads those per-module peaks."""
    return _step_mem_tracker_class()()


def context_parallel_internals():
    """``(ring_attention_module, context_parallel_unshard)`` of torch's experimental context
    parallelism (``benchmarks/ring.py``'s peer): the module holds its templated ring attention
    and the ``custom_ops`` table a CPU kernel is registered in."""
    try:
        from torch.distributed.tensor.experimental._attention import (
            context_parallel_unshard,
        )
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as e:
        raise _missing("torch.distributed.tensor.experimental's context-parallel attention", e) \
            from e
    return _attention, context_parallel_unshard


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (``Tensor._base``), or ``t`` itself."""
    base = t._base
    return t if base is None else base


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (``Tensor._version``): it moves on every in-place
    write, which autograd checks saved tensors by."""
    return t._version


def flatten_mesh(mesh, name: str):
    """``mesh`` (a slice of a DeviceMesh) flattened into one axis called ``name``
    (``DeviceMesh._flatten``: torch has no public way to make one group of several axes)."""
    try:
        flatten = mesh._flatten
    except AttributeError as e:
        raise _missing("DeviceMesh._flatten", e) from e
    return flatten(name)


def forward_hooks(module: nn.Module) -> tuple[dict, dict]:
    """The module's forward pre-hooks and forward hooks (the dicts themselves)."""
    try:
        return module._forward_pre_hooks, module._forward_hooks
    except AttributeError as e:
        raise _missing("nn.Module._forward_pre_hooks / _forward_hooks", e) from e


def set_forward_hooks(module: nn.Module, pre_hooks: dict, hooks: dict) -> None:
    """Put back (or swap in) the dicts :func:`forward_hooks` returned."""
    module._forward_pre_hooks, module._forward_hooks = pre_hooks, hooks


def fsdp_param_groups(module: nn.Module) -> list:
    """The FSDP2 parameter groups of a ``fully_shard``-ed module (empty if it holds none).
    torch 2.13-2.15 keep them in ``FSDPState._fsdp_param_groups``; earlier releases had
    one, ``_fsdp_param_group``."""
    try:
        state = module._get_fsdp_state()
    except AttributeError as e:
        raise _missing("FSDPModule._get_fsdp_state", e) from e
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        if not hasattr(state, "_fsdp_param_group"):
            raise _missing("FSDPState._fsdp_param_groups")
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    return list(groups)


def fsdp_unit_settings(module: nn.Module) -> dict:
    """What a ``fully_shard``-ed unit was given: ``offload_policy`` (the policy's class name),
    ``reshard_after_forward`` (bool) and ``param_dtype`` (the dtype its parameters are
    unsharded in for compute, ``str``); None values for a unit with no parameter group."""
    groups = fsdp_param_groups(module)
    if not groups:
        return {"offload_policy": None, "reshard_after_forward": None, "param_dtype": None}
    group = groups[0]
    try:
        param = group.fsdp_params[0]
        # The policy is the group's up to torch 2.14 and each parameter's from 2.15 (where
        # it is set at the first forward); None param_dtype: the parameter's own dtype.
        policy = getattr(param, "mp_policy", None) or getattr(group, "mp_policy", None)
        dtype = policy.param_dtype if policy is not None else None
        if dtype is None:  # the sharded parameter's own dtype
            dtype = param.sharded_param.dtype
        return {"offload_policy": type(group.offload_policy).__name__,
                "reshard_after_forward": group.post_forward_mesh_info is not None,
                "param_dtype": str(dtype)}
    except (AttributeError, IndexError) as e:
        raise _missing("FSDPParamGroup.fsdp_params/offload_policy/post_forward_mesh_info/"
                       "mp_policy or FSDPParam.mp_policy/sharded_param", e) from e


def cuda_allocator_setter():
    """torch's setter of ``PYTORCH_CUDA_ALLOC_CONF``-style settings on a started allocator."""
    try:
        return torch.cuda.memory._set_allocator_settings
    except AttributeError as e:
        raise _missing("torch.cuda.memory._set_allocator_settings", e) from e


def set_cuda_allocator_settings(settings: str) -> None:
    """Apply ``PYTORCH_CUDA_ALLOC_CONF``-style ``settings`` to an allocator already started."""
    cuda_allocator_setter()(settings)


__all__ = ["FakeTensorMode", "TorchDispatchMode", "TorchInternalsError", "context_parallel_internals",
           "cuda_allocator_setter", "detect_fake_mode",
           "disable_current_modes", "fake_store", "forward_hooks", "fsdp_param_groups",
           "flatten_mesh", "fsdp_unit_settings", "is_fake", "mem_tracker", "set_cuda_allocator_settings",
           "set_forward_hooks", "step_mem_tracker", "step_mem_tracker_class",
           "tensor_version", "tree_flatten", "tree_unflatten",
           "unset_fake_temporarily", "view_base"]
