"""``tiled_layer``: the half of each decoder layer after attention, run as one sequence tile.

A Llama-family decoder layer computes, per token after attention,

    h = x + a,   y = h + mlp(norm2(h))       (x the layer input, a the attention output)

With only the MLP and the norms tiled (:mod:`arctic.tiling`), autograd still keeps ``h``
(the norm's input) and ``norm2(h)`` (the MLP's input) whole for the backward, and the
backward makes the MLP's input gradient, the norm's and their sum with ``dy`` one after the
other, each ``[B, S_local, E]``. The memory planner (``python -m arctic.plan``) finds these
hidden-sized tensors at the step's peak once attention is head-chunked and the layer inputs
are offloaded.

Here the whole tail is one autograd node over sequence tiles: the forward saves ``x`` and
``a`` only (``x`` is the checkpointed layer input, kept anyway), and the backward recomputes
each tile and produces one hidden-sized tensor, ``dh = dy + d(mlp(norm2(h)))/dh``, which is
the gradient of both ``x`` and ``a`` (autograd's sum at ``h`` gives the same) and goes to
both as the same tensor. Everything else of the tail (``h``, ``norm2(h)``, the MLP's
intermediates and their gradients) lives one tile at a time.

Where the attention module runs the fused projections (:mod:`arctic.hf.fused`), the layer
hands it the input norm with the layer's input (:mod:`ulysses.input_norm`): the fused block
norms the rows it reads, so ``norm1(x)`` is not saved whole either.

Only layer classes whose forward is exactly "norm1, attention, add, norm2, MLP, add"
(:data:`TILABLE`) are accepted, where the attention may be a token mixer instead
(:data:`MIXED`: Qwen3.5's layers run either a gated delta net or attention, by their
``block_type``); the tail calls the norm's and the MLP's own ``forward`` (the
untiled one when :func:`arctic.apply_tiled_mlp` already wrapped it), so forward hooks on
those two modules would be skipped and are refused. Parameter sharding: FSDP2 unshards the
decoder layer for its forward and backward; ZeRO-3 gathers parameters in each module's
hooks, so the layer is marked a ZeRO-3 leaf (as :mod:`arctic.hf.fused` marks the attention
module): ZeRO-3 gathers all of its parameters when the layer runs and reduces their
gradients in a full backward hook on it, for which ``hidden_states`` is passed positionally,
requiring grad.

Shape legend: B batch, S this rank's sequence piece, E hidden size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from arctic.hf.anatomy import decoder_layers, text_config
from arctic.hf.binding import of_module
from arctic.hf.fused import INPUT_NORM, is_fused, positional_input
from arctic.hf.mixers import takes_input_norm
from arctic.order import record_apply
from arctic.tiling.tiles import (
    DEFAULT_TILE_BUDGET_BYTES,
    TiledForward,
    resolve_tiles,
    tile_rows,
)
from ulysses.input_norm import InputNorm
from ulysses.patching import (
    instance_method,
    is_bound_replacement,
    journaled,
    replace_method,
)
from ulysses.torch_internals import forward_hooks

MIXED = {"Qwen3_5DecoderLayer": {"linear_attention": "linear_attn",
                                 "full_attention": "self_attn"}}
"""Decoder layers whose stock forward is that of :data:`TILABLE` with, by the layer's
``block_type``, a token mixer in attention's place, called with the hidden states, the cache,
the attention mask and the layer's other keywords (not the rotary tables nor the positions),
and returning one tensor; value: ``block_type`` -> the module it runs."""
TILABLE = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
           "Qwen3DecoderLayer", *MIXED)
"""Decoder layers whose stock forward is ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``
(transformers 5: the four are line for line the same), and :data:`MIXED`."""
_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_MIXER_ONLY = ("position_embeddings", "position_ids")
"""The roles a :data:`MIXED` layer passes to attention only."""


def _parts(layer: nn.Module) -> tuple[str, ...]:
    """The modules ``layer``'s forward runs: norm1, the mixer, norm2, the MLP."""
    mixers = MIXED.get(type(layer).__name__)
    if mixers is None:
        return _PARTS
    mixer = mixers.get(getattr(layer, "block_type", None))
    if mixer is None:
        raise ValueError(f"{type(layer).__name__}.block_type is "
                         f"{getattr(layer, 'block_type', None)!r}, not one of {list(mixers)}; "
                         f"set tiled_layer to false")
    return ("input_layernorm", mixer, "post_attention_layernorm", "mlp")


def _own_forward(module: nn.Module):
    """The module's forward without a tiling wrapper (tiles inside tiles would only add
    copies)."""
    forward = module.forward
    return forward.inner if isinstance(forward, TiledForward) else forward


