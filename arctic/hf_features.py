"""Honour or refuse: every attention feature a HF model asks for, checked against what the
sequence-parallel attention implements.

A model asks in two places:

- **its config**, read once when :func:`arctic.apply_sequence_parallel` runs
  (:func:`check_model_features`). Features that the SP attention cannot reproduce are refused
  there, before any collective, with a ``ValueError`` that names the feature, the model class
  and what to do instead;
- **the keyword arguments of each attention call** (transformers' ``AttentionInterface``
  signature), read on every call by :func:`read_attention_kwargs`, before any collective of
  the call. Each known argument is implemented exactly or refused; an argument this module
  does not know is refused too, since nobody can tell whether it changes the result.

What is honoured (``tests/test_arctic_hf_families.py`` compares each with the unmodified model on
one process): ``scaling``; ``sliding_window`` (per layer, as the model passes it; causal
windows of :mod:`ulysses.band`, with head chunking, fused projections, packed documents and
rings); ``s_aux`` attention sinks (GPT-OSS; :mod:`ulysses.sinks`). What is refused: attention
dropout, attention logit softcapping (Gemma2's ``attn_logit_softcapping``: no kernel here
applies a softcap inside the softmax), non-causal attention, chunked attention (Llama4's
``attention_chunk_size``), explicit masks, flash-attn varlen packing arguments, and returned
attention weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

_INERT = ("position_ids", "use_cache", "cache_position", "output_router_logits",
          "output_hidden_states", "return_dict")
"""Arguments that reach the attention but do not change what it computes: the position ids
(documents come from the model's own ``position_ids``, which the batch hook reads), and flags
for other parts of the model (KV cache, MoE router outputs, returned hidden states)."""

_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """The features one attention call asks for, after :func:`read_attention_kwargs`."""

    scaling: float | None
    """Softmax scale (``None``: ``1 / sqrt(head_dim)``)."""
    window: int | None
    """Causal sliding window (keys a query sees, itself included), or ``None``."""
    sinks: Tensor | None
    """Per-head attention-sink logits ``[H]`` (GPT-OSS's ``s_aux``), or ``None``."""


def _refuse(module: nn.Module, feature: str, instead: str) -> ValueError:
    return ValueError(f"{type(module).__name__} asks for {feature}, which the sequence-parallel "
                      f"attention does not implement; {instead}")


def read_attention_kwargs(module: nn.Module, kwargs: dict) -> AttentionCall:
    """Read the keyword arguments transformers passed to the attention of ``module``: each is
    honoured (returned) or refused with ``ValueError``; unknown ones are refused."""
    kw = dict(kwargs)
    dropout = kw.pop("dropout", 0.0)
    if dropout:
        raise _refuse(module, f"attention dropout ({dropout})", "set config.attention_dropout=0")
    softcap = kw.pop("softcap", None)
    if softcap:
        raise _refuse(module, f"attention logit softcapping (softcap={softcap})",
                      "set config.attn_logit_softcapping=None (this changes the model) or "
                      "train without sequence parallelism")
    if kw.pop("is_causal", None) is False:
        raise _refuse(module, "non-causal attention (is_causal=False)",
                      "sequence parallelism here trains causal decoders only")
    if kw.pop("output_attentions", None):
        raise _refuse(module, "returned attention weights (output_attentions=True)",
                      "call the model with output_attentions=False")
    for name in ("head_mask", "layer_head_mask"):
        if kw.pop(name, None) is not None:
            raise _refuse(module, f"a {name}", f"pass {name}=None")
    varlen = sorted(n for n in _VARLEN if kw.pop(n, None) is not None)
    if varlen:
        raise _refuse(module, f"flash-attn varlen packing ({', '.join(varlen)})",
                      "mark documents with position_ids that restart at 0 (arctic.data does)")
    window = kw.pop("sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise _refuse(module, f"sliding_window={window!r}", "use a positive int or None")
    call = AttentionCall(scaling=kw.pop("scaling", None), window=window,
                         sinks=kw.pop("s_aux", None))
    for name in _INERT:
        kw.pop(name, None)
    if kw:
        raise ValueError(f"{type(module).__name__} passes {sorted(kw)} to its attention; the "
                         f"sequence-parallel attention does not know these arguments and cannot "
                         f"tell whether they change the result, so it refuses them. Train this "
                         f"model without sequence parallelism, or report it")
    return call


def check_model_features(model: nn.Module, modules: list[nn.Module]) -> None:
    """``ValueError`` for what the config of ``model`` (or its attention ``modules``) asks for
    and the SP attention cannot reproduce; called before any collective."""
    config, name = model.config, type(model).__name__
    checks = {
        "attention_dropout": ("attention dropout", "set it to 0"),
        "attn_logit_softcapping": (
            "attention logit softcapping (no kernel here applies a softcap inside the softmax)",
            "set it to None, which changes the model, or train without sequence parallelism"),
        "attention_chunk_size": (
            "chunked attention (each query sees only its chunk)",
            "set it to None, which changes the model, or train without sequence parallelism"),
        "use_bidirectional_attention": (
            "bidirectional attention", "sequence parallelism here trains causal decoders only"),
    }
    for key, (feature, instead) in checks.items():
        value = getattr(config, key, None)
        if value:
            raise ValueError(f"{name}: config.{key}={value!r} asks for {feature}, which the "
                             f"sequence-parallel attention does not implement; {instead}")
    for m in modules:
        if getattr(m, "is_causal", True) is False:
            raise ValueError(f"{name}: {type(m).__name__} is not causal (is_causal=False); "
                             f"sequence parallelism here trains causal decoders only")
