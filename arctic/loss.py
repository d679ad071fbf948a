"""Token-weighted loss across the ranks of a sequence-parallel group.

Each SP rank holds a piece of one sequence and the summed loss of its own tokens. The loss of
the sequence is ``sum over ranks of loss_sum / sum over ranks of num_valid``: a mean over
tokens, not a mean of per-rank means (which would overweight a rank with few valid labels,
and divide by zero on a rank with none). Every rank of the group gets that value.

Gradients are exact for any differentiable use of the returned value on each rank: used as
is, scaled, summed, or gathered and re-weighted per rank as DeepSpeed's documented ALST loop
does (``all_gather`` the per-rank losses, weight each by its rank's token count). The
forward adds over the group, so the backward adds the upstream gradients of the group's
ranks (one scalar all-reduce): rank r's ``loss_sum`` gets ``sum over ranks of grad / N``, its
true share of the objective, the mean over the SP ranks of what each backpropagates. Then
the framework's gradient reduction:
- averages over every rank (dp x sp): DDP, FSDP2, ZeRO-3's default reduce-scatter;
  ``averaged_over_sp=True``;
- or adds over the SP ranks (DeepSpeed ZeRO-0/1/2 given an SP ``mpu``, ZeRO-3's contiguous
  path): ``averaged_over_sp=False`` divides the backward by sp.
A model's SP loss learns which from the engine that wraps the model when it runs
(:mod:`arctic.grad_reduction`). Either way, after the reduction the gradients equal those of
single-device training on the whole sequence (and with dp > 1, the mean over the dp
replicas' sequences, as in plain data parallelism).

The head: a causal LM's own forward may transform the logits before its loss (Granite
divides them by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 cap them
with ``final_logit_softcapping``). :func:`apply_sp_loss` skips that forward, so it finds the
transform (:func:`find_logit_transform`: config keys, checked by a weight-free probe of the
forward) and applies it inside the tiled loss, or refuses the model with a ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from arctic.anatomy import base_model
from arctic.grad_reduction import resolve_sp_averaging
from arctic.hf_binding import of_module
from arctic.hf_features import loss_arguments
from arctic.order import record_apply
from arctic.removal import journaled
from arctic.router_loss import RouterLoss, find_router_loss, routed_by_sp_loss, router_loss
from arctic.tiling import (IGNORE_INDEX, _tile_logits, check_logit_transform,
                           tiled_logits_loss, transform_logits_)
from ulysses.torch_internals import (forward_hooks, is_fake, set_forward_hooks,
                                     unset_fake_temporarily)


class _SPTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_sum, num_valid, group, averaged_over_sp, num_items):
        sp = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
        totals = torch.stack([loss_sum.detach().float(), num_valid.detach().float()])
        if sp > 1:
            dist.all_reduce(totals, group=group)
        # No valid label anywhere in the group: the loss is 0 and so are the gradients.
        count = totals[1].clamp(min=1.0) if num_items is None else num_items
        ctx.group, ctx.sp = group, sp
        ctx.scale = (1 if averaged_over_sp else 1 / sp) / count
        return totals[0] / count

    @staticmethod
    def backward(ctx, grad):
        # The forward added the ranks' loss sums, so each one's gradient is the sum of what
        # every rank backpropagates into the (equal) result; the callers' uses may differ.
        grad = grad.float().clone()
        if ctx.sp > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.scale, None, None, None, None


def sp_token_loss(loss_sum: Tensor, num_valid: Tensor | int, *,
                  group: dist.ProcessGroup | None, averaged_over_sp: bool = True,
                  num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """The group's token-mean loss, with gradients for the framework's reduction.

    Args:
        loss_sum: this rank's summed token loss (a differentiable scalar), e.g. from
            :func:`arctic.tiling.tiled_logits_loss` or ``cross_entropy(..., reduction="sum")``.
        num_valid: this rank's count of labels that are not -100 (may be 0).
        group: the sequence-parallel group (the mesh's ``"sp"`` axis); ``None`` with an
            uninitialized process group means a single rank.
        averaged_over_sp: whether the gradient reduction averages over the sp ranks too
            (DDP, FSDP2, ZeRO-3's reduce-scatter: True) or adds them (DeepSpeed ZeRO-0/1/2
            with an SP ``mpu``: False); :mod:`arctic.grad_reduction` tells which.
        num_items_in_batch: HF's divisor: the valid labels of everything the caller's loss is
            normalised over (all micro-batches of an accumulated step, and the ranks the caller
            counted), used in place of the group's own count. Must be positive.

    Returns:
        A scalar equal on every rank of the group: ``sum(loss_sum) / max(1, sum(num_valid))``,
        or ``sum(loss_sum) / num_items_in_batch``. Backward gives this rank's ``loss_sum`` the
        gradient ``G / divisor`` (``G / (sp * divisor)`` when not ``averaged_over_sp``),
        where ``G`` is the sum over the group's ranks of the gradient each backpropagates into
        the result: exact for any use of it, the same on every rank or not. Every rank must
        call this (it all-reduces), including ranks with no valid label, and every rank must
        backpropagate through the result (its backward all-reduces too).
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
    if not torch.is_tensor(num_valid):
        num_valid = torch.tensor(num_valid, device=loss_sum.device)
    divisor = None
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch).detach().float().reshape(())
        if not bool(divisor > 0):
            raise ValueError(f"num_items_in_batch must be positive, got "
                             f"{float(divisor):g}")
        divisor = divisor.to(loss_sum.device)
    return _SPTokenLoss.apply(loss_sum, num_valid.to(loss_sum.device), group, averaged_over_sp,
                              divisor)


