"""Honour or refuse: every attention feature a HF model asks for, checked against what the
sequence-parallel attention implements.

A model asks in two places:

- **its config**, read once when :func:`arctic.apply_sequence_parallel` runs
  (:func:`check_model_features`). Features that the SP attention cannot reproduce are refused
  there, before any collective, with a ``ValueError`` that names the feature, the model class
  and what to do instead;
- **the keyword arguments of each attention call** (transformers' ``AttentionInterface``
  signature), read on every call by :func:`read_attention_kwargs`, before any collective of
  the call. Every name is classified (:func:`classify`): implemented exactly
  (:data:`HONOURED`), refused when it asks for something (:data:`REFUSED`), without effect on
  the attention (:data:`INERT`), or one of the model's loss arguments, which transformers
  passes down with every other keyword of ``model(**batch)`` and the attention passes over
  (:func:`loss_arguments`, read from the installed loss function). A name nobody classified
  is refused too, naming the transformers release, since nobody can tell whether it changes
  the result; ``tests/test_arctic_hf_drift.py`` runs every supported family to catch such a
  name in CI first.

What is honoured (``tests/test_arctic_hf_families.py`` compares each with the unmodified model on
one process): ``scaling``; ``sliding_window`` (per layer, as the model passes it; causal
windows of :mod:`ulysses.band`, with head chunking, fused projections, packed documents and
rings); ``s_aux`` attention sinks (GPT-OSS; :mod:`ulysses.sinks`); ``softcap``, attention
logit softcapping inside the softmax (Gemma2's ``attn_logit_softcapping``;
:mod:`ulysses.softcap`); Llama4's chunked attention (``attention_chunk_size`` on the layers
``layer_types`` marks chunked: documents of that length, :func:`attention_chunk`); Gemma3's
``use_bidirectional_attention`` (:data:`BIDIRECTIONAL`: no causal mask, symmetric sliding
windows); flash-attn's varlen arguments (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``:
the documents, :func:`arctic.hf.batch.varlen_documents`). What is refused: attention dropout,
other non-causal attention (another family's flag, ``config.is_causal=False``, a per-call
``is_causal=False``), explicit masks, ``seq_idx`` (the packed-sequence index of state-space
layers, which sequence parallelism does not cut), and returned attention weights. Llama4's
``attn_temperature_tuning`` on NoPE layers is honoured by :func:`fix_temperature`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from arctic.hf.anatomy import language_model, text_config
from ulysses.softcap import check_softcap

HONOURED = ("scaling", "sliding_window", "s_aux", "softcap", "cu_seq_lens_q", "cu_seq_lens_k",
            "max_length_q", "max_length_k")
"""Attention arguments implemented exactly: the softmax scale, a causal sliding window,
GPT-OSS's per-head sink logits, attention logit softcapping, and flash-attn's varlen
arguments (the batch's documents, read by the batch hook and checked here to be the
same)."""
REFUSED = ("dropout", "is_causal", "output_attentions", "head_mask",
           "layer_head_mask", "seq_idx")
"""Attention arguments refused when they ask for something (a non-zero dropout, an
``is_causal`` other than the module's own, returned weights, head masks, a packed sequence
index): the SP attention does not implement them."""
INERT = ("position_ids", "use_cache", "cache_position", "output_router_logits",
         "output_hidden_states", "return_dict")
"""Arguments that reach the attention but do not change what it computes: the position ids
(documents come from the model's own ``position_ids``, which the batch hook reads), and flags
for other parts of the model (KV cache, MoE router outputs, returned hidden states)."""

BIDIRECTIONAL = ("Gemma3TextModel",)
"""Decoders whose ``use_bidirectional_attention=True`` is honoured: their masks were read in
transformers 5.13 and 5.24. Full layers attend without a causal mask, sliding layers within
``|q - k| < sliding_window`` (the value the config stores, halved at load), both within
packed documents. Other families' flag is refused: Gemma and Gemma2 set only the modules'
``is_causal`` and keep causal masks, so transformers' own result depends on the attention
implementation (eager reads the causal mask, sdpa without a mask the flag)."""

_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def loss_arguments(model: nn.Module | None = None) -> frozenset[str]:
    """The keyword arguments of a causal LM's loss in the installed transformers: those of
    ``model.loss_function`` (default: ``ForCausalLMLoss``) and of the cross-entropy it
    passes its ``**kwargs`` to. transformers hands every keyword of ``model(**batch)`` to each
    attention call (``TransformersKwargs``), so ``shift_labels`` or ``num_items_in_batch`` in
    a batch reach the attention; they mean something to the loss only, and the attention
    passes over them."""
    from transformers.loss import loss_utils

    fn = getattr(model, "loss_function", None) or loss_utils.LOSS_MAPPING["ForCausalLM"]
    fns = [fn]
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        fns.append(getattr(loss_utils, "fixed_cross_entropy", None))
    names = {"labels"}
    for f in filter(None, fns):
        names.update(n for n, p in inspect.signature(f).parameters.items()
                     if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                       inspect.Parameter.VAR_KEYWORD))
    return frozenset(names - {"logits", "source", "target"})


def classify(name: str, passed_over: frozenset[str] = frozenset()) -> str | None:
    """What the SP attention does with the attention argument ``name``: ``"honoured"``,
    ``"refused"`` (when it asks for something), ``"inert"``, ``"loss"`` (one of
    ``passed_over``, :func:`loss_arguments`), or None: not classified (refused as unknown)."""
    for kind, names in (("honoured", HONOURED), ("refused", REFUSED), ("inert", INERT),
                        ("loss", passed_over)):
        if name in names:
            return kind
    return None


def unknown_arguments_error(owner: str, names, where: str) -> ValueError:
    """The refusal of arguments nobody classified, naming the transformers release."""
    import transformers

    return ValueError(f"{owner} passes {sorted(names)} to {where} (transformers "
                      f"{transformers.__version__}); the sequence-parallel attention does not "
                      f"know these arguments and cannot tell whether they change the result, "
                      f"so it refuses them. Train this model without sequence parallelism, or "
                      f"report it (arguments are classified in arctic/hf/features.py and "
                      f"arctic/hf/binding.py)")


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """The features one attention call asks for, after :func:`read_attention_kwargs`."""

    scaling: float | None
    """Softmax scale (``None``: ``1 / sqrt(head_dim)``)."""
    window: int | None
    """Causal sliding window (keys a query sees, itself included), or ``None``."""
    sinks: Tensor | None
    """Per-head attention-sink logits ``[H]`` (GPT-OSS's ``s_aux``), or ``None``."""
    softcap: float = 0.0
    """Attention logit softcapping inside the softmax (Gemma2's ``attn_logit_softcapping``);
    0: none."""
    varlen: dict | None = None
    """flash-attn's varlen arguments as given (the documents), or None."""


def _refuse(module: nn.Module, feature: str, instead: str) -> ValueError:
    return ValueError(f"{type(module).__name__} asks for {feature}, which the sequence-parallel "
                      f"attention does not implement; {instead}")


def read_attention_kwargs(module: nn.Module, kwargs: dict, *,
                          passed_over: frozenset[str] = frozenset()) -> AttentionCall:
    """Read the keyword arguments transformers passed to the attention of ``module``: each is
    honoured (returned) or refused with ``ValueError``; the model's loss arguments
    (``passed_over``, :func:`loss_arguments`) are passed over; unknown ones are refused."""
    unknown = [n for n in kwargs if classify(n, passed_over) is None]
    if unknown:
        raise unknown_arguments_error(type(module).__name__, unknown, "its attention")
    kw = dict(kwargs)
    dropout = kw.pop("dropout", 0.0)
    if dropout:
        raise _refuse(module, f"attention dropout ({dropout})", "set config.attention_dropout=0")
    try:
        softcap = check_softcap(kw.pop("softcap", None))
    except ValueError as e:
        raise ValueError(f"{type(module).__name__}: {e}") from None
    is_causal = kw.pop("is_causal", None)
    module_causal = getattr(module, "is_causal", True) is not False
    if is_causal is not None and bool(is_causal) != module_causal:
        # transformers' own result would depend on the implementation: eager reads the mask
        # the model built for the module, sdpa the flag where no mask is built
        raise _refuse(module, f"is_causal={is_causal!r} on a call to a "
                      f"{'causal' if module_causal else 'non-causal'} attention module",
                      f"of non-causal attention only {list(BIDIRECTIONAL)}'s "
                      f"use_bidirectional_attention is honoured")
    if kw.pop("output_attentions", None):
        raise _refuse(module, "returned attention weights (output_attentions=True)",
                      "call the model with output_attentions=False")
    for name in ("head_mask", "layer_head_mask"):
        if kw.pop(name, None) is not None:
            raise _refuse(module, f"a {name}", f"pass {name}=None")
    varlen = {n: v for n in _VARLEN if (v := kw.pop(n, None)) is not None} or None
    if kw.pop("seq_idx", None) is not None:
        raise _refuse(module, "a packed sequence index (seq_idx, for state-space layers)",
                      "mark documents with position_ids that restart at 0 (arctic.data does)")
    window = kw.pop("sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise _refuse(module, f"sliding_window={window!r}", "use a positive int or None")
    return AttentionCall(scaling=kw.pop("scaling", None), window=window,
                         sinks=kw.pop("s_aux", None), softcap=softcap, varlen=varlen)


def tunes_temperature(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama4 NoPE layer with attention temperature tuning: its forward
    multiplies the queries at position p by ``log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1``, counting p over its own input from 0, which under sequence parallelism
    is this rank's piece, not the row (:func:`fix_temperature`)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and \
        not getattr(module, "use_rope", True)


def temperature_scales(module: nn.Module, positions: Tensor) -> Tensor:
    """The factors :func:`tunes_temperature` describes, at ``positions``."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * \
        module.attn_scale + 1.0


def fix_temperature(module: nn.Module, q_BsHD: Tensor, row_positions: Tensor) -> Tensor:
    """``q`` as the unsharded layer would have scaled it: the queries arrive multiplied by the
    factors of positions ``0..s-1`` (the layer's own count over this rank's piece); they get
    those of their positions in the row instead (``row_positions``, ``[s]``), as transformers
    computes them for the whole row (packed documents included); ``[B, s]`` when the rows
    are cut differently (a per-document mesh)."""
    local = temperature_scales(module, torch.arange(q_BsHD.shape[1], device=q_BsHD.device))
    wanted = temperature_scales(module, row_positions.to(q_BsHD.device))
    factor = (wanted / local).reshape(-1, q_BsHD.shape[1], 1, 1)
    return (q_BsHD.float() * factor).to(q_BsHD.dtype)


def attention_chunk(config, module: nn.Module) -> int | None:
    """The chunk of Llama4's chunked attention on ``module``'s layer: ``attention_chunk_size``
    where ``config.layer_types`` says ``"chunked_attention"`` (each query attends causally
    within its chunk of that many positions); None for a global layer or a model without
    chunks. ``ValueError`` when the config has a chunk size but no ``layer_types`` to say which
    layers use it."""
    size = getattr(config, "attention_chunk_size", None)
    if not size:
        return None
    types = getattr(config, "layer_types", None)
    if types is None:
        raise ValueError(f"{type(config).__name__} has attention_chunk_size={size} but no "
                         f"layer_types saying which layers are chunked; this transformers "
                         f"release is not supported for chunked attention")
    return int(size) if types[module.layer_idx] == "chunked_attention" else None


def is_bidirectional(model: nn.Module) -> bool:
    """Whether ``model`` asks for bidirectional attention that is honoured
    (:data:`BIDIRECTIONAL`)."""
    return getattr(text_config(model), "use_bidirectional_attention", None) is True and \
        type(language_model(model)).__name__ in BIDIRECTIONAL


def check_model_features(model: nn.Module, modules: list[nn.Module]) -> None:
    """``ValueError`` for what the config of ``model`` (or its attention ``modules``) asks for
    and the SP attention cannot reproduce; called before any collective."""
    config, name = text_config(model), type(model).__name__
    value = getattr(config, "attention_dropout", None)
    if value:
        raise ValueError(f"{name}: config.attention_dropout={value!r} asks for attention "
                         f"dropout, which the sequence-parallel attention does not implement; "
                         f"set it to 0")
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional and not is_bidirectional(model):
        raise ValueError(f"{name}: config.use_bidirectional_attention={bidirectional!r} is "
                         f"honoured for {list(BIDIRECTIONAL)} only (decoders whose masks were "
                         f"read); {type(language_model(model)).__name__}'s is not, since "
                         f"transformers' own result for it may depend on the attention "
                         f"implementation. Train it causally or without sequence parallelism")
    if getattr(config, "is_causal", True) is False:
        raise ValueError(f"{name}: config.is_causal=False asks for transformers' bidirectional "
                         f"masks, whose result depends on the attention implementation (eager: "
                         f"a mask over the whole row, across packed documents; sdpa: causal "
                         f"where the attention module says so), so the sequence-parallel "
                         f"attention cannot match it; use a model with "
                         f"use_bidirectional_attention ({list(BIDIRECTIONAL)})")
    for m in modules:
        if isinstance(getattr(m, "indexer", None), nn.Module):
            raise ValueError(f"{name}: {type(m).__name__} is DeepSeek Sparse Attention (its "
                             f"indexer picks the top-k keys of each query from the whole "
                             f"sequence and masks the rest), which the sequence-parallel "
                             f"attention does not implement; train it without sequence "
                             f"parallelism")
        if getattr(m, "is_causal", True) is False and not is_bidirectional(model):
            raise ValueError(f"{name}: {type(m).__name__} is not causal (is_causal=False); "
                             f"sequence parallelism here trains causal decoders only")
