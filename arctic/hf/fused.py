"""``fuse_projections``: HF attention modules whose forward is :func:`ulysses.fused_attention`.

The stock forward of a Llama-family attention module computes the all-heads, seq-local q, k,
v (and the RoPE'd q and k, and the all-heads output before o_proj), and autograd keeps them
for backward; with head chunking those are what set a layer's peak. :func:`fuse` replaces
the forward of one module instance (its class, parameters and ``state_dict`` keys stay as
they are) by one that hands the hidden states, the rotary tables and the projection weights
to :func:`ulysses.fused_attention.fused_attention`, which computes each chunk's heads from
the hidden states inside the head-chunk loop.

Only modules whose forward is known to be "q/k/v Linear (+ bias) -> [per-head RMSNorm] ->
rotate-half RoPE from ``position_embeddings`` -> attention -> o_proj" are accepted
(:data:`FUSABLE`), or its gated form (:data:`GATED`: Qwen3.5's and Qwen3-Next's q_proj gives
each head's query and an output gate, the norms are zero-centered, RoPE may cover part of the
head dim, and ``o_proj`` reads ``out * sigmoid(gate)``); anything else, including a projection
that is not a plain ``nn.Linear`` (LoRA, quantized layers), is refused by
:func:`check_fusable`.

Parameter sharding: FSDP2 unshards a decoder layer's parameters for its whole forward and
backward, so reading ``q_proj.weight`` directly is fine. ZeRO-3 gathers a module's own
parameters in that module's hooks, and the fused forward calls no ``q_proj``; :func:`fuse`
therefore marks the attention module a ZeRO-3 leaf (``_z3_leaf``, DeepSpeed's
``set_z3_leaf_modules`` flag), so that ZeRO-3 gathers all of its projections when the
attention module runs, forward and backward, and reduces their gradients in a full backward
hook on the module. Such a hook only sees positional inputs, and HF passes ``hidden_states``
by keyword; without a tensor input requiring grad it fires as soon as the output's gradient
exists, before the weights have theirs (ZeRO-3 then reduces zeros and the later gradient
accumulation fails). A forward pre-hook therefore passes ``hidden_states`` positionally, as
a tensor that requires grad.
"""

from __future__ import annotations

import torch
from torch import nn

from arctic.hf.binding import of_module
from arctic.hf.features import read_attention_kwargs, unknown_arguments_error
from ulysses.fused_attention import fused_attention
from ulysses.patching import replace_method, restore_method

_STOCK_WINDOW = {
    "LlamaAttention": lambda m: None,
    "MistralAttention": lambda m: getattr(m.config, "sliding_window", None),
    "Qwen2Attention": lambda m: m.sliding_window,
    "Qwen3Attention": lambda m: m.sliding_window,
    "Qwen3_5Attention": lambda m: None,
    "Qwen3_5MoeAttention": lambda m: None,
    "Qwen3NextAttention": lambda m: None,
}
"""Per fusable class, the ``sliding_window`` its stock forward passes to the attention (per
layer for Qwen2/3, whose ``layer_types`` say which layers slide)."""
FUSABLE = tuple(_STOCK_WINDOW)
"""Attention classes whose forward the fused path reproduces."""
GATED = {"Qwen3_5Attention": "Qwen3_5RMSNorm", "Qwen3_5MoeAttention": "Qwen3_5MoeRMSNorm",
         "Qwen3NextAttention": "Qwen3NextRMSNorm"}
