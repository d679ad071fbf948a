"""The data side of vision-language models under sequence parallelism (:mod:`arctic.hf.vlm`):
what cutting a VLM's batch needs to know of the model, and the cut of its images and videos.

A :class:`VisionInputs` (from :func:`arctic.vision_inputs`) holds plain values and pickles
(the cut runs in the loader's workers). For each modality the model embeds (images; Qwen's
videos too, :class:`Modality`) it numbers the modality's tokens of the full batch in the
order the model's forward scatters their embeddings (``masked_scatter``: row-major), cuts
that numbering as the tokens are cut, and gives each rank the items (images, videos) its
piece has tokens of, with the rows of their embeddings its tokens take (``*_embed_index``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

REFUSED_KEYS = {"mm_encoder_outputs": "precomputed vision features"}
"""Batch keys of VLM features that sequence parallelism does not implement."""


@dataclass(frozen=True)
class Modality:
    """One kind of visual input of a VLM, by the names its forward gives it."""

    name: str
    """``"image"`` or ``"video"``."""
    token_id: int
    """The placeholder token of its embeddings in ``input_ids``."""
    pixels: str
    """Its batch key: ``pixel_values`` or ``pixel_values_videos``."""
    grid: str | None
    """``image_grid_thw``/``video_grid_thw``: an item has ``prod(grid)`` patch rows of
    :attr:`pixels` and ``prod(grid) // merge**2`` tokens; None: one row of :attr:`pixels`
    and a fixed number of tokens per item (Gemma3)."""
    features: str
    """The base model's method that embeds it (``get_image_features``, ...)."""
    kind: int
    """Its value in ``mm_token_type_ids`` (image 1, video 2)."""
    per_item: tuple[str, ...] = ()
    """Batch keys with one entry per item, kept for the rank's items (Qwen2.5-VL's
    ``second_per_grid_ts``)."""

    @property
    def index(self) -> str:
        """The batch key of a rank's embedding rows: ``image_embed_index``, ..."""
        return f"{self.name}_embed_index"


def _rank_items(tokens: list[int], rows: Tensor) -> tuple[list[int], Tensor]:
    """The items (of ``tokens`` tokens each) the numbered ``rows`` of a piece fall in, and
    each row's place among the embeddings of those items alone. A piece with no row takes
    the smallest item (and keeps none of it)."""
    first = torch.tensor([0] + tokens).cumsum(0)
    wanted = rows[rows >= 0]  # the piece's row-major order
    item = torch.searchsorted(first[1:], wanted, right=True)
    mine = torch.unique(item).tolist() or [min(range(len(tokens)), key=tokens.__getitem__)]
    local = torch.zeros(len(tokens), dtype=torch.long)
    local[mine] = torch.tensor([0] + [tokens[i] for i in mine][:-1]).cumsum(0)
    return mine, local[item] + wanted - first[item]


