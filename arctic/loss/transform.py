"""The head's logit transform, found and verified.

A causal LM's own forward may transform the logits before its loss (Granite divides them by
``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 cap them with
``final_logit_softcapping``). :func:`arctic.loss.apply_sp_loss` skips that forward, so it
finds the transform (:func:`find_logit_transform`: config keys, checked by a weight-free probe
of the forward) and applies it inside the tiled loss, or refuses the model with a
``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from arctic.hf.anatomy import base_model
from arctic.hf.binding import of_module
from arctic.hf.probe import NotVerifiable, probe_output_type, stubbed
from arctic.loss.tiled import check_logit_transform, transform_logits_
from ulysses.trace_shortcuts import is_traced, real_values

SCALE_KEYS = ("logits_scaling", "logit_scale", "lm_head_multiplier")
"""Config keys of a constant factor on the logits: Granite divides by ``logits_scaling``
(HyperCLOVAX multiplies by it), Cohere multiplies by ``logit_scale``, FalconH1 by
``lm_head_multiplier``. Each value is tried as a factor and as a divisor."""


SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Config keys of a tanh cap on the logits: Gemma 2/3/4, Beam, NanoChat, VaultGemma
(``final_logit_softcapping``), RecurrentGemma (``logits_soft_cap``), xLSTM
(``output_logit_soft_cap``)."""


PROBE_TOKENS = 4


PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5


@dataclass(frozen=True, kw_only=True, slots=True)
class LogitTransform:
    """What a causal LM's forward does to the float32 lm_head logits ``z`` before its loss:
    ``z * scale``, then ``softcap * tanh(z / softcap)`` unless ``softcap`` is None."""

    scale: float = 1.0
    """Factor on the logits; finite and not 0."""
    softcap: float | None = None
    """The tanh cap (> 0), applied after ``scale``; None: no cap."""

    def __post_init__(self) -> None:
        check_logit_transform(self.scale, self.softcap)


def _usable(value, *, positive: bool) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return abs(value) < float("inf") and (value > 0 if positive else value != 0)


def _candidates(config) -> tuple[dict[str, Any], list[LogitTransform]]:
    """The config's logit keys that are set, and the transforms they could mean."""
    found = {k: getattr(config, k) for k in SCALE_KEYS + SOFTCAP_KEYS
             if getattr(config, k, None) is not None}
    scales = [1.0]
    for k in SCALE_KEYS:
        if _usable(found.get(k), positive=False):
            scales += [float(found[k]), 1.0 / found[k]]
    caps = [None] + [float(found[k]) for k in SOFTCAP_KEYS
                     if _usable(found.get(k), positive=True)]
    return found, [LogitTransform(scale=s, softcap=c) for c in caps for s in scales]


def _probe(model: nn.Module, base: nn.Module, head: nn.Module, vocab: int, hidden: int,
           weight: Tensor) -> tuple[Tensor, list[Tensor], Tensor, Any]:
    """Run the class's own forward with the base model returning a random ``h [1, T, E]`` and
    the lm_head returning a random float32 ``z [1, T, V]``; returns ``(h, what the head was
    called with, z, the forward's logits)``. Reads no weight and communicates nothing."""
    _ProbeOutput = probe_output_type()
    # Meta and fake weights hold no values; the probe needs real ones (it reads no weight, so
    # CPU does). A fixed generator leaves the global RNG, and so training, untouched.
    device = torch.device("cpu") if weight.is_meta or is_traced(weight) else weight.device
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, PROBE_TOKENS, hidden, generator=g, device="cpu").to(device, weight.dtype)
    # Magnitudes from 1e-2 to 1e2 along the vocab: a wrong scale shows at every size, a
    # softcap where |z| is not small against the cap. All V columns, so that a forward that
    # slices the vocab (e.g. an unpadded_vocab_size) shows as a shape mismatch.
    z = (torch.randn(1, PROBE_TOKENS, vocab, generator=g, device="cpu") *
         torch.logspace(-2, 2, vocab, device="cpu")).to(device)
    seen: list[Tensor] = []
    base_calls: list[None] = []

    def base_forward(*args, **kwargs):
        # The stub base model of the probe: whatever the forward passes it (ids, positions,
        # flags) cannot change h, which is the point; only that it was called is recorded.
        base_calls.append(None)
        return _ProbeOutput(last_hidden_state=h)

    def head_forward(x):
        seen.append(x)
        return z.clone()

    ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
    positions = torch.arange(PROBE_TOKENS, device=device).unsqueeze(0)
    with stubbed(base, base_forward), stubbed(head, head_forward):
        # The class's forward: the instance's is ours after apply_sp_loss (and may be already).
        use_cache = of_module(model).name_of("use_cache")
        flags = {use_cache: False} if use_cache else {}
        out = type(model).forward(model, input_ids=ids, position_ids=positions, **flags)
    if not base_calls:
        raise NotVerifiable(f"its forward does not call its base model "
                             f"({type(base).__name__}), which the tiled loss calls")
    return h, seen, z, out.logits if hasattr(out, "logits") else out[0]