class _TiledTailFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSE, a_BSE, tail, params, tiles):
        ctx.tail, ctx.params, ctx.tiles = tail, params, tiles
        ctx.save_for_backward(x_BSE, a_BSE)
        return _tail_no_grad(x_BSE, a_BSE, tail, tiles)

    @staticmethod
    def backward(ctx, dy_BSE):
        x_BSE, a_BSE = ctx.saved_tensors
        dh = None
        for i, start, n in tile_rows(x_BSE, x_BSE.shape[1], ctx.tiles):
            rows = slice(start, start + n)
            # ZeRO-1/2 reduce a gradient when its hook fires; it is whole after the last tile.
            for p in ctx.params:
                p.ds_grad_is_ready = i == ctx.tiles - 1
            with torch.no_grad():
                h_t = x_BSE[:, rows] + a_BSE[:, rows]
            with torch.enable_grad():
                leaf = h_t.requires_grad_()
                y_t = ctx.tail(leaf)
            # Parameter gradients accumulate into .grad, tile by tile.
            torch.autograd.backward(y_t, dy_BSE[:, rows])
            if dh is None:
                dh = torch.empty(x_BSE.shape, dtype=leaf.grad.dtype, device=x_BSE.device)
            dh[:, rows] = leaf.grad
            del y_t, leaf, h_t
        return dh.to(x_BSE.dtype), dh.to(a_BSE.dtype), None, None, None


def _tail_no_grad(x_BSE: Tensor, a_BSE: Tensor, tail, tiles: int) -> Tensor:
    y = None
    with torch.no_grad():
        for _, start, n in tile_rows(x_BSE, x_BSE.shape[1], tiles):
            rows = slice(start, start + n)
            y_t = tail(x_BSE[:, rows] + a_BSE[:, rows])
            if y is None:
                y = torch.empty(x_BSE.shape, dtype=y_t.dtype, device=x_BSE.device)
            y[:, rows] = y_t
            del y_t
    return y


class _Tail:
    """``h -> h + mlp(norm2(h))`` of one layer, with the modules' own forwards."""

    def __init__(self, layer: nn.Module) -> None:
        self.norm = _own_forward(layer.post_attention_layernorm)
        self.mlp = _own_forward(layer.mlp)

    def __call__(self, h_BSE: Tensor) -> Tensor:
        return h_BSE + self.mlp(self.norm(h_BSE))


def _tiled_layer_forward(self, *args, **kwargs):
    """The decoder layer's forward under ``tiled_layer``: the stock forward's first half, then
    the tiled tail. The call is bound through the installed layer class's forward
    (:mod:`arctic.hf.binding`) and handed on to the attention module as the stock forward
    hands it: every argument by keyword, each role under the attention's own name for it."""
    bound = of_module(self).bind(args, kwargs)
    name = self._sp_tiled_mixer  # by the class as applied (FSDP2 renames it)
    mixer = getattr(self, name)
    attention = of_module(mixer)
    hidden_states = bound.first
    keywords = bound.keywords_for(attention)
    if name != "self_attn":  # a token mixer: what the stock forward passes it
        for role in _MIXER_ONLY:
            keywords.pop(attention.roles.get(role, bound.signature.roles.get(role, role)), None)
    norm = _fusable_norm(self, mixer)
    if norm is not None:  # the fused block norms the rows it reads (ulysses.input_norm)
        a = mixer(**{attention.first: hidden_states}, **keywords, **{INPUT_NORM: norm})
    else:
        a = mixer(**{attention.first: self.input_layernorm(hidden_states)}, **keywords)
    if name == "self_attn":
        a, _ = a
    tiles = self._sp_tiled_layer
    x = hidden_states
    row = 3 * x.shape[0] * tiles.intermediate_size * x.element_size()
    n = resolve_tiles(tiles.tiles, x.shape[1], row, budget_bytes=tiles.budget_bytes,
                      group=tiles.group)
    tail = _Tail(self)
    if not torch.is_grad_enabled():
        return _tail_no_grad(x, a, tail, n)
    params = [p for m in (self.post_attention_layernorm, self.mlp) for p in m.parameters()
              if p.requires_grad]
    return _TiledTailFn.apply(x, a, tail, params, n)