# --- HF's labels, on sequence shards ---------------------------------------------------------

def shift_labels_across_pieces(labels_BS: Tensor, mesh, *, ignore_index: int = IGNORE_INDEX,
                               segments=None) -> Tensor:
    """HF's shift of unshifted ``labels`` (each token's target is the next label, the last
    one ``ignore_index``), for this rank's piece of the sequence, with the targets that live on
    another rank: the pieces of the SP group are gathered (integers, ``[B, S]`` in all),
    shifted whole and cut again in the mesh's layout. Labels equal to ``ignore_index`` come
    back as -100, what the losses here ignore."""
    from ulysses.sharding import gather_sequence, shard_sequence

    full = gather_sequence(labels_BS, mesh, dim=1)
    if ignore_index != IGNORE_INDEX and bool((full == IGNORE_INDEX).any()):
        raise ValueError(f"labels hold {IGNORE_INDEX} but ignore_index={ignore_index}: HF's "
                         f"cross-entropy would reject that target; use one ignore value")
    shifted = torch.full_like(full, IGNORE_INDEX)
    shifted[:, :-1] = full[:, 1:]
    shifted[shifted == ignore_index] = IGNORE_INDEX
    return shard_sequence(shifted, mesh, dim=1, segments=segments).contiguous()


def hf_targets(*, labels: Tensor | None, shift_labels: Tensor | None, ignore_index: int,
               mesh, group, kwargs=None) -> Tensor:
    """This piece's targets as HF's causal-LM loss reads them: ``shift_labels`` when given
    (HF's precedence), else ``labels`` shifted across the pieces; ``ignore_index`` labels
    become -100. Refused alike on every rank of ``group`` (a -100 target beside another
    ``ignore_index``, which HF's cross-entropy rejects): no rank goes on alone. ``kwargs``:
    the call's other keyword arguments (the varlen ones name a per-document mesh's cut)."""
    if shift_labels is None:
        from arctic.hf_batch import cut_documents

        segments = cut_documents(mesh, kwargs or {}, *labels.shape)
        return shift_labels_across_pieces(labels, mesh, ignore_index=ignore_index,
                                          segments=segments)
    if ignore_index == IGNORE_INDEX:
        return shift_labels
    bad = (shift_labels == IGNORE_INDEX).any().to(torch.int32).reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bool(bad):
        raise ValueError(f"shift_labels hold {IGNORE_INDEX} but ignore_index={ignore_index}: "
                         f"HF's cross-entropy would reject that target; use one ignore value")
    return shift_labels.masked_fill(shift_labels == ignore_index, IGNORE_INDEX)