def _input_factor(x: Tensor, h: Tensor, found: dict[str, Any]) -> float | None:
    """The factor c with ``x == c * h`` (the lm_head's input against the base model's output):
    1.0, or a config scale key (:data:`SCALE_KEYS`, as a factor or a divisor; MiniCPM3
    divides the hidden states by ``logits_scaling``), within the rounding of ``h``'s dtype;
    None when no such factor holds."""
    if x.shape != h.shape or x.device != h.device:
        return None
    if torch.equal(x.float(), h.float()):
        return 1.0
    tol = 4 * torch.finfo(h.dtype).eps
    for k in SCALE_KEYS:
        if _usable(found.get(k), positive=False):
            for c in (float(found[k]), 1.0 / found[k]):
                if torch.allclose(x.double(), c * h.double(), rtol=tol, atol=0):
                    return c
    return None


def find_logit_transform(model: nn.Module) -> LogitTransform:
    """The transform ``model``'s forward applies to its lm_head logits, read from the config
    (:data:`SCALE_KEYS`, :data:`SOFTCAP_KEYS`) and verified by a probe.

    The probe calls the model class's own forward with the base model and the lm_head stubbed
    (instance forwards, their hooks set aside, all restored): the base returns a random ``h``,
    the head records its input (which must be ``h``) and returns a random float32 ``z``; the
    forward's logits must equal ``transform(z)`` (rtol 1e-4, atol 1e-5) for one of the
    transforms the config keys allow. It reads no weight value and runs no collective, so it
    works on ZeRO-3-partitioned, meta and fake (``FakeTensorMode``) parameters, on CPU in the
    last two cases.

    Raises ``ValueError`` naming the model class when: the head's input is not the
    base model's output, or that times a config scale key (MiniCPM3 divides by
    ``logits_scaling``: a scale of a bias-free head's logits, folded into the transform); no
    candidate transform reproduces the forward's logits; or the probe itself fails.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    head, base = model.get_output_embeddings(), base_model(model)
    if head is None or base is model:
        raise ValueError(f"the tiled loss needs a causal LM with a base model and an lm_head "
                         f"(get_output_embeddings); {name} has "
                         f"{'no lm_head' if head is None else 'no base model'}")
    weight = getattr(head, "weight", None)
    shape = tuple(getattr(weight, "ds_shape", getattr(weight, "shape", ())))  # ZeRO-3: ds_shape
    if len(shape) != 2:
        raise ValueError(f"{name}'s lm_head ({type(head).__name__}) needs a 2-D weight [vocab, "
                         f"hidden], got {shape}")
    found, candidates = _candidates(config)
    instead = ("Train with the model's own forward and loss instead (skip apply_sp_loss; "
               "arctic.loss.sp_token_loss combines any per-rank summed loss), at the cost of "
               "holding this rank's whole logits")
    with real_values(), torch.no_grad():
        try:
            h, seen, z, logits = _probe(model, base, head, shape[0], shape[1], weight)
        except NotVerifiable as e:
            raise ValueError(f"{name}: {e}. {instead}") from None
        except Exception as e:  # re-raised: a head that cannot be verified is refused
            raise ValueError(f"could not verify what {name}.forward does to the lm_head's "
                             f"logits: called with a stub base model and lm_head, it raised "
                             f"{type(e).__name__}: {e}. {instead}") from e
        if len(seen) != 1:
            raise ValueError(f"{name}.forward calls its lm_head {len(seen)} times, where the "
                             f"tiled loss calls it once. {instead}")
        factor = _input_factor(seen[0], h, found)
        if factor is None:
            raise ValueError(f"{name}.forward does not pass its base model's last_hidden_state "
                             f"to the lm_head unchanged or scaled by a factor from its config "
                             f"(e.g. it normalises the hidden states first); the tiled loss "
                             f"cannot reproduce that. {instead}")
        if factor != 1.0 and getattr(head, "bias", None) is not None:
            raise ValueError(f"{name}.forward scales the hidden states by {factor:g} before an "
                             f"lm_head with a bias, which is not a scale of the logits. "
                             f"{instead}")
        if not torch.is_tensor(logits) or logits.shape != z.shape:
            raise ValueError(f"{name}.forward returns logits of shape "
                             f"{tuple(getattr(logits, 'shape', ()))} for lm_head output "
                             f"{tuple(z.shape)} (e.g. it slices the vocab); the tiled loss "
                             f"cannot reproduce that. {instead}")
        got = logits.float().to(z.device)
        worst = float("inf")
        for t in candidates:
            want = transform_logits_(z.clone(), scale=t.scale, softcap=t.softcap)
            if torch.allclose(got, want, rtol=PROBE_RTOL, atol=PROBE_ATOL):
                # a bias-free head of scaled hidden states gives scaled logits
                return LogitTransform(scale=t.scale * factor, softcap=t.softcap)
            worst = min(worst, float((got - want).abs().max()))
    raise ValueError(f"{name}.forward transforms the lm_head's logits in a way the tiled loss "
                     f"does not reproduce: no scale/softcap from its config "
                     f"({found or 'no key of ' + str(SCALE_KEYS + SOFTCAP_KEYS)}) matches "
                     f"(closest: max difference {worst:.3g}). {instead}")
