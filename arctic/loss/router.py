"""The MoE router's auxiliary (load-balancing) loss over the sequence-parallel group.

HF's MoE causal LMs (Mixtral, Qwen2/3-MoE, GPT-OSS, ...) add ``router_aux_loss_coef *
load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` to the LM loss
when ``output_router_logits`` is on. That loss is ``E * sum_e f_e * P_e``: ``f_e`` the share
of (token, top-k slot) assignments routed to expert e, ``P_e`` the mean router probability of
e, both over every token of every layer. A product of two means is not a mean over tokens, so
each rank's own value on its piece of the sequence is not a share of the sequence's: the
sums behind ``f`` and ``P`` and the token count are all-reduced over the SP group first,
and the loss is then HF's, equal on the group's ranks. Backward gives this rank's router
probabilities the gradient of the whole sequence's loss (scaled by sp for dp x sp gradient
averaging, as the LM loss is: :func:`arctic.loss.sp_token_loss`).

Padding the SP cut added (``arctic.data``'s ``token_mask``) counts for nothing, as the
padding of an ``attention_mask`` counts for nothing in HF's.

:func:`find_router_loss` reads ``num_experts`` and ``top_k`` from the config and checks them
against the model class's own forward with a weight-free probe (stub base model returning
random router logits, stub LM loss of 0), which also gives the weight the forward adds the
router loss with: a class whose forward computes another router loss is refused when the
loss is asked for.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from arctic.hf.anatomy import base_model
from arctic.hf.probe import probe_output_type, stubbed
from ulysses.patching import swapped_method
from ulysses.trace_shortcuts import is_traced, real_values

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class RouterLoss:
    """HF's router loss of one model: what it computes and the weight its forward adds it
    with (measured by the probe: the model's ``router_aux_loss_coef``)."""

    num_experts: int
    top_k: int
    coef: float


class _GroupSum(torch.autograd.Function):
    """Sum over the group; backward passes each rank the sum over the group of the gradients
    of the (equal) result, times ``scale``: exact whatever each rank does with it."""

    @staticmethod
    def forward(ctx, x, group, scale):
        ctx.group, ctx.scale = group, scale
        ctx.reduce = group is not None and dist.get_world_size(group) > 1
        out = x.clone()
        if ctx.reduce:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.scale, None, None


def router_loss(router_logits: tuple[Tensor, ...], spec: RouterLoss, *,
                token_mask: Tensor | None = None, group=None,
                averaged_over_sp: bool = True) -> Tensor:
    """HF's load-balancing loss of the whole sequence from this rank's ``router_logits`` (one
    ``[tokens, E]`` per layer, this rank's tokens); ``token_mask`` (``[tokens]`` or the batch's
    ``[B, s]``): the tokens that count. Every rank of ``group`` must call it."""
    if not router_logits:
        raise ValueError("no router logits came back from the base model")
    if torch.is_grad_enabled() and not all(r.requires_grad for r in router_logits):
        # the same on every rank, before the collectives below
        raise ValueError("the router logits carry no gradient: a tiled MLP or tiled layer "
                         "(ulysses.tiled_mlp / tiled_layer) runs its forward without autograd "
                         "and recomputes it in backward, so the router loss would not train "
                         "the router. Turn tiling off for this MoE model (tiled_mlp: null), "
                         "or set output_router_logits=False")
    device = router_logits[0].device
    counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(spec.num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if token_mask is None else token_mask.reshape(-1).to(device, torch.float32)
    for layer in router_logits:
        p = torch.softmax(layer.to(device), dim=-1)  # in the logits' dtype, as HF's
        chosen = torch.topk(p, spec.top_k, dim=-1).indices
        w = torch.ones(p.shape[0], device=device) if weight is None else weight
        if w.numel() != p.shape[0]:
            raise ValueError(f"token_mask has {w.numel()} entries for {p.shape[0]} router rows")
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(spec.top_k))
        probs = probs + (p.float() * w.unsqueeze(-1)).sum(0)
        rows = rows + w.sum()
    sp = dist.get_world_size(group) if group is not None else 1
    totals = torch.cat([counts, rows.reshape(1)])
    if sp > 1:
        dist.all_reduce(totals, group=group)
    # The framework's reduction averages the SP ranks' gradients, or adds them (then / sp).
    probs = _GroupSum.apply(probs, group, 1 if averaged_over_sp else 1 / sp)
    rows = totals[-1].clamp(min=1.0)
    return (totals[:-1] / rows * probs / rows).sum() * spec.num_experts


def _first(config, keys) -> int | None:
    for k in keys:
        value = getattr(config, k, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def find_router_loss(model: nn.Module) -> RouterLoss | str | None:
    """The router loss ``model``'s forward adds under ``output_router_logits``: a
    :class:`RouterLoss` checked by a probe, None when its forward takes no
    ``output_router_logits`` or computes no router loss (HF's forward adds none then, and
    neither does the SP loss), or a string saying why the one it computes is not this
    module's."""
    params = inspect.signature(type(model).forward).parameters
    if "output_router_logits" not in params and \
            not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    config, name = model.config, type(model).__name__
    experts, top_k = _first(config, EXPERT_KEYS), _first(config, TOP_K_KEYS)
    if experts is None and "output_router_logits" not in params:
        return None  # no experts named and no router flag of its own: a dense model
    if experts is None or top_k is None:
        return (f"{name}'s config does not give its experts and top-k under the names read "
                f"here ({EXPERT_KEYS}, {TOP_K_KEYS})")
    with real_values(), torch.no_grad():  # real values, also under the planner
        return _probe(model, name, RouterLoss(experts, top_k, 0.0))


def _probe(model: nn.Module, name: str, spec: RouterLoss) -> RouterLoss | str | None:
    base, head = base_model(model), model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    T, weight = 6, head.weight
    # Meta and fake weights hold no values; the probe reads none, so CPU does (ZeRO-3: the
    # partitioned weight's full shape is its ds_shape).
    device = torch.device("cpu") if weight.is_meta or is_traced(weight) else weight.device
    hidden_size = getattr(weight, "ds_shape", weight.shape)[1]
    vocab = getattr(weight, "ds_shape", weight.shape)[0]
    logits = tuple(torch.randn(T, spec.num_experts, generator=g).to(device) * 3
                   for _ in range(2))
    hidden = torch.zeros(1, T, hidden_size, device=device)
    out_type = probe_output_type()
    # The stubs take whatever the forward passes them: nothing it passes can change what
    # they return, which is the point of the probe. HF's loss_function property reads the
    # instance's _loss_function: stubbed (an LM loss of 0), then put back.
    zero_loss = lambda *args, **kwargs: torch.zeros((), device=device)  # noqa: E731
    try:
        with swapped_method(model, zero_loss, name="_loss_function"), \
                stubbed(base, lambda *args, **kwargs: out_type(last_hidden_state=hidden,
                                                             router_logits=logits)), \
                stubbed(head, lambda x: torch.zeros(1, T, vocab, device=device)):
            ids = torch.zeros(1, T, dtype=torch.long, device=device)
            out = type(model).forward(model, input_ids=ids, labels=ids,
                                      position_ids=torch.arange(T, device=device)[None],
                                      output_router_logits=True, use_cache=False)
    except Exception as e:  # a forward that cannot be probed is not honoured
        return f"{name}.forward could not be probed for its router loss ({type(e).__name__}: {e})"
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return None
    ours = router_loss(logits, spec)
    if not torch.allclose(torch.as_tensor(aux).float().cpu(), ours.cpu(), rtol=1e-5, atol=1e-6):
        return (f"{name}.forward's router loss ({float(aux):.6g} on the probe) is not HF's "
                f"load-balancing loss with {spec.num_experts} experts and top-{spec.top_k} "
                f"({float(ours):.6g})")
    # The weight the forward adds it with (its own router_aux_loss_coef): the loss of the
    # probe is that times the router loss, the LM loss being stubbed to 0.
    added = float(torch.as_tensor(out.loss).float()) if out.loss is not None else 0.0
    return RouterLoss(spec.num_experts, spec.top_k, added / float(aux))


__all__ = ["RouterLoss", "find_router_loss", "router_loss"]