class SPCausalLMLoss:
    """HF's causal-LM loss (``ForCausalLMLoss``: ``labels`` or ``shift_labels``,
    ``ignore_index``, ``num_items_in_batch``) for a model whose sequence is cut over the SP
    group: the token mean over the whole sequence, equal on the group's ranks, with gradients
    for dp x sp averaging (:func:`sp_token_loss`). :func:`arctic.apply_sequence_parallel`
    makes it the model's ``loss_function``, so ``model(input_ids=, position_ids=, labels=)``
    on the pieces gives the loss of the whole sequence. HF's forward hands its loss every
    keyword of the call: a loss argument of the installed transformers that this loss does not
    compute is refused; the others are the model's (the SP attention already honoured or
    refused them), which HF's loss passes over too.

    Unlike HF's loss on a piece (the mean over that piece's tokens), every rank gets the
    loss of the whole sequence. Its gradients are single-device training's whether the
    caller uses it as it is (``model(..., labels=).loss``), scales it, or gathers the ranks'
    losses and re-weights them by their token counts (DeepSpeed's ALST loop, HF's
    ``deepspeed_sp_compute_loss``): a re-weighting with weights that sum to 1 gives the same
    value and the same gradients. The gradient reduction that trains ``model`` (DDP, FSDP2,
    DeepSpeed at any ZeRO stage) is read off the model at each call
    (:mod:`arctic.grad_reduction`)."""

    HANDLED = frozenset({"logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index",
                         "shift_labels"})

    def __init__(self, mesh, replaced: Callable | None = None,
                 loss_arguments: frozenset[str] = frozenset(),
                 model: nn.Module | None = None) -> None:
        self.mesh, self.replaced = mesh, replaced
        self.refused = frozenset(loss_arguments) - self.HANDLED
        self.model = model  # the model whose loss_function this is

    def __call__(self, logits: Tensor, labels: Tensor | None, vocab_size: int,
                 num_items_in_batch: Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        if self.replaced is not None:
            raise ValueError(f"this model's loss ({getattr(self.replaced, '__name__', '?')}) is "
                             f"not the causal-LM loss that sequence parallelism computes over "
                             f"the pieces of the sequence; compute the loss yourself, or use "
                             f"arctic.apply_sp_loss")
        kwargs.pop("token_mask", None)  # arctic.data's padding mask: the SP loss's alone
        asked = sorted(n for n, v in kwargs.items() if n in self.refused and v is not None)
        if asked:
            raise ValueError(f"the sequence-parallel causal-LM loss computes labels/"
                             f"shift_labels, ignore_index and num_items_in_batch as HF does; "
                             f"{asked} would ask HF's loss for something else: leave them out")
        from ulysses.mesh import flat_mesh

        group = flat_mesh(self.mesh, "sp").get_group()
        targets = hf_targets(labels=labels, shift_labels=shift_labels, ignore_index=ignore_index,
                             mesh=self.mesh, group=group, kwargs=kwargs
                             ).reshape(-1).to(logits.device)
        loss_sum = F.cross_entropy(logits.float().reshape(-1, vocab_size), targets,
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        averaged = True if self.model is None else resolve_sp_averaging(self.model,
                                                                         group.size(), None)
        return sp_token_loss(loss_sum, targets.ne(IGNORE_INDEX).sum(), group=group,
                             averaged_over_sp=averaged, num_items_in_batch=num_items_in_batch)


def install_sp_causal_lm_loss(model: nn.Module, mesh) -> None:
    """Give ``model`` (a HF ``PreTrainedModel``) the :class:`SPCausalLMLoss` as its
    ``loss_function``; a model whose loss is another one gets a loss that refuses."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return  # not a HF model: it has no loss of HF's to stand in for
    from transformers.loss.loss_utils import LOSS_MAPPING

    current = model.loss_function
    if isinstance(current, SPCausalLMLoss):
        current = current.replaced or LOSS_MAPPING["ForCausalLM"]
    model.loss_function = SPCausalLMLoss(
        mesh, None if current is LOSS_MAPPING["ForCausalLM"] else current, loss_arguments(model),
        model)
    old = getattr(model, "_sp_own_loss_hook", None)
    if old is not None:
        old.remove()
    if not _uses_loss_function(type(model)):
        model._sp_own_loss_hook = model.register_forward_pre_hook(_refuse_own_loss,
                                                                  with_kwargs=True)


def _uses_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss through ``self.loss_function`` (read from
    its source: transformers 5.13's Gemma3ForConditionalGeneration computes a cross-entropy
    of its own instead, which on the pieces would be this rank's loss alone)."""
    import inspect

    try:
        return "loss_function" in inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return False


def _refuse_own_loss(module, args, kwargs):
    if "forward" in vars(module):  # apply_sp_loss's forward computes the loss: honoured
        return
    if of_module(module).bind(args, kwargs).named.get("labels") is not None:
        raise ValueError(f"{type(module).__name__}.forward computes its loss itself, not "
                         f"through loss_function, so labels= on the pieces would give this "
                         f"rank's loss alone; use arctic.apply_sp_loss (the model then takes "
                         f"shift_labels from arctic.prepare_sp_batch), or compute the loss "
                         f"from the logits with arctic.sp_token_loss")


# --- the head's logit transform -----------------------------------------------------------------

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


@contextmanager
def _stubbed(module: nn.Module, forward: Callable) -> Iterator[None]:
    """``module.forward`` replaced by ``forward`` (an instance attribute) and its forward hooks
    set aside, both restored on exit. The hooks must not run in the probe: the SP batch hook of
    :func:`arctic.apply_sequence_parallel` would record the probe as the current batch, and
    FSDP2 or ZeRO-3 hooks gather parameters, while the probe must issue no collective."""
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    hooks = forward_hooks(module)
    set_forward_hooks(module, type(hooks[0])(), type(hooks[1])())
    module.forward = forward
    try:
        yield
    finally:
        set_forward_hooks(module, *hooks)
        if had:
            module.forward = old
        else:
            del module.forward


class _NotVerifiable(Exception):
    """The probe ran but found a forward the tiled loss does not mirror."""


@functools.cache
def _probe_output_type():
    from transformers.modeling_outputs import MoeModelOutputWithPast

    class _ProbeOutput(MoeModelOutputWithPast):
        """The stub base model's output: ``last_hidden_state`` and None for any other field a
        causal LM may read (MoE ``router_logits``, Mamba's ``cache_params``, ...)."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return _ProbeOutput


def _probe(model: nn.Module, base: nn.Module, head: nn.Module, vocab: int, hidden: int,
           weight: Tensor) -> tuple[Tensor, list[Tensor], Tensor, Any]:
    """Run the class's own forward with the base model returning a random ``h [1, T, E]`` and
    the lm_head returning a random float32 ``z [1, T, V]``; returns ``(h, what the head was
    called with, z, the forward's logits)``. Reads no weight and communicates nothing."""
    _ProbeOutput = _probe_output_type()
    # Meta and fake weights hold no values; the probe needs real ones (it reads no weight, so
    # CPU does). A fixed generator leaves the global RNG, and so training, untouched.
    device = torch.device("cpu") if weight.is_meta or is_fake(weight) else weight.device
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
    with _stubbed(base, base_forward), _stubbed(head, head_forward):
        # The class's forward: the instance's is ours after apply_sp_loss (and may be already).
        use_cache = of_module(model).name_of("use_cache")
        flags = {use_cache: False} if use_cache else {}
        out = type(model).forward(model, input_ids=ids, position_ids=positions, **flags)
    if not base_calls:
        raise _NotVerifiable(f"its forward does not call its base model "
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
    with unset_fake_temporarily(), torch.no_grad():
        try:
            h, seen, z, logits = _probe(model, base, head, shape[0], shape[1], weight)
        except _NotVerifiable as e:
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


# --- the loss --------------------------------------------------------------------------------

class _TiledHeadForward:
    """An lm_head instance's forward, replaced by the tiled logits + summed loss."""

    def __init__(self, head: nn.Module, tiles, group, transform: LogitTransform) -> None:
        self.head, self.tiles, self.group, self.transform = head, tiles, group, transform

    def __call__(self, hidden_BSE: Tensor, shift_labels_BS: Tensor,
                 logits_fn: Callable | None = None, labels_BS: Tensor | None = None):
        loss = tiled_logits_loss(hidden_BSE, self.head.weight, shift_labels_BS,
                                 tiles=self.tiles, group=self.group,
                                 logit_scale=self.transform.scale,
                                 logit_softcap=self.transform.softcap)
        if logits_fn is None:
            return loss
        # Inside the head's call: ZeRO-3 has gathered its weight for it.
        return (*loss, _reduced_logits(hidden_BSE, self.head.weight, logits_fn, labels_BS,
                                       self.tiles, self.group, self.transform))


def _reduced_logits(hidden_BSE: Tensor, weight_VE: Tensor, logits_fn: Callable,
                    labels_BS: Tensor | None, tiles, group, transform: LogitTransform) -> Tensor:
    """``logits_fn(logits, labels)`` over tiles of the sequence (``[B, t, V]`` logits, as the
    model's own head gives them, and the ``[B, t]`` labels of those positions), concatenated
    along the sequence. Without autograd: evaluation only."""
    from arctic.tiling import resolve_tiles

    B, S, _ = hidden_BSE.shape
    n = resolve_tiles(tiles, B * S, 2 * weight_VE.shape[0] * 4, group=group)
    size = -(-S // max(1, min(n, S)))
    outs = []
    with torch.no_grad():
        for start in range(0, S, size):
            h = hidden_BSE[:, start:start + size]
            z = _tile_logits(h, weight_VE, transform.scale, transform.softcap)
            out = logits_fn(z, None if labels_BS is None else labels_BS[:, start:start + size])
            if not torch.is_tensor(out) or out.shape[:2] != h.shape[:2]:
                raise ValueError(f"preprocess_logits_for_metrics must return a tensor per "
                                 f"position ([batch, positions, ...]) under sequence "
                                 f"parallelism: it runs on tiles of the sequence; got "
                                 f"{type(out).__name__} "
                                 f"{tuple(out.shape) if torch.is_tensor(out) else ''} for "
                                 f"logits {tuple(z.shape)}")
            outs.append(out)
            del z
    return torch.cat(outs, dim=1)


def _sp_mesh(model: nn.Module):
    """The mesh of the model's SP attention, or None."""
    for m in model.modules():
        settings = getattr(m, "sp_attention", None)
        if settings is not None:
            return settings.mesh
    return None


class _SPLossForward:
    """A causal LM instance's forward, replaced by the SP loss of one sharded batch."""

    def __init__(self, model: nn.Module, group, averaged_over_sp: bool | None,
                 router) -> None:
        self.model, self.group, self.averaged_over_sp = model, group, averaged_over_sp
        self.router = router  # arctic.router_loss: a RouterLoss, why not (str), or None
        self.loss_arguments = loss_arguments(model) - {"shift_labels", "num_items_in_batch",
                                                       "labels", "ignore_index"}

    def __call__(self, input_ids: Tensor, position_ids: Tensor,
                 shift_labels: Tensor | None = None,
                 num_items_in_batch: Tensor | int | None = None,
                 return_dict: bool | None = None, labels: Tensor | None = None,
                 ignore_index: int | None = None, logits_fn: Callable | None = None,
                 **kwargs: Any):
        if shift_labels is None and labels is None:
            raise ValueError("a model prepared with apply_sp_loss computes its loss from "
                             "shift_labels (arctic.data.prepare_sp_batch's, shifted before "
                             "sharding) or from labels (HF's unshifted form, this rank's "
                             "piece cut as input_ids is); got neither")
        # HF's other loss arguments would change HF's loss; this loss computes none of them.
        asked = sorted(n for n, v in kwargs.items() if n in self.loss_arguments and v is not None)
        if asked:
            raise ValueError(f"apply_sp_loss computes the token mean over the sequence-parallel "
                             f"group from shift_labels or labels (with ignore_index, divided by "
                             f"num_items_in_batch when given); {asked} would ask HF's loss for "
                             f"something else, which it does not reproduce: leave them out")
        mesh = _sp_mesh(self.model)
        if shift_labels is None and mesh is None:
            raise ValueError("labels= needs the model's sequence-parallel attention "
                             "(arctic.apply_sequence_parallel) to know how the sequence was "
                             "cut; give shift_labels from prepare_sp_batch instead")
        shift_labels = hf_targets(labels=labels, shift_labels=shift_labels, mesh=mesh,
                                  ignore_index=IGNORE_INDEX if ignore_index is None
                                  else int(ignore_index), group=self.group, kwargs=kwargs)
        # No KV cache in training: it would keep every layer's k/v alive until the step ends.
        base = base_model(self.model)
        use_cache = of_module(base).name_of("use_cache") or "use_cache"
        kwargs.setdefault(use_cache, False)
        token_mask = kwargs.pop("token_mask", None)
        router = self._router(kwargs.pop("output_router_logits", None))
        if router is not None:
            kwargs["output_router_logits"] = True
        with routed_by_sp_loss():
            out = base(input_ids=input_ids, position_ids=position_ids, **kwargs)
        hidden = out.last_hidden_state
        head = self.model.get_output_embeddings()
        if logits_fn is None:
            loss_sum, num_valid = head(hidden, shift_labels)
            reduced = None
        else:  # the labels of logits_fn: HF's unshifted ones, when given
            loss_sum, num_valid, reduced = head(hidden, shift_labels, logits_fn, labels)
        sp = dist.get_world_size(self.group) if dist.is_initialized() else 1
        averaged = resolve_sp_averaging(self.model, sp, self.averaged_over_sp)
        loss = sp_token_loss(loss_sum, num_valid, group=self.group, averaged_over_sp=averaged,
                             num_items_in_batch=num_items_in_batch)
        if router is not None:  # as HF's MoE forwards add it, to the loss of every call
            aux = router_loss(out.router_logits, router, token_mask=token_mask,
                              group=self.group, averaged_over_sp=averaged)
            loss = loss + router.coef * aux
            if return_dict:
                from transformers.modeling_outputs import MoeCausalLMOutputWithPast
                return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=reduced)
        if reduced is not None:
            if return_dict is False:
                return (loss, reduced)
            from transformers.modeling_outputs import CausalLMOutput
            return CausalLMOutput(loss=loss, logits=reduced)
        if return_dict is None:  # the loss itself
            return loss
        if not return_dict:  # as HF's tuple form: the loss first (no logits are computed)
            return (loss,)
        from transformers.modeling_outputs import CausalLMOutput
        return CausalLMOutput(loss=loss)

    def _router(self, asked: bool | None):
        """The router loss to add, when ``output_router_logits`` (the call's, else the
        config's) asks for it; ``ValueError`` when it cannot be computed here."""
        if asked is None:
            asked = bool(getattr(self.model.config, "output_router_logits", False))
        if not asked or self.router is None:  # no router loss: HF's forward adds none
            return None
        if isinstance(self.router, str):
            raise ValueError(f"output_router_logits=True: {self.router}; the SP loss cannot "
                             f"add it over the sequence-parallel group. Set "
                             f"output_router_logits=False")
        return self.router


@journaled
def apply_sp_loss(model: nn.Module, *, group, loss_tiles: int | str = "auto",
                  averaged_over_sp: bool | None = None) -> nn.Module:
    """Make ``model(input_ids=, position_ids=, shift_labels=)`` return the SP loss.

    ``labels=`` (HF's unshifted labels, this rank's piece cut as ``input_ids`` is) works as
    in HF: the targets are the next tokens' labels of the whole sequence, including the one
    that lives on the next rank (:func:`shift_labels_across_pieces`). ``ignore_index=`` names
    the label to ignore, as HF's. ``num_items_in_batch=`` (HF's name) divides the group's
    summed loss by it instead of the group's own count of valid labels: the loss of a
    micro-batch of an accumulated step. ``logits_fn=`` (evaluation: the Trainer's
    ``preprocess_logits_for_metrics``) is called on tiles of this rank's logits and labels
    (``[B, t, V]``, ``[B, t]``), and its per-position outputs, concatenated, come back as the
    output's ``logits`` (``return_dict=False``: ``(loss, outputs)``).
    ``return_dict=True`` returns a ``CausalLMOutput`` whose ``loss`` is the SP loss (its
    ``logits`` None: they are never materialised), ``return_dict=False`` the tuple ``(loss,)``.
    MoE models: with ``output_router_logits`` (the config's, or the call's) the router's
    load-balancing loss of the whole sequence is added with ``router_aux_loss_coef``, as HF's
    forward adds it (:mod:`arctic.router_loss`; ``return_dict=True`` then gives a
    ``MoeCausalLMOutputWithPast`` with its ``aux_loss``); the batch's ``token_mask`` leaves the
    cut's padding out of it.

    The batch is one from :func:`arctic.data.prepare_sp_batch`. The loss runs through module
    calls only (the base model, then the lm_head), so parameter-sharding hooks (ZeRO-3) fire
    where the parameters are used. The lm_head keeps its parameters and state_dict keys; its
    instance forward computes :func:`arctic.tiling.tiled_logits_loss` instead of logits, with
    the scale and softcap the model's own forward applies to them
    (:func:`find_logit_transform`). ``averaged_over_sp``: see :func:`sp_token_loss`; None
    (the default) follows the reduction that trains the model, found on it at each call
    (:mod:`arctic.grad_reduction`), and a value given is checked against it.

    Raises ``ValueError`` (model unchanged) if the head has a bias, or if the model's loss is
    not what the tiled loss computes (see :func:`find_logit_transform`).
    """
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias; the tiled loss computes "
                         f"hidden @ weight^T only. Train with the model's own loss instead")
    transform = find_logit_transform(model)
    router = find_router_loss(model)
    if isinstance(router, str) and getattr(model.config, "output_router_logits", False):
        raise ValueError(f"config.output_router_logits=True: {router}; the SP loss cannot "
                         f"add it over the sequence-parallel group. Set it False, or train "
                         f"with the model's own loss")
    record_apply(model, "tiling")  # after the checks: a refused call changes nothing
    head.forward = _TiledHeadForward(head, loss_tiles, group, transform)
    model.forward = _SPLossForward(model, group, averaged_over_sp, router)
    return model