@dataclass(frozen=True)
class VisionInputs:
    """What cutting a VLM's batch needs to know of the model (:func:`arctic.vision_inputs`)."""

    model: str
    """The model's class name, for messages."""
    modalities: tuple[Modality, ...]
    tokens_per_item: int | None = None
    """Tokens of every item of a modality without a grid (Gemma3's ``mm_tokens_per_image``)."""
    merge: int = 1
    """Spatial merge of a grid's patches into tokens (``merge**2`` patches a token)."""
    rope: Any = None
    """The base model's class and config (:class:`arctic.hf.vlm._ConfigSelf`), to call its
    ``get_rope_index`` (M-RoPE); None: 1-D positions."""
    cut_keys: tuple[str, ...] = ()
    """Batch keys ``[B, S]`` cut as the tokens are and passed on (Gemma3's
    ``token_type_ids``)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch keys read besides :data:`arctic.data.BATCH_KEYS`."""
        own = [k for m in self.modalities for k in (m.pixels, m.grid, *m.per_item) if k]
        return (*own, *(("mm_token_type_ids",) if self.rope else ()), *self.cut_keys,
                *REFUSED_KEYS)

    def _counts(self, batch: dict[str, Any], m: Modality) -> tuple[list[int], list[int]]:
        """Per item of ``m``: its tokens, and its rows of ``batch[m.pixels]``."""
        pixels = torch.as_tensor(batch[m.pixels])
        if m.grid is None:
            if pixels.dim() != 4:
                raise ValueError(f"{m.pixels} must be [{m.name}s, channels, height, width] as "
                                 f"{self.model}'s processor gives it, got {tuple(pixels.shape)}")
            return [self.tokens_per_item] * pixels.shape[0], [1] * pixels.shape[0]
        if batch.get(m.grid) is None:
            raise ValueError(f"{self.model}: {m.pixels} without {m.grid}")
        patches = torch.as_tensor(batch[m.grid]).reshape(-1, 3).prod(-1).tolist()
        if pixels.dim() != 2 or sum(patches) != pixels.shape[0]:
            raise ValueError(f"{m.pixels} must be the patches of every {m.name}, concatenated "
                             f"([patches, features], as {self.model}'s processor gives it): "
                             f"{m.grid} gives {sum(patches)} patches, {m.pixels} has shape "
                             f"{tuple(pixels.shape)}")
        return [p // self.merge ** 2 for p in patches], patches

    def full(self, batch: dict[str, Any], input_ids: Tensor, mask: Tensor | None):
        """Of the full batch: the text positions (None: not given), the M-RoPE positions
        ``[3, B, S]`` (None for a model without), and per modality each of its tokens' row
        among all the batch's embeddings of it (``[B, S]``, -1 for other tokens)."""
        for key, what in REFUSED_KEYS.items():
            if batch.get(key) is not None:
                raise ValueError(f"{key}: {what} are not implemented under sequence "
                                 f"parallelism for {self.model}; leave them out")
        rows = {}
        for m in self.modalities:
            placed = input_ids == m.token_id
            found = int(placed.sum())
            if batch.get(m.pixels) is None:
                if found:
                    raise ValueError(f"input_ids hold {found} {m.name} tokens but the batch has "
                                     f"no {m.pixels}")
                continue
            tokens, _ = self._counts(batch, m)
            if sum(tokens) != found:
                raise ValueError(f"input_ids hold {found} {m.name} tokens, the batch's "
                                 f"{m.name}s give {sum(tokens)}")
            rows[m.name] = torch.full(input_ids.shape, -1, dtype=torch.long)
            rows[m.name][placed] = torch.arange(found)  # row-major: masked_scatter's order
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
        if kinds is None:  # as the processor marks them
            kinds = torch.zeros_like(input_ids, dtype=torch.int)
            for m in self.modalities:
                kinds[input_ids == m.token_id] = m.kind
        given = {"input_ids": input_ids, "mm_token_type_ids": torch.as_tensor(kinds),
                 "attention_mask": mask}
        for m in self.modalities:
            given.update({k: batch.get(k) for k in (m.grid, *m.per_item) if k})
        params = inspect.signature(rope).parameters
        positions, _ = rope(**{k: v for k, v in given.items() if k in params})
        return positions

    def rank_inputs(self, batch: dict[str, Any], rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's items of each modality, with their ``*_embed_index``, from its piece
        of the ``rows`` that :meth:`full` numbered."""
        out = {}
        for m in self.modalities:
            if m.name not in rows:
                continue
            tokens, pixel_rows = self._counts(batch, m)
            mine, index = _rank_items(tokens, rows[m.name])
            pixels = torch.as_tensor(batch[m.pixels])
            start = [0] + torch.tensor(pixel_rows).cumsum(0).tolist()
            out[m.pixels] = torch.cat([pixels[start[i]:start[i + 1]] for i in mine])
            out[m.index] = index
            for key in (m.grid, *m.per_item):
                if key and batch.get(key) is not None:
                    out[key] = torch.as_tensor(batch[key])[mine]
        return out


__all__ = ["Modality", "REFUSED_KEYS", "VisionInputs"]
