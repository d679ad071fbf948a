"""Vision-language models under sequence parallelism: each rank encodes its own images.

A VLM's forward (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma3) embeds the text, runs the vision
tower on the batch's images (and Qwen's on its videos), scatters their embeddings into their
tokens' places (``masked_scatter``, in the row-major order of those tokens), and runs its
language model on the merged sequence. Under sequence parallelism the merged sequence is
what is cut:

- **The data path** (:func:`arctic.data.prepare_sp_batch` with ``vision=``, a
  :class:`arctic.data.vision.VisionInputs` from :func:`vision_inputs`) sees the full batch. It
  numbers the image (and video) tokens of the full batch in the model's order, computes the
  M-RoPE positions of the full sequence with the model's own ``get_rope_index``, and cuts
  both as it cuts the tokens. Each rank then keeps the images its piece has tokens of
  (``pixel_values``, and ``image_grid_thw`` where the model has one), and
  ``image_embed_index``: for each image token of its piece, in its row-major order, the
  row of that token's embedding among the embeddings of the rank's images; videos the same
  way (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``,
  ``video_embed_index``). An image the cut splits is encoded whole by each rank that holds
  a part of it, so its vision attention sees all of it; no rank encodes the images of other
  ranks. A rank with no image token encodes the batch's smallest image and keeps none of
  it, so that every rank runs the vision tower once per forward (sharded vision parameters
  gather on all ranks alike).
- **The model** (:func:`install_vision`, by :func:`arctic.apply_sequence_parallel`): a
  pre-hook on the VLM's base model takes the ``*_embed_index`` out of the call, and the
  base model's ``get_image_features`` and ``get_video_features`` (instance wrappers around
  the class's own) return those rows of what the vision tower computed
  (``deepstack_features`` too, Qwen3-VL's), so the model's own forward scatters exactly the
  piece's embeddings. The vision tower keeps its own attention implementation; only the
  language model's is switched.

M-RoPE positions go to the model as ``[4, B, s]``: the text positions first (transformers'
packed format; they restart at the cut's padding, a document of its own), then the three
M-RoPE rows. Gemma3's ``token_type_ids`` are cut with the tokens: where they mark an image
(runs of 1), transformers lets the image's tokens attend to each other in both directions,
and so does the sequence-parallel attention (the batch hook gathers them, and each run is a
block of :mod:`ulysses.blocks`; not on a ring). What is refused, each with a ``ValueError``
before any collective: precomputed ``mm_encoder_outputs``, pixel values without their
``*_embed_index`` (a batch not cut by the data path), and VLM families other than these.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from arctic.data.vision import REFUSED_KEYS, Modality, VisionInputs
from arctic.hf.anatomy import base_model, language_model
from arctic.hf.binding import of_module
from ulysses.patching import bound, replace_method


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
        return functools.partial(value, self) if inspect.isfunction(value) else value


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
    merge = getattr(getattr(base, "visual", None), "spatial_merge_size", None)
    takes = inspect.signature(type(base).forward).parameters
    if callable(getattr(type(base), "get_rope_index", None)) and merge and token is not None:
        found = [Modality("image", int(token), "pixel_values", "image_grid_thw",
                          "get_image_features", 1)]
        video = getattr(config, "video_token_id", None)
        if video is not None and "pixel_values_videos" in takes and \
                callable(getattr(base, "get_video_features", None)):
            per = ("second_per_grid_ts",) if "second_per_grid_ts" in takes else ()
            found.append(Modality("video", int(video), "pixel_values_videos", "video_grid_thw",
                                  "get_video_features", 2, per))
        return VisionInputs(name, tuple(found), None, int(merge),
                            _ConfigSelf(type(base), config))
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed and token is not None and hasattr(base, "multi_modal_projector"):
        image = Modality("image", int(token), "pixel_values", None, "get_image_features", 1)
        blocks = (image_block_key(model),) if image_block_key(model) else ()
        return VisionInputs(name, (image,), int(fixed), cut_keys=blocks)
    raise ValueError(f"{name}: sequence parallelism supports the images of Qwen2-VL, "
                     f"Qwen2.5-VL, Qwen3-VL and Gemma3 and the videos of the first three "
                     f"(models whose vision tokens and M-RoPE positions were read); this "
                     f"VLM's are not. Train it without sequence parallelism")


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


def _pick(x, index: Tensor):
    """The rows ``index`` of per-token features: a tuple of per-item ``[n_i, E]``, or a
    tensor ``[n, E]`` or ``[items, tokens, E]``, returned in the same form."""
    if isinstance(x, (tuple, list)):
        return (torch.cat(list(x)).index_select(0, index.to(x[0].device)),)
    if x.dim() == 3:
        rows = x.reshape(-1, x.shape[-1]).index_select(0, index.to(x.device))
        return rows.unsqueeze(0)
    return x.index_select(0, index.to(x.device))


def _picking(stock, held: dict, name: str):
    """``stock`` (a base model's ``get_*_features``) returning only the rows ``held[name]``
    names (taken once); the stock result outside the model's forward."""

    def features(*args, **kwargs):
        out = stock(*args, **kwargs)
        index = held.pop(name, None)
        if index is None:
            return out
        out.pooler_output = _pick(out.pooler_output, index)
        deep = getattr(out, "deepstack_features", None)
        if deep is not None:
            out.deepstack_features = [_pick(f, index) for f in deep]
        return out

    return features


def install_vision(model: nn.Module, vision: VisionInputs) -> None:
    """Make the VLM ``model`` scatter this rank's image (and video) embeddings only (the
    module doc); called by :func:`arctic.apply_sequence_parallel` with ``vision``, what
    :func:`vision_inputs` read of the model. Applying again replaces what an earlier call
    installed."""
    base = base_model(model)
    modalities = vision.modalities
    held: dict[str, Tensor] = {}  # the current forward's indices, by modality

    def before(module, args, kwargs):
        indices = {m.name: kwargs.pop(m.index, None) for m in modalities}
        call = of_module(module).bind(args, kwargs)
        given = {**call.extra, **call.named}
        for key, what in REFUSED_KEYS.items():
            if given.get(key) is not None:
                raise ValueError(f"{key}: {what} are not implemented under sequence "
                                 f"parallelism for {type(model).__name__}; leave them out")
        for m in modalities:
            if (given.get(m.pixels) is None) != (indices[m.name] is None):
                have, lack = (m.index, m.pixels) if given.get(m.pixels) is None else \
                    (m.pixels, m.index)
                raise ValueError(f"{have} without {lack}: under sequence parallelism each "
                                 f"rank encodes its own {m.name}s; cut the batch with "
                                 f"arctic.prepare_sp_batch(batch, mesh, "
                                 f"vision=arctic.vision_inputs(model))")
        held.clear()
        held.update({k: v for k, v in indices.items() if v is not None})
        return args, kwargs

    def after(module, args, output):
        held.clear()

    for name in ("_sp_vision_hook", "_sp_vision_done"):
        old = getattr(base, name, None)
        if old is not None:
            old.remove()
    for m in modalities:
        replace_method(base, _picking(bound(base, getattr(type(base), m.features)), held, m.name),
                       name=m.features)
    base._sp_vision_hook = base.register_forward_pre_hook(before, with_kwargs=True)
    base._sp_vision_done = base.register_forward_hook(after)


__all__ = ["BLOCK_MODELS", "VisionInputs", "image_block_key", "install_vision", "is_vlm",
           "vision_inputs"]
