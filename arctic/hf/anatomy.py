"""Where the recipe finds things in a HuggingFace causal LM: its decoder layers, their
attention modules and norms, and whether HF's own gradient checkpointing is on.

transformers gives no API for "the decoder layers" or "the attention modules" that holds
across model families, so each is found by the attribute names that the families share. They
are defined once, here, so that every stage of the recipe (SP attention, tiling,
checkpointing, FSDP2 units) agrees on what a layer is; the torch-only packages (``offload``,
``ulysses``) are given the modules and never look for them.
"""

from __future__ import annotations

from torch import nn

NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "operator_norm", "ffn_norm")
"""The per-token norms of a HF decoder layer that see ``[B, S, E]``: before the token mixer
and before the MLP (Llama, Mistral, Qwen2/3, ...; LFM2 calls them ``operator_norm`` and
``ffn_norm``)."""
MIXER_NAMES = ("self_attn", "linear_attn", "conv", "mamba")
"""What a HF decoder layer calls its token mixer: its attention, or a hybrid model's
linear-attention layer (Qwen3.5, Qwen3-Next, OLMo-hybrid), short convolution (LFM2) or
state-space layer (Jamba, Falcon-H1)."""
RECURRENT_NAMES = ("Mamba", "DeltaNet", "LinearAttention", "DeltaAttention", "Lightning",
                   "RecurrentBlock", "RGLRU", "SSM", "xLSTM", "Mixer", "ShortConv")
"""Class-name parts of token mixers other than attention: state-space (Mamba), gated delta
and linear-attention layers, recurrent blocks, short convolutions."""
MLP_NAMES = ("mlp", "feed_forward")
"""What a HF decoder layer calls its MLP (or MoE block): ``mlp``, or ``feed_forward``
(Llama4)."""
BLOCK_MIXER = "mixer"
"""What a block of one sublayer calls it: the blocks of Mamba, Mamba2, FalconMamba (a
state-space mixer each) and Nemotron-H (a Mamba2 mixer, an attention, an MLP or an MoE,
one per ``config.layers_block_type``), which hold that sublayer and a ``norm``, no MLP."""
MLP_CLASS_PARTS = ("MLP", "MoE", "Moe", "FeedForward")
"""Class-name parts by which a block's sublayer is an MLP or MoE block (``NemotronHMLP``,
``NemotronHMoE``): a per-token function that tiles along the sequence."""
FINAL_NORM_NAMES = ("norm", "norm_f", "embedding_norm")
"""What a HF decoder calls its final norm: ``norm``, ``norm_f`` (Mamba, Mamba2,
FalconMamba, Nemotron-H), or ``embedding_norm`` (LFM2, which applies it after its layers)."""

def base_model(model: nn.Module) -> nn.Module:
    """The decoder under a causal LM's head: HF's ``base_model``, or ``model.model`` where that
    finds nothing (``Llama4ForCausalLM``'s ``base_model_prefix`` is ``"language_model"``, an
    attribute of the multimodal model, while its own decoder sits at ``.model``). ``model``
    itself when it has neither."""
    base = getattr(model, "base_model", model)
    inner = getattr(model, "model", None)
    if base is model and isinstance(inner, nn.Module):
        return inner
    return base


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder: a vision-language model's ``language_model`` (Qwen2.5-VL, Qwen3-VL,
    Gemma3: its base model holds it beside the vision tower), else :func:`base_model`. The
    recipe's stages work on it alone; a vision tower keeps its own layers and attention."""
    base = base_model(model)
    inner = getattr(base, "language_model", None)
    return inner if isinstance(inner, nn.Module) else base