"""The gated ones (transformers 5: line for line the same), with their norm's class (a
zero-centered RMSNorm, ``(1 + weight)`` in fp32)."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_NORMS = ("q_norm", "k_norm")


def check_fusable(module: nn.Module, *, num_heads: int, num_kv_heads: int,
                  hidden_size: int) -> None:
    """``ValueError`` unless ``module`` has exactly the structure the fused forward computes."""
    name = type(module).__name__
    if name not in FUSABLE:
        raise ValueError(f"fuse_projections supports the attention modules {list(FUSABLE)}; "
                         f"{name} may compute something else: use fuse_projections=False")
    for proj in _PROJECTIONS:
        layer = getattr(module, proj, None)
        if type(layer) is not nn.Linear:
            raise ValueError(f"fuse_projections needs {name}.{proj} to be a torch.nn.Linear, got "
                             f"{type(layer).__name__} (a LoRA or quantized layer computes "
                             f"something else): merge it first, or use fuse_projections=False")
    H, K, E = num_heads, num_kv_heads, hidden_size
    D = getattr(module, "head_dim", None)
    if not isinstance(D, int):
        raise ValueError(f"{name} has no integer head_dim ({D!r}); use fuse_projections=False")
    q_rows = 2 * H * D if name in GATED else H * D
    expected = {"q_proj": (q_rows, E), "k_proj": (K * D, E), "v_proj": (K * D, E),
                "o_proj": (E, H * D)}
    for proj, shape in expected.items():
        got = tuple(getattr(module, proj).weight.shape)
        if got != shape:
            raise ValueError(f"{name}.{proj}.weight is {got}, expected {shape} from "
                             f"num_heads={H}, num_kv_heads={K}, head_dim={D}, hidden={E}")
    norms = [getattr(module, n, None) for n in _NORMS]
    if any(n is not None for n in norms) or name in GATED:
        norm_class = GATED.get(name, "Qwen3RMSNorm")
        for n_name, norm in zip(_NORMS, norms):
            ok = (norm is not None and type(norm).__name__ == norm_class
                  and tuple(norm.weight.shape) == (D,))
            if not ok:
                raise ValueError(f"{name}.{n_name} is not a per-head {norm_class} of size {D}; "
                                 f"use fuse_projections=False")
    known = {f"{p}.{w}" for p in _PROJECTIONS + _NORMS for w in ("weight", "bias")}
    extra = sorted(n for n, _ in module.named_parameters() if n not in known)
    if extra:
        raise ValueError(f"{name} has parameters the fused forward would ignore: {extra}; use "
                         f"fuse_projections=False")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{name} is not causal; fuse_projections supports causal attention")


INPUT_NORM = "sp_input_norm"
"""The keyword by which the tiled layer (:mod:`arctic.tiling.layer`) hands the fused forward
the layer's input norm (a :class:`ulysses.input_norm.InputNorm`), with the layer's input in
place of the normed hidden states: the fused block then norms the rows it reads."""


def _fused_forward(self, *args, **kwargs):
    """The attention module's forward under ``fuse_projections``: hidden ``[B, s, E]`` (this
    rank's piece) -> ``([B, s, E], None)``, like the stock forward (with ``sp_input_norm``,
    the hidden states are the layer's input, before that norm: :data:`INPUT_NORM`). The call
    is bound through the installed class's forward (:mod:`arctic.hf.binding`), so its
    arguments are found by role whatever this transformers release names them. The keyword
    arguments the stock forward would pass to the attention (its own dropout, scaling and
    sliding window, and whatever the layer passed on) are honoured or refused as there."""
    sp = self.sp_attention
    input_norm = kwargs.pop(INPUT_NORM, None)
    bound = of_module(self).bind(args, kwargs)
    unknown = bound.unknown()
    if unknown:
        raise unknown_arguments_error(type(self).__name__, unknown, "its fused forward")
    call = read_attention_kwargs(self, {
        **bound.extra, "dropout": self.attention_dropout if self.training else 0.0,
        "scaling": self.scaling, "sliding_window": _STOCK_WINDOW[type(self).__name__](self)},
        passed_over=sp.loss_arguments)
    hidden_states = bound.first
    position_embeddings = bound.role("position_embeddings")
    if position_embeddings is None:
        raise ValueError(f"{type(self).__name__} got no position_embeddings=(cos, sin); the "
                         f"fused path applies RoPE from them")
    if bound.role("attention_mask") is not None:
        raise ValueError("an explicit attention mask is not supported under sequence "
                         "parallelism; mark padding with labels=-100 and documents with "
                         "position_ids (arctic.data does both)")
    if bound.role("cache") is not None:
        raise ValueError("fuse_projections never forms the all-heads k/v, so it cannot fill a "
                         "KV cache: call the model with use_cache=False (arctic's SP loss does)")
    cos, sin = position_embeddings
    q_norm, k_norm = (getattr(self, n, None) for n in _NORMS)
    gated = type(self).__name__ in GATED
    if not gated and cos.shape[-1] != self.head_dim:
        raise ValueError(f"{type(self).__name__} got rotary tables of {cos.shape[-1]} dims for "
                         f"a head_dim of {self.head_dim}; its stock forward rotates the whole "
                         f"head: use fuse_projections=False")
    if call.sinks is not None:  # no fusable class passes sinks; refuse rather than drop them
        raise ValueError(f"{type(self).__name__} passed attention sinks, which "
                         f"fuse_projections does not apply; use fuse_projections=False")
    sp.ran = True
    y = fused_attention(
        hidden_states, cos, sin,
        wq=self.q_proj.weight, bq=self.q_proj.bias, wk=self.k_proj.weight, bk=self.k_proj.bias,
        wv=self.v_proj.weight, bv=self.v_proj.bias, wo=self.o_proj.weight, bo=self.o_proj.bias,
        q_norm_weight=None if q_norm is None else q_norm.weight,
        k_norm_weight=None if k_norm is None else k_norm.weight,
        norm_eps=1e-6 if q_norm is None else q_norm.eps if gated else q_norm.variance_epsilon,
        gated=gated, norm_zero_centered=gated,
        num_heads=sp.num_heads, num_kv_heads=sp.num_kv_heads, mesh=sp.mesh,
        head_chunk_size=sp.head_chunk_size, softmax_scale=call.scaling, backend=sp.backend,
        buffer_pool=sp.pool, segments=sp.batch.segments(), window=call.window,
        comm_dtype=sp.communication_dtype, seq_chunk=sp.seq_chunk, softcap=call.softcap,
        input_norm=input_norm)
    return y, None


def positional_input(module, args, kwargs):
    """Forward pre-hook: the input (``hidden_states``, by the installed forward's name) as the
    first positional argument, requiring grad when grad is on, so that a full backward hook
    (ZeRO-3's leaf reduction) fires after the module's backward; see the module docstring."""
    first = of_module(module).first
    if first in kwargs:
        args, kwargs = (kwargs.pop(first), *args), kwargs
    if args and torch.is_grad_enabled() and not args[0].requires_grad:
        # Only where nothing upstream needs a gradient (e.g. frozen embeddings): detaching
        # cuts no graph, and dx costs one extra GEMM per projection.
        args = (args[0].detach().requires_grad_(), *args[1:])
    return args, kwargs


def fuse(module: nn.Module) -> None:
    """Give ``module`` (checked by :func:`check_fusable`) the fused forward, and mark it a
    ZeRO-3 leaf so that ZeRO-3 gathers its projections with it."""
    unfuse(module)
    replace_method(module, _fused_forward, bind=True)
    module._z3_leaf = True
    module._sp_fused = module.register_forward_pre_hook(positional_input, with_kwargs=True)


def is_fused(module: nn.Module) -> bool:
    """Whether ``module`` runs the fused forward (:func:`fuse`)."""
    return getattr(module, "_sp_fused", None) is not None


def unfuse(module: nn.Module) -> None:
    """Undo :func:`fuse`, if it was applied: the class's forward again."""
    handle = getattr(module, "_sp_fused", None)
    if handle is not None:
        handle.remove()
        restore_method(module)
        del module._z3_leaf, module._sp_fused
