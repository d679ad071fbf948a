"""The SP loss as the model's forward: the tiled logits + loss on the lm_head, the token mean
over the SP group, HF's arguments honoured or refused (:func:`apply_sp_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from arctic.hf.anatomy import base_model
from arctic.hf.batch import routed_by_sp_loss
from arctic.hf.binding import of_module
from arctic.hf.features import loss_arguments
from arctic.loss.reduction import resolve_sp_averaging
from arctic.loss.router import find_router_loss, router_loss
from arctic.loss.tiled import IGNORE_INDEX, tile_logits, tiled_logits_loss
from arctic.loss.token import hf_targets, sp_token_loss
from arctic.loss.transform import LogitTransform, find_logit_transform
from arctic.order import record_apply
from arctic.tiling.tiles import resolve_tiles
from ulysses.patching import journaled, replace_method


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
    B, S, _ = hidden_BSE.shape
    n = resolve_tiles(tiles, B * S, 2 * weight_VE.shape[0] * 4, group=group)
    size = -(-S // max(1, min(n, S)))
    outs = []
    with torch.no_grad():
        for start in range(0, S, size):
            h = hidden_BSE[:, start:start + size]
            z = tile_logits(h, weight_VE, transform.scale, transform.softcap)
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
        self.router = router  # arctic.loss.router: a RouterLoss, why not (str), or None
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
    forward adds it (:mod:`arctic.loss.router`; ``return_dict=True`` then gives a
    ``MoeCausalLMOutputWithPast`` with its ``aux_loss``); the batch's ``token_mask`` leaves the
    cut's padding out of it.

    The batch is one from :func:`arctic.data.prepare_sp_batch`. The loss runs through module
    calls only (the base model, then the lm_head), so parameter-sharding hooks (ZeRO-3) fire
    where the parameters are used. The lm_head keeps its parameters and state_dict keys; its
    instance forward computes :func:`arctic.tiling.tiled_logits_loss` instead of logits, with
    the scale and softcap the model's own forward applies to them
    (:func:`find_logit_transform`). ``averaged_over_sp``: see :func:`sp_token_loss`; None
    (the default) follows the reduction that trains the model, found on it at each call
    (:mod:`arctic.loss.reduction`), and a value given is checked against it.

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
    replace_method(head, _TiledHeadForward(head, loss_tiles, group, transform))
    replace_method(model, _SPLossForward(model, group, averaged_over_sp, router))
    return model
