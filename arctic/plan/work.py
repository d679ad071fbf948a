"""The work a training step does, by the class of hardware rate that bounds it.

The speed model (:mod:`arctic.plan.speed`) divides each class by the device's rate for it;
this module counts the classes, on a real step (``benchmarks/step_gpu.py``) or a traced one
(the planner, under ``FakeTensorMode``: shapes without data, so the counts are exact):

- ``attention_fwd`` / ``attention_bwd``: FLOPs of attention kernel calls, counted at the call
  (:func:`ulysses.kernels.observe_attention`) from q's and k's shapes, causal-aware, whatever
  the backend computes them with (its own ops are not counted again);
- ``gemm``: FLOPs of matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions,
  by torch's own formulas, ``torch.utils.flop_counter``) *and their in-place forms*
  (``addmm_``, ``baddbmm_``: the tiled loss head accumulates its weight gradient so, and
  ``FlopCounterMode`` skips them);
- ``memory``: bytes read and written by every other op that launches a kernel (views and
  allocations without a fill launch none): element-wise ops, norms, softmax, copies;
- ``host_copy``: bytes moved between the device and the host (offloaded activations and
  their prefetch: a real step's cross-device copies; a trace adds its offload pools' counts,
  since there nothing is copied);
- ``host_restore``: bytes copied back from the host that the step waits for (the offloaded
  layer inputs without ``offload_prefetch``: on the compute's stream, not beside it);
- ``collective``: bytes this rank sends in collectives (all-to-all, all-gather,
  reduce-scatter, all-reduce, send);
- ``ops``: kernels launched (each op counted in ``gemm`` or ``memory``, and each collective):
  the per-op cost that dominates small shapes (Python, dispatch, launch).
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from arctic.hf.anatomy import text_config_of
from ulysses.kernels import observe_attention
from ulysses.torch_internals import TorchDispatchMode, tree_flatten
from ulysses.trace_shortcuts import work_weight

CLASSES = ("attention_fwd", "attention_bwd", "gemm", "memory", "host_copy", "host_restore",
           "collective", "ops")


@dataclass
class Work:
    """A step's work per class (see the module docstring); FLOPs, bytes or ops."""

    attention_fwd: float = 0.0
    attention_bwd: float = 0.0
    gemm: float = 0.0
    memory: float = 0.0
    host_copy: float = 0.0
    host_restore: float = 0.0
    collective: float = 0.0
    ops: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(**{k: getattr(self, k) + getattr(other, k) for k in CLASSES})

    def __sub__(self, other: Work) -> Work:
        return Work(**{k: getattr(self, k) - getattr(other, k) for k in CLASSES})

    def scaled(self, factor: float) -> Work:
        return Work(**{k: getattr(self, k) * factor for k in CLASSES})

    @property
    def flops(self) -> float:
        """FLOPs executed: attention (recomputes included) and matrix products."""
        return self.attention_fwd + self.attention_bwd + self.gemm

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    """Forward FLOPs of one attention call: ``2 Sq Sk H (Dqk + Dv)`` per row (the scores and
    the weighted sum), half of it under a causal mask (``Sq == Sk``: the diagonal's half)."""
    B, Sq, H, D = q.shape
    pairs = Sq * (Sq + 1) / 2 if causal else Sq * k.shape[1]
    return 2.0 * B * pairs * H * (D + v.shape[-1])


BACKWARD_FACTOR = 2.5
"""Attention backward FLOPs over forward's (flash attention's backward: five products of the
forward's two, the scores recomputed)."""

_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "detach", "alias", "lift_fresh", "set_", "resize_", "_local_scalar_dense",
              "record_stream", "sym_size", "sym_stride", "sym_numel", "is_same_size",
              "_has_compatible_shallow_copy_type",
              "_unsafe_view", "_reshape_alias", "view", "as_strided"}
"""Ops that launch no kernel: allocations without a fill, metadata."""

_COPIES = {"copy_", "_to_copy", "to"}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_size(args) -> int:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):
                pass
    return dist.get_world_size() if dist.is_initialized() else 1


