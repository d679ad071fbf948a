"""Vision-language models under sequence parallelism: each rank encodes its own images.

A VLM's forward (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma3) embeds the text, runs the vision
tower on the batch's images, scatters the image embeddings into the image tokens' places
(``masked_scatter``, in the row-major order of the image tokens), and runs its language
model on the merged sequence. Under sequence parallelism the merged sequence is what is cut:

- **The data path** (:func:`arctic.data.prepare_sp_batch` with ``vision=``, a
  :class:`VisionInputs` from :func:`vision_inputs`) sees the full batch. It numbers the
  image tokens of the full batch in the model's order (``embed_rows``), computes the
  M-RoPE positions of the full sequence with the model's own ``get_rope_index``, and cuts
  both as it cuts the tokens. Each rank then keeps the images its piece has tokens of
  (``pixel_values``, and ``image_grid_thw`` where the model has one), and
  ``image_embed_index``: for each image token of its piece, in its row-major order, the
  row of that token's embedding among the embeddings of the rank's images. An image the cut
  splits is encoded whole by each rank that holds a part of it, so its vision attention
  sees all of it; no rank encodes the images of other ranks. A rank with no image token
  encodes the batch's smallest image and keeps none of it, so that every rank runs the
  vision tower once per forward (sharded vision parameters gather on all ranks alike).
- **The model** (:func:`install_vision`, by :func:`arctic.apply_sequence_parallel`): a
  pre-hook on the VLM's base model takes ``image_embed_index`` out of the call, and the
  base model's ``get_image_features`` (an instance wrapper around the class's own) returns
  those rows of what the vision tower computed (``deepstack_features`` too, Qwen3-VL's), so
  the model's own forward scatters exactly the piece's image embeddings. The vision tower
  keeps its own attention implementation; only the language model's is switched.

M-RoPE positions go to the model as ``[4, B, s]``: the text positions first (transformers'
packed format; they restart at the cut's padding, a document of its own), then the three
M-RoPE rows. Gemma3's ``token_type_ids`` are cut with the tokens: where they mark an image
(runs of 1), transformers lets the image's tokens attend to each other in both directions,
and so does the sequence-parallel attention (the batch hook gathers them, and each run is a
block of :mod:`ulysses.blocks`; not on a ring). What is refused, each with a ``ValueError``
before any collective: videos (``pixel_values_videos``), precomputed ``mm_encoder_outputs``,
``pixel_values`` without ``image_embed_index`` (a batch not cut by the data path), and VLM
families other than these.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from arctic.anatomy import base_model, language_model
from arctic.hf_binding import of_module

INDEX_KEY = "image_embed_index"
"""The batch key of each rank's image-token rows (:func:`install_vision` reads it)."""
REFUSED_KEYS = {
    "pixel_values_videos": "videos",
    "video_grid_thw": "videos",
    "second_per_grid_ts": "videos (their time stamps)",
    "mm_encoder_outputs": "precomputed vision features",
}
"""Batch keys of VLM features that sequence parallelism does not implement."""


def is_vlm(model: nn.Module) -> bool:
    """Whether ``model`` is a vision-language model: its base model holds a language model
    beside a vision tower and embeds images (``get_image_features``)."""
    base = base_model(model)
    return language_model(model) is not base and callable(getattr(base, "get_image_features",
                                                                  None))


class _ConfigSelf:
    """``self`` for a transformers model method that reads only ``self.config`` and the
    class's other methods (``get_rope_index``), so that the data path can run it without the
    model (and pickle it into loader workers)."""

    def __init__(self, cls: type, config) -> None:
        self.cls, self.config = cls, config

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("cls", "config"):
            raise AttributeError(name)
        value = getattr(self.cls, name)
        return types.MethodType(value, self) if inspect.isfunction(value) else value