def _fusable_norm(layer: nn.Module, mixer: nn.Module) -> InputNorm | None:
    """The layer's input norm for a fused attention block to run itself
    (:data:`arctic.hf.fused.INPUT_NORM`): None where the block is not fused, or where the norm
    has forward hooks, which a call of its own forward per tile would skip (it is then called
    as a module, whole, as the stock layer does)."""
    norm = layer.input_layernorm
    if not (is_fused(mixer) or takes_input_norm(mixer)) or any(forward_hooks(norm)):
        return None
    params = [p for p in norm.parameters() if p.requires_grad]

    def before_tile(last: bool) -> None:
        for p in params:  # ZeRO-1/2 reduce a gradient when its hook fires
            p.ds_grad_is_ready = last

    return InputNorm(_own_forward(norm), tuple(params), before_tile)


class _TileSettings:
    def __init__(self, tiles, intermediate_size: int, budget_bytes: int, group) -> None:
        self.tiles, self.intermediate_size = tiles, intermediate_size
        self.budget_bytes, self.group = budget_bytes, group


def check_tilable(layer: nn.Module) -> None:
    """``ValueError`` unless ``layer``'s forward is the one :func:`apply_tiled_layers`
    reproduces, and the tail's modules have no hooks it would skip."""
    name = type(layer).__name__
    if name not in TILABLE:
        raise ValueError(f"ulysses.tiled_layer supports the decoder layers {list(TILABLE)}; "
                         f"{name} may compute something else: set tiled_layer to false")
    if instance_method(layer) is not None and not is_bound_replacement(layer):
        raise ValueError(f"{name}.forward is already replaced ({type(layer.forward).__name__}); "
                         f"apply tiled_layer before activation checkpointing")
    parts = _parts(layer)
    missing = [p for p in parts if not isinstance(getattr(layer, p, None), nn.Module)]
    if missing:
        raise ValueError(f"{name} has no {missing}; tiled_layer needs {list(parts)}")
    extra = sorted(n for n, _ in layer.named_children() if n not in parts)
    if extra:
        raise ValueError(f"{name} has modules the tiled forward would not run: {extra}; set "
                         f"tiled_layer to false")
    mixer = parts[1]
    if of_module(getattr(layer, mixer)).first is None:
        raise ValueError(f"{name}.{mixer}.forward takes no named input (its signature is "
                         f"{of_module(getattr(layer, mixer)).signature}); the tiled forward "
                         f"passes it by name: set tiled_layer to false")
    for part in ("post_attention_layernorm", "mlp"):
        m = getattr(layer, part)
        if any(forward_hooks(m)):
            raise ValueError(f"{name}.{part} has forward hooks, which the tiled tail would "
                             f"skip (it calls the module's forward per tile); remove them or "
                             f"set tiled_layer to false")


@journaled
def apply_tiled_layers(model: nn.Module, *, tiles: int | str = "auto",
                       budget_bytes: int = DEFAULT_TILE_BUDGET_BYTES,
                       group: dist.ProcessGroup | None = None) -> nn.Module:
    """Run the part of every decoder layer after attention (residual add, post-attention
    norm, MLP, residual add) as one unit over sequence tiles; see the module docstring.

    Args:
        model: a HF causal LM whose decoder layers are :data:`TILABLE`.
        tiles: an int, or ``"auto"``: as :class:`arctic.tiling.TiledMLP` sizes them (about
            three ``[B, s, F]`` intermediates per tile in ``budget_bytes``), agreed over
            ``group`` (default: the world).

    Each layer keeps its class, parameters and ``state_dict`` keys; only the instance's
    ``forward`` changes. Apply after :func:`arctic.apply_sequence_parallel` and the tiled MLP
    (whose tiling the tail replaces for these layers) and before activation checkpointing.
    Returns ``model``; ``ValueError`` (model unchanged) if a layer is not tilable.
    """
    if tiles != "auto":
        resolve_tiles(tiles, 1, 1)  # type check, before touching the model
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to tile")
    for layer in layers:
        if not isinstance(getattr(layer, "_sp_tiled_layer", None), _TileSettings):
            check_tilable(layer)
    intermediate = getattr(text_config(model), "intermediate_size", None)
    if not isinstance(intermediate, int):
        raise ValueError(f"tiled_layer needs config.intermediate_size, got {intermediate!r}")
    record_apply(model, "tiling")
    settings = _TileSettings(tiles, intermediate, budget_bytes, group)
    for layer in layers:
        if not isinstance(getattr(layer, "_sp_tiled_layer", None), _TileSettings):
            layer._sp_tiled_mixer = _parts(layer)[1]
            replace_method(layer, _tiled_layer_forward, bind=True)
            layer._z3_leaf = True
            layer.register_forward_pre_hook(positional_input, with_kwargs=True)
        layer._sp_tiled_layer = settings
    return model


__all__ = ["TILABLE", "apply_tiled_layers", "check_tilable"]