def _collective_bytes(name: str, args) -> float:
    """Bytes this rank sends in c10d op ``name`` (ring algorithms' volume)."""
    tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    w = _group_size(args)
    if w <= 1 or not tensors:
        return 0.0
    share = (w - 1) / w
    if name.startswith("alltoall"):  # (outputs, inputs): the inputs less our own block
        half = len(tensors) // 2
        return share * sum(map(_nbytes, tensors[half:] if half else tensors))
    if name.startswith(("allgather", "_allgather")):  # (outputs, inputs)
        return share * sum(map(_nbytes, tensors[:max(1, len(tensors) // 2)]))
    if name.startswith(("reduce_scatter", "_reduce_scatter")):  # (outputs, inputs)
        half = len(tensors) // 2
        return share * sum(map(_nbytes, tensors[half:] if half else tensors))
    if name.startswith("allreduce"):
        return 2 * share * sum(map(_nbytes, tensors))
    if name.startswith(("send", "broadcast")):
        return float(sum(map(_nbytes, tensors)))
    return 0.0  # recv, barrier: the peer's send counts it


class _WorkMode(TorchDispatchMode):
    def __init__(self, work: Work) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.work = work
        self.in_attention = 0
        self.gemms = {p: f for p, f in flop_registry.items()
                      if "attention" not in str(p) and "flex" not in str(p)}
        self.inplace = {getattr(torch.ops.aten, str(p).split(".")[-1] + "_", None): f
                        for p, f in self.gemms.items()}
        self.inplace.pop(None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.in_attention:
            return out
        packet = func._overloadpacket
        name = packet.__name__
        namespace = func.namespace
        w = self.work
        times = work_weight()  # > 1: an iteration that stands for left-out repeats of it
        if namespace == "c10d":
            sent = _collective_bytes(name, args)
            if sent:
                w.collective += times * sent
                w.ops += times
            return out
        formula = self.gemms.get(packet) or self.inplace.get(packet)
        if formula is not None:
            w.gemm += times * formula(*args, **kwargs, out_val=out)
            w.ops += times
            return out
        if func.is_view or name in _NO_KERNEL or namespace not in ("aten", "prims"):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                   if isinstance(t, torch.Tensor)]
        moved = times * sum(map(_nbytes, tensors))
        if name in _COPIES and len({t.device.type for t in tensors}) > 1:
            w.host_copy += moved / 2  # read on one side, written on the other
        else:
            w.memory += moved
        w.ops += times
        return out


@contextlib.contextmanager
def count_work():
    """Count the work of everything run inside the block; yields the :class:`Work`, which
    fills as it runs. Enter it inside a ``FakeTensorMode`` to count a trace."""
    work = Work()
    mode = _WorkMode(work)

    @contextlib.contextmanager
    def attention(direction, q, k, v, causal, backend):
        times = work_weight()
        flops = times * attention_flops(q, k, v, causal)
        if direction == "forward":
            work.attention_fwd += flops
        else:
            work.attention_bwd += BACKWARD_FACTOR * flops
        work.ops += times
        mode.in_attention += 1
        try:
            yield
        finally:
            mode.in_attention -= 1

    with observe_attention(attention), mode:
        yield work


def model_flops(config, tokens_per_rank: int, seq_len: int, sp: int) -> float:
    """The model FLOPs of one rank's step, the MFU convention: ``6 P s`` for the matrix
    products of the ``P`` parameters of the language model but its input embedding (the
    output head counted, tied or not) over the rank's ``s`` tokens, plus ``3 x`` the causal
    attention forward of every attention layer (``layer_types``' attention layers in a
    hybrid; none without attention heads) over the whole sequence, split over the ``sp``
    ranks. Recomputation is not counted (it is the price of the memory, not model work);
    a VLM's vision tower is not counted (its tokens are not the sequence's)."""
    text = text_config_of(config)
    params = _matmul_params(json.dumps(config.to_dict(), sort_keys=True, default=str))
    H = getattr(text, "num_attention_heads", None) or 0
    D = getattr(text, "head_dim", None) or (text.hidden_size // H if H else 0)
    types = list(getattr(text, "layer_types", None) or ())
    layers = (sum(t in ("full_attention", "attention", "sliding_attention") for t in types)
              if types else text.num_hidden_layers)
    attention = layers * 2 * seq_len ** 2 * H * D / sp  # causal: half of 4 S^2 H D
    return 6 * params * tokens_per_rank + 3 * attention


@functools.lru_cache(maxsize=64)
def _matmul_params(config_json: str) -> int:
    """The parameters of the language model's matrix products: its decoder's but the input
    embedding, and the output head (counted even when tied: its matmul still runs). Built on
    the meta device once per config."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = transformers.AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # a vision-language model
            model = AutoModelForImageTextToText.from_config(config)
    embed = model.get_input_embeddings().weight
    decoder = sum(p.numel() for p in model.get_decoder().parameters())
    return decoder - embed.numel() + model.get_output_embeddings().weight.numel()


__all__ = ["BACKWARD_FACTOR", "CLASSES", "Work", "attention_flops", "count_work", "model_flops"]
