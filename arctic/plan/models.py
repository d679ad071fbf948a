"""The models the planner knows by name, and how any model's transformers config is made.

The planner builds models from their config alone (no weights), so a name only needs the
published ``config.json`` values; any other model is planned from its own ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

from arctic.hf.anatomy import attention_modules, decoder_layers, layer_mlps, text_config_of
from arctic.hf.fused import FUSABLE
from arctic.hf.mixers import FAMILIES, token_mixers
from arctic.tiling.layer import TILABLE

MODELS: dict[str, tuple[str, dict]] = {
    # name -> (transformers config class, its arguments), from the published config.json files
    "llama3-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama3.2-3b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3-32b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "llama3-70b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # hybrid: 3 gated delta net layers to 1 attention layer (32 value heads over 16 key
    # heads of 128; attention 16 heads over 4 kv heads of 256, a quarter rotary)
    "qwen3.5-9b": ("Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        partial_rotary_factor=0.25, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # multi-head latent attention (q/k head dim 192, v 128, a latent of 512) and 64 routed
    # experts (6 per token, 2 shared) after one dense layer
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # examples/train.py's CPU demo model
    "tiny-llama": ("LlamaConfig", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)),
}


def unsupported_settings(config) -> dict[str, str]:
    """The stack settings the model of ``config`` does not support, each with why: its
    attention classes outside :data:`arctic.hf.fused.FUSABLE` (``fuse_projections``), its
    decoder layers outside :data:`arctic.tiling.layer.TILABLE` (``tiled_layer``), the
    attention's settings on a model without attention (Mamba, Mamba2), the tiled MLP where no
    decoder layer holds an MLP it finds. Read off the model built on the meta device (no
    memory, no initial values)."""
    model = _meta_model(config)
    out = {}
    modules = attention_modules(model)
    attention = sorted({type(m).__name__ for m in modules} - set(FUSABLE))
    if attention:
        out["fuse_projections"] = f"the fused projections do not support {attention}"
    if not modules:
        for key in ("head_chunk_size", "seq_chunk", "fuse_projections"):
            out[key] = f"{type(model).__name__} has no attention"
    if not any(layer_mlps(layer) for layer in decoder_layers(model)):
        out["tiled_mlp"] = f"{type(model).__name__}'s decoder layers hold no MLP it finds"
    layers = sorted({type(m).__name__ for m in decoder_layers(model)} - set(TILABLE))
    if layers:
        out["tiled_layer"] = f"the tiled layer tail does not support {layers}"
    return out


def token_mixer_heads(config) -> list[tuple[str, int, int]]:
    """The token mixers of the model of ``config`` (:data:`arctic.hf.mixers.FAMILIES`) as
    ``(class, heads, grouped heads)``, one per class (what the search's
    :func:`arctic.plan.search.factorizations` reads). Read off the model built on the meta
    device."""
    out = {}
    for m in token_mixers(_meta_model(config)):
        kind = FAMILIES[type(m).__name__]
        heads = getattr(m, kind.num_heads) if kind.num_heads else 1
        grouped = getattr(m, kind.num_grouped) if kind.num_grouped else 1
        out[type(m).__name__] = (type(m).__name__, int(heads), int(grouped))
    return list(out.values())


def _meta_model(config):
    """The model of ``config`` on the meta device (no memory, no initial values)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def model_config(name: str, *, layers: int | None = None, max_positions: int | None = None):
    """A transformers config: a name from :data:`MODELS` or a ``config.json`` path.
    ``layers`` overrides the decoder layer count (a 2-layer 8B-shaped model for GPU checks)."""
    import transformers

    if name in MODELS:
        cls_name, kwargs = MODELS[name]
        config = getattr(transformers, cls_name)(**kwargs)
    elif Path(name).is_file():
        try:  # HF's reader: it decodes what save_pretrained encodes ({"__float__": "Infinity"})
            config = transformers.AutoConfig.from_pretrained(Path(name).parent if
                                                             Path(name).name == "config.json"
                                                             else name)
        except OSError as e:  # not JSON
            raise ValueError(f"--model {name}: {e}") from None
    else:
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a config.json path, "
                         f"got {name!r}")
    text = text_config_of(config)  # a VLM's: its layers and positions are the planned ones
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        text.num_hidden_layers = layers
    if max_positions is not None:
        if hasattr(text, "max_position_embeddings"):
            text.max_position_embeddings = max(text.max_position_embeddings, max_positions)
    config.use_cache = text.use_cache = False
    return config


def is_vlm_config(config) -> bool:
    """Whether ``config`` is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None