@dataclass(frozen=True)
class VisionInputs:
    """What cutting a VLM's batch needs to know of the model (:func:`vision_inputs`); plain
    values, so that it pickles."""

    model: str
    """The model's class name, for messages."""
    image_token_id: int
    tokens_per_image: int | None
    """Tokens of every image (Gemma3's ``mm_tokens_per_image``; one ``pixel_values`` row per
    image); None: ``prod(image_grid_thw) // merge**2`` per image, ``prod(image_grid_thw)``
    patch rows of ``pixel_values`` each (Qwen)."""
    merge: int = 1
    rope: _ConfigSelf | None = None
    """The base model's class and config, to call its ``get_rope_index`` (M-RoPE)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch keys read besides :data:`arctic.data.BATCH_KEYS`."""
        own = ("token_type_ids",) if self.rope is None else ("image_grid_thw",
                                                            "mm_token_type_ids")
        return ("pixel_values", *own, *REFUSED_KEYS)

    @property
    def cut_keys(self) -> tuple[str, ...]:
        """Batch keys ``[B, S]`` cut as the tokens are and passed to the model."""
        return ("token_type_ids",) if self.rope is None else ()

    def _counts(self, batch: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Per image: its tokens, and its rows of ``pixel_values``."""
        pixels = torch.as_tensor(batch["pixel_values"])
        if self.tokens_per_image is not None:
            n = pixels.shape[0]
            return [self.tokens_per_image] * n, [1] * n
        grid = batch.get("image_grid_thw")
        if grid is None:
            raise ValueError(f"{self.model}: pixel_values without image_grid_thw")
        patches = torch.as_tensor(grid).prod(-1).tolist()
        if sum(patches) != pixels.shape[0]:
            raise ValueError(f"image_grid_thw gives {sum(patches)} patches, pixel_values has "
                             f"{pixels.shape[0]} rows")
        return [p // self.merge ** 2 for p in patches], patches

    def full(self, batch: dict[str, Any], input_ids: Tensor, mask: Tensor | None):
        """Of the full batch: the text positions (None: not given), the M-RoPE positions
        ``[3, B, S]`` (None for a model without), and each image token's row among all the
        batch's image embeddings (``[B, S]``, -1 for other tokens)."""
        for key, what in REFUSED_KEYS.items():
            if batch.get(key) is not None:
                raise ValueError(f"{key}: {what} are not implemented under sequence "
                                 f"parallelism for {self.model}; leave them out")
        images = input_ids == self.image_token_id
        found = int(images.sum())
        rows = torch.full(input_ids.shape, -1, dtype=torch.long)
        if batch.get("pixel_values") is None:
            if found:
                raise ValueError(f"input_ids hold {found} image tokens but the batch has no "
                                 f"pixel_values")
        else:
            tokens, _ = self._counts(batch)
            if sum(tokens) != found:
                raise ValueError(f"input_ids hold {found} image tokens, the batch's images "
                                 f"give {sum(tokens)}")
            rows[images] = torch.arange(found)  # row-major: masked_scatter's order
        text = batch.get("position_ids")
        if self.rope is None:
            return text, None, rows
        if text is None:
            return None, self._rope(batch, input_ids, mask), rows
        text = torch.as_tensor(text)
        if text.dim() == 3 and text.shape[0] in (3, 4):
            return (text[0] if text.shape[0] == 4 else None), text[-3:], rows
        raise ValueError(f"{self.model} takes M-RoPE position_ids [3, batch, seq] or [4, batch, "
                         f"seq] (text positions first), or none (computed here with its "
                         f"get_rope_index); got shape {tuple(text.shape)}")

    def _rope(self, batch, input_ids: Tensor, mask: Tensor | None) -> Tensor:
        rope = self.rope.get_rope_index
        kinds = batch.get("mm_token_type_ids")
        if kinds is None:
            kinds = (input_ids == self.image_token_id).int()
        given = {"input_ids": input_ids, "mm_token_type_ids": torch.as_tensor(kinds),
                 "image_grid_thw": batch.get("image_grid_thw"), "attention_mask": mask}
        params = inspect.signature(rope).parameters
        positions, _ = rope(**{k: v for k, v in given.items() if k in params})
        return positions

    def rank_inputs(self, batch: dict[str, Any], rows: Tensor) -> dict[str, Tensor]:
        """This rank's images and ``image_embed_index`` from its piece of the ``rows`` that
        :meth:`full` numbered."""
        if batch.get("pixel_values") is None:
            return {}
        pixels = torch.as_tensor(batch["pixel_values"])
        tokens, pixel_rows = self._counts(batch)
        first = torch.tensor([0] + tokens).cumsum(0)
        wanted = rows[rows >= 0]  # the piece's row-major order
        image = torch.searchsorted(first[1:], wanted, right=True)
        mine = torch.unique(image).tolist() or [min(range(len(tokens)), key=tokens.__getitem__)]
        local = torch.zeros(len(tokens), dtype=torch.long)
        local[mine] = torch.tensor([0] + [tokens[i] for i in mine][:-1]).cumsum(0)
        index = local[image] + wanted - first[image]
        start = [0] + torch.tensor(pixel_rows).cumsum(0).tolist()
        out = {"pixel_values": torch.cat([pixels[start[i]:start[i + 1]] for i in mine]),
               INDEX_KEY: index}
        if self.tokens_per_image is None:
            out["image_grid_thw"] = torch.as_tensor(batch["image_grid_thw"])[mine]
        return out


def vision_inputs(model: nn.Module) -> VisionInputs:
    """What :func:`arctic.data.prepare_sp_batch` needs (its ``vision=``) to cut batches of the
    VLM ``model``; ``ValueError`` for a model that is not one of the supported families."""
    name, base, config = type(model).__name__, base_model(model), model.config
    if not is_vlm(model):
        raise ValueError(f"{name} is not a vision-language model (no language model beside a "
                         f"vision tower)")
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    visual = getattr(base, "visual", None)
    merge = getattr(visual, "spatial_merge_size", None)
    if callable(getattr(type(base), "get_rope_index", None)) and merge and token is not None:
        return VisionInputs(name, int(token), None, int(merge), _ConfigSelf(type(base), config))
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed and token is not None and hasattr(base, "multi_modal_projector"):
        return VisionInputs(name, int(token), int(fixed))
    raise ValueError(f"{name}: sequence parallelism supports the images of Qwen2-VL, "
                     f"Qwen2.5-VL, Qwen3-VL and Gemma3 (models whose image tokens and M-RoPE "
                     f"positions were read); this VLM's are not. Train it without sequence "
                     f"parallelism")


def image_block_key(model: nn.Module) -> str | None:
    """The argument of the VLM's base model whose runs of 1 are image blocks that attend
    both ways (Gemma3's ``token_type_ids``, read in transformers 5.13 and 5.24), or None."""
    base = base_model(model)
    if type(base).__name__ in BLOCK_MODELS and "token_type_ids" in \
            inspect.signature(type(base).forward).parameters:
        return "token_type_ids"
    return None


BLOCK_MODELS = ("Gemma3Model",)
"""VLM base models whose ``token_type_ids`` make each image's tokens attend to each other in
both directions (``create_masks_for_vision_model``)."""


class _VisionState:
    """The current forward's ``image_embed_index`` (None outside a forward)."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index: Tensor | None = None


def _pick(x, index: Tensor):
    """The rows ``index`` of per-token features: a tuple of per-image ``[n_i, E]``, or a
    tensor ``[n, E]`` or ``[images, tokens, E]``, returned in the same form."""
    if isinstance(x, (tuple, list)):
        return (torch.cat(list(x)).index_select(0, index.to(x[0].device)),)
    if x.dim() == 3:
        rows = x.reshape(-1, x.shape[-1]).index_select(0, index.to(x.device))
        return rows.unsqueeze(0)
    return x.index_select(0, index.to(x.device))


def install_vision(model: nn.Module) -> None:
    """Make the VLM ``model`` scatter this rank's image embeddings only (the module doc);
    called by :func:`arctic.apply_sequence_parallel` after :func:`vision_inputs` accepted
    the model. Applying again replaces what an earlier call installed."""
    base = base_model(model)
    state = _VisionState()
    stock = types.MethodType(type(base).get_image_features, base)

    def get_image_features(*args, **kwargs):
        out = stock(*args, **kwargs)
        index, state.index = state.index, None
        if index is None:  # called outside the model's forward: the stock result
            return out
        out.pooler_output = _pick(out.pooler_output, index)
        deep = getattr(out, "deepstack_features", None)
        if deep is not None:
            out.deepstack_features = [_pick(f, index) for f in deep]
        return out

    def before(module, args, kwargs):
        index = kwargs.pop(INDEX_KEY, None)
        call = of_module(module).bind(args, kwargs)
        given = {**call.extra, **call.named}
        for key, what in REFUSED_KEYS.items():
            if given.get(key) is not None:
                raise ValueError(f"{key}: {what} are not implemented under sequence "
                                 f"parallelism for {type(model).__name__}; leave them out")
        pixels = given.get("pixel_values")
        if (pixels is None) != (index is None):
            raise ValueError(f"{'pixel_values' if index is None else INDEX_KEY} without "
                             f"{INDEX_KEY if index is None else 'pixel_values'}: under sequence "
                             f"parallelism each rank encodes its own images; cut the batch "
                             f"with arctic.prepare_sp_batch(batch, mesh, "
                             f"vision=arctic.vision_inputs(model))")
        state.index = index
        return args, kwargs

    def after(module, args, output):
        state.index = None

    for name in ("_sp_vision_hook", "_sp_vision_done"):
        old = getattr(base, name, None)
        if old is not None:
            old.remove()
    base.get_image_features = get_image_features
    base._sp_vision_hook = base.register_forward_pre_hook(before, with_kwargs=True)
    base._sp_vision_done = base.register_forward_hook(after)


__all__ = ["BLOCK_MODELS", "INDEX_KEY", "VisionInputs", "image_block_key", "install_vision",
           "is_vlm", "vision_inputs"]