def text_config_of(config):
    """The text decoder's part of a config: a VLM's ``text_config``, else ``config``."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def text_config(model: nn.Module):
    """The config of the text decoder: a VLM's ``text_config``, else the model's own."""
    return text_config_of(model.config)


def is_block(module: nn.Module) -> bool:
    """Whether ``module`` is a block of one sublayer (:data:`BLOCK_MIXER`) with no MLP beside
    it."""
    return (isinstance(getattr(module, BLOCK_MIXER, None), nn.Module) and
            not any(isinstance(getattr(module, n, None), nn.Module) for n in MLP_NAMES))


def is_mlp(module: nn.Module) -> bool:
    """Whether a block's sublayer is an MLP or MoE block (:data:`MLP_CLASS_PARTS`), not a
    token mixer or attention: only then does it act on each token alone."""
    name = type(module).__name__
    return (any(part in name for part in MLP_CLASS_PARTS) and not is_recurrent(module) and
            not hasattr(module, "q_proj") and not is_latent_attention(module))


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """The MLP (or MoE block) of a decoder layer: its first of :data:`MLP_NAMES`, or a block's
    sublayer where that is an MLP (:func:`is_mlp`: Nemotron-H's ``"mlp"`` and ``"moe"``
    blocks). None for a block whose sublayer mixes tokens (a state-space mixer, attention)."""
    for name in MLP_NAMES:
        mlp = getattr(layer, name, None)
        if isinstance(mlp, nn.Module):
            return mlp
    if is_block(layer) and is_mlp(getattr(layer, BLOCK_MIXER)):
        return getattr(layer, BLOCK_MIXER)
    return None


SIDE_MLP_NAMES = ("block_sparse_moe", "shared_mlp")
"""A decoder layer without an MLP of :data:`MLP_NAMES` may hold these side by side
(GraniteMoeHybrid: an MoE block and a shared MLP, each on the same normed input, their sum the
layer's MLP)."""
SHARED_BLOCK_NAMES = ("shared_transformer",)
"""A decoder layer without an MLP of its own may run a block shared with other layers that
holds one (Zamba2's hybrid layers: the shared attention block, its ``feed_forward``)."""


def layer_mlps(layer: nn.Module) -> list[nn.Module]:
    """The per-token feed-forward modules of a decoder layer, each a ``[B, S, E] -> [B, S, E]``
    function of its tokens alone: :func:`layer_mlp`'s, else that of a shared block it runs
    (:data:`SHARED_BLOCK_NAMES`) and those of :data:`SIDE_MLP_NAMES` it holds. What the tiled
    MLP tiles (:func:`arctic.tiling.mlps_to_tile`)."""
    mlp = layer_mlp(layer)
    if mlp is not None:
        return [mlp]
    shared = [layer_mlp(getattr(layer, n)) for n in SHARED_BLOCK_NAMES
              if isinstance(getattr(layer, n, None), nn.Module)]
    return [m for m in shared if m is not None] + \
        [getattr(layer, n) for n in SIDE_MLP_NAMES
         if isinstance(getattr(layer, n, None), nn.Module)]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a HF causal LM (of a VLM's language model), in module order:
    modules with both a token mixer (:data:`MIXER_NAMES`) and an MLP (the Llama shape), and
    the elements of the decoder's layer lists that are blocks of one sublayer
    (:func:`is_block`: Mamba, Mamba2, FalconMamba, Nemotron-H). A block is found only as an
    element of a ``ModuleList``, as the decoder runs it, never inside another module's
    forward."""
    decoder = language_model(model)
    stack = getattr(decoder, "layers", None)
    if isinstance(stack, nn.ModuleList) and len(stack) and all(_mixes(m) for m in stack):
        return list(stack)  # the decoder's own list, each element mixing tokens (Zamba2's
        # hybrid layers hold a shared attention block and a Mamba2 layer; GraniteMoeHybrid's
        # MLP is its block_sparse_moe beside a shared_mlp)
    listed = {m for lst in decoder.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    return [m for m in decoder.modules()
            if (layer_mlp(m) is not None and
                any(isinstance(getattr(m, n, None), nn.Module) for n in MIXER_NAMES)) or
            (m in listed and is_block(m))]


def _mixes(layer: nn.Module) -> bool:
    """Whether a decoder layer holds a token mixer (:data:`MIXER_NAMES`, or a block's), at
    any depth."""
    return any(isinstance(getattr(m, n, None), nn.Module)
               for m in layer.modules() for n in (*MIXER_NAMES, BLOCK_MIXER))


def layer_norms(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's per-token norms: its :data:`NORM_NAMES`, or a block's ``norm``."""
    names = ("norm",) if is_block(layer) else NORM_NAMES
    return [getattr(layer, n) for n in names if isinstance(getattr(layer, n, None), nn.Module)]


LATENT_NAMES = ("kv_a_proj_with_mqa", "kv_b_proj")
"""The projections of multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash,
MiniCPM3, ...): keys and values come from one compressed latent, not from k/v projections."""


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is multi-head latent attention (:data:`LATENT_NAMES`)."""
    return all(isinstance(getattr(module, n, None), nn.Module) for n in LATENT_NAMES)


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module``'s class names a token mixer other than attention
    (:data:`RECURRENT_NAMES`). A norm is per token whatever its name (``MambaRMSNorm``), and
    latent attention is attention (Kimi Linear's is ``KimiLinearAttention``)."""
    name = type(module).__name__
    return (any(part in name for part in RECURRENT_NAMES) and "Norm" not in name and
            not is_latent_attention(module))


def attention_heads(module: nn.Module, config) -> tuple[int, int, int, int]:
    """``(query heads, kv heads, q/k head dim, v head dim)`` that ``module`` hands the
    attention function. Latent attention expands its latent to one key and value per query
    head, with q/k and v head dims of their own (``qk_head_dim``, ``v_head_dim``); every
    other attention takes the text config's head counts and ``head_dim``."""
    if is_latent_attention(module):
        return module.num_heads, module.num_heads, module.qk_head_dim, module.v_head_dim
    H = config.num_attention_heads
    K = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    return H, K, D, D


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a HF decoder (of a VLM's language model): they hold
    q/k/v projections (or latent attention's, :func:`is_latent_attention`) and know their
    ``layer_idx``, and are not a linear-attention layer (OLMo-hybrid's gated delta nets have
    q/k/v projections too)."""
    return [m for m in language_model(model).modules()
            if (all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj")) or
                is_latent_attention(m)) and
            hasattr(m, "layer_idx") and not is_recurrent(m)]


def token_norms(model: nn.Module) -> list[nn.Module]:
    """The norms applied to every token's hidden state: each decoder layer's
    (:func:`layer_norms`), then the base model's final norm (:data:`FINAL_NORM_NAMES`) if
    there is one."""
    norms = [norm for layer in decoder_layers(model) for norm in layer_norms(layer)]
    final = final_norm(model)
    return norms if final is None else [*norms, final]


def final_norm(model: nn.Module) -> nn.Module | None:
    """The base model's final norm (:data:`FINAL_NORM_NAMES`), or None."""
    for name in FINAL_NORM_NAMES:
        final = getattr(language_model(model), name, None)
        if isinstance(final, nn.Module):
            return final
    return None


def hf_checkpointing(model: nn.Module) -> bool:
    """Whether HF's own gradient checkpointing is on (the property's name changed in
    transformers 5: ``is_activation_checkpointing``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


__all__ = ["BLOCK_MIXER", "FINAL_NORM_NAMES", "LATENT_NAMES", "MIXER_NAMES", "MLP_CLASS_PARTS",
           "MLP_NAMES", "NORM_NAMES", "RECURRENT_NAMES", "SIDE_MLP_NAMES", "attention_heads",
           "attention_modules", "decoder_layers", "final_norm", "hf_checkpointing", "is_block",
           "is_latent_attention", "is_mlp", "is_recurrent", "language_model", "layer_mlp",
           "layer_mlps", "layer_norms", "text_config", "text_config_of", "token_norms"]
