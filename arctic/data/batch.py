"""Turn ordinary causal-LM batches into sequence-parallel ones.

:func:`prepare_sp_batch` works on the full batch, identical on every rank of an SP group:

1. ``position_ids``: given ones are kept (packed documents restart them); otherwise
   ``arange(S)`` per row. Documents start where they restart, and where flash-attn's varlen
   arguments say (``cu_seq_lens_q``, as transformers' ``DataCollatorWithFlattening(
   return_flash_attn_kwargs=True)`` gives them; positions may then count on across documents
   but must not restart inside one).
2. ``shift_labels``: ``labels[:, 1:]`` moved left, ``-100`` at the end of every row and of
   every document (a document's last token must not predict the next document's first), and
   wherever ``attention_mask`` is 0. A batch may give ``shift_labels`` itself instead of
   ``labels`` (HF's pre-shifted form, each token's own target): they are taken as they are,
   with ``-100`` where ``attention_mask`` is 0.
3. Padding up to what the mesh splits evenly (``2 R U`` with a zigzag ring): ``input_ids``
   get ``pad_token_id`` and ``shift_labels`` -100. The padding (this tail, and the tokens
   ``attention_mask`` marks 0) is a document of its own: its positions restart at 0, so no
   real token sees it, with a causal mask or without one (bidirectional models).
4. Each tensor is cut with :func:`ulysses.shard_sequence`, so zigzag order applies when the
   mesh has a ring. On a mesh built with ``per_document`` each row is cut by its documents
   (the padding one included), and the batch also carries them as flash-attn's varlen
   arguments of the full batch (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``), which the
   model's sequence-parallel attention reads (:mod:`arctic.hf.batch`).

Shifting before sharding matters: after sharding, the label of a piece's last token lives on
the next rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from arctic.data.same_batch import check_same_batch
from arctic.data.vision import VisionInputs
from arctic.hf.batch import varlen_documents
from ulysses.mesh import check_mesh, mesh_dims
from ulysses.sharding import held_positions, seq_split, sp_rank_of
from ulysses.trace_shortcuts import is_traced

IGNORE_INDEX = -100


BATCH_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids",
              "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""What a batch may hold (``seq_idx`` too, checked and dropped); any other key is refused."""


def _pad_right(x: Tensor, length: int, value) -> Tensor:
    return torch.nn.functional.pad(x, (0, length - x.shape[-1]), value=value)


def prepare_sp_batch(batch: dict[str, Any], mesh: DeviceMesh, *, pad_token_id: int = 0,
                     vision: VisionInputs | None = None) -> dict[str, Tensor]:
    """This rank's shard of a causal-LM batch; see the module doc for the steps.

    The SP group's ranks must be given the same full batch: a fingerprint of it is
    all-gathered over the group (a few integers per batch), and a batch that differs is a
    ``ValueError`` on every rank of the group, naming the sampler to use
    (:func:`arctic.sp_sampler`).

    Args:
        batch: ``input_ids [B, S]`` (required), optional ``labels [B, S]`` (default: the
            input ids) or ``shift_labels [B, S]`` (pre-shifted: taken as given),
            ``attention_mask [B, S]`` (right padding only), ``position_ids``
            and flash-attn's varlen arguments (``cu_seq_lens_q``/``_k``,
            ``max_length_q``/``_k``) over the flattened batch.
        mesh: the SP mesh; batches are cut in its sequence layout (zigzag over a ring, or
            not), the one the attention reads from it too.
        pad_token_id: what pads ``input_ids`` up to what the mesh splits evenly.
        vision: for a vision-language model, :func:`arctic.vision_inputs` of it: the batch
            may then hold its images (``pixel_values``, ``image_grid_thw``,
            ``mm_token_type_ids``; Gemma3's ``token_type_ids``) and Qwen's videos
            (``pixel_values_videos``, ``video_grid_thw``), and each rank gets the images and
            videos its piece has tokens of, with ``image_embed_index`` /
            ``video_embed_index``, and M-RoPE ``position_ids [4, B, s]`` where the model uses
            them (:mod:`arctic.hf.vlm`).

    Returns:
        ``input_ids``, ``position_ids`` and ``shift_labels``, each ``[B, S_pad / sp]``.
        Pass the first two to the model and ``shift_labels`` to the loss. On a
        ``per_document`` mesh, or when the batch gave them, also ``cu_seq_lens_q``/``_k``
        (int32, the document bounds of the padded full batch, flattened; the padding is a
        document of its own) and ``max_length_q``/``_k``: pass them to the model too
        (``model(**batch)`` does). When the batch is padded (its ``attention_mask``, or the
        cut's padding to a multiple of the SP degree), ``token_mask`` (bool, True for the
        batch's own tokens): the SP loss reads it for the MoE router loss, and the model's
        base drops it.
    """
    check_mesh(mesh)
    cut = SequenceCut.of(mesh, vision)  # its ValueErrors come before the collective below
    check_same_batch(batch, mesh)
    return cut(batch, pad_token_id)


@dataclass(frozen=True)
class SequenceCut:
    """What cutting a batch for one rank needs of the mesh: plain values, so that it pickles
    (a collate function runs in the loader's worker processes; a mesh does not pickle)."""
    split: Any  # ulysses.sharding's sequence layout
    sp_rank: int
    divisor: int
    vision: VisionInputs | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh, vision: VisionInputs | None = None) -> "SequenceCut":
        if vision is not None and not isinstance(vision, VisionInputs):
            raise ValueError(f"vision must be arctic.vision_inputs(model), got "
                             f"{type(vision).__name__}")
        return cls(seq_split(mesh), sp_rank_of(mesh), mesh_dims(mesh).seq_len_divisor, vision)

    def __call__(self, batch: dict[str, Any], pad_token_id: int) -> dict[str, Tensor]:
        if "input_ids" not in batch:
            raise ValueError(f"batch needs input_ids, got keys {sorted(batch)}")
        known = set(BATCH_KEYS) | set(self.vision.keys if self.vision else ())
        unread = sorted(set(batch) - known - {"seq_idx"})
        if unread:
            raise ValueError(f"batch keys {unread} are not read by sequence parallelism (it cuts "
                             f"{list(BATCH_KEYS)}); dropping them would change what the model "
                             f"computes. Leave them out of the batch, or train this model "
                             f"without sequence parallelism")
        input_ids = torch.as_tensor(batch["input_ids"])
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape "
                             f"{tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if batch.get("labels") is not None and batch.get("shift_labels") is not None:
            raise ValueError("the batch has labels and shift_labels: give one (labels are "
                             "shifted here, before the cut; shift_labels are taken as they are)")
        labels = torch.as_tensor(batch.get("labels", input_ids)).clone()
        given_shift = batch.get("shift_labels")
        checked = ("labels", "shift_labels", "attention_mask") + (
            self.vision.cut_keys if self.vision else ("position_ids",))
        for name in checked:
            if name in batch and tuple(torch.as_tensor(batch[name]).shape) != (B, S):
                raise ValueError(f"{name} shape {tuple(torch.as_tensor(batch[name]).shape)} "
                                 f"does not match input_ids {(B, S)}")
        mask = batch.get("attention_mask")
        if mask is not None:
            mask = torch.as_tensor(mask).bool()
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask has left or inner padding; sequence parallelism "
                                 "supports right padding only (or pack without padding)")
            labels[~mask] = IGNORE_INDEX
        position_ids, mrope, rows = batch.get("position_ids"), None, None
        if self.vision is not None:
            position_ids, mrope, rows = self.vision.full(batch, input_ids, mask)
            for name, t in (("position_ids", position_ids), ("M-RoPE position_ids", mrope)):
                if t is not None and tuple(t.shape[-2:]) != (B, S):
                    raise ValueError(f"{name} shape {tuple(t.shape)} does not match "
                                     f"input_ids {(B, S)}")
        if position_ids is None:
            position_ids = torch.arange(S).expand(B, S)
        position_ids = torch.as_tensor(position_ids)
        # Documents: where positions restart, and those flash-attn's varlen arguments name.
        breaks = torch.zeros(B, S, dtype=torch.bool)
        breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        varlen = varlen_documents(batch, B, S)
        if varlen is not None:
            named = torch.zeros_like(breaks)
            for b, row in enumerate(varlen):
                named[b, list(row[1:])] = True
            stray = (breaks & ~named).nonzero().tolist()
            if stray:
                raise ValueError(f"position_ids restart at (row, position) {stray[:4]}, inside a "
                                 f"document that cu_seq_lens_q gives; they must describe the "
                                 f"same documents")
            breaks |= named
        if "seq_idx" in batch:
            _check_seq_idx(torch.as_tensor(batch["seq_idx"]), breaks)

        if given_shift is not None:  # HF's pre-shifted targets, each token's own: as given
            shift = torch.as_tensor(given_shift).clone()
            if mask is not None:
                shift[~mask] = IGNORE_INDEX
        else:
            shift = torch.full_like(labels, IGNORE_INDEX)
            shift[:, :-1] = labels[:, 1:]
            # The last token of a document has no next token of its own.
            shift[:, :-1][breaks[:, 1:]] = IGNORE_INDEX

        n = -(-S // self.divisor) * self.divisor
        positions = _pad_right(position_ids, n, 0)
        starts = _pad_right(breaks, n, False)
        starts[:, 0] = True
        # Right padding only: row b's padding is [real[b], n), a document of its own.
        real = [S] * B if mask is None else mask.sum(1).tolist()
        for b, first in enumerate(real):
            if first < n:
                positions[b, first:] = torch.arange(n - first)
                starts[b, first:] = False
                starts[b, first] = True
        full = {"input_ids": _pad_right(input_ids, n, pad_token_id),
                "position_ids": positions,
                "shift_labels": _pad_right(shift, n, IGNORE_INDEX)}
        if mrope is not None:  # the text positions first: transformers' packed format
            full["position_ids"] = torch.cat([positions[None], _pad_right(mrope, n, 0)])
        for name, numbered in (rows or {}).items():  # each modality's embedding rows
            full[f"rows.{name}"] = _pad_right(numbered, n, -1)
        for key in self.vision.cut_keys if self.vision else ():
            if batch.get(key) is not None:
                full[key] = _pad_right(torch.as_tensor(batch[key]), n, 0)
        # The tokens that are the batch's own (not its attention_mask's padding, nor the
        # cut's): only with padding. The MoE router loss counts them alone, as HF's does.
        padded = mask is not None and not is_traced(mask) and not bool(mask.all())
        if n > S or padded:
            real_tokens = torch.ones(B, S, dtype=torch.bool) if mask is None else mask
            full["token_mask"] = _pad_right(real_tokens, n, False)
        by_documents = self.split.per_document or varlen is not None
        if not by_documents:
            documents = None
        elif is_traced(starts):  # the planner's trace: one document per row, the padding apart
            documents = [(0, first) if 0 < first < n else (0,) for first in real]
        else:
            documents = [tuple(row.nonzero().squeeze(1).tolist()) for row in starts]
        if self.split.per_document:
            index = held_positions(self.split, n, self.sp_rank, documents)  # as shard_sequence
            out = {k: v.gather(-1, index.expand(*v.shape[:-1], -1)) for k, v in full.items()}
        else:
            runs = self.split.runs(n, self.sp_rank)  # as ulysses.shard_sequence cuts
            out = {k: torch.cat([v[..., start:start + size] for start, size in runs], dim=-1)
                   for k, v in full.items()}
        if by_documents:
            out.update(_varlen_arguments(documents, n))
        if self.vision is not None:
            rows = {name: out.pop(f"rows.{name}") for name in rows}
            out.update(self.vision.rank_inputs(batch, rows))
        return out


def _check_seq_idx(seq_idx: Tensor, breaks: Tensor) -> None:
    """TRL's padding-free ``seq_idx`` (each token's document, over the flattened batch) is read
    only by token mixers outside attention (the short convolutions of linear-attention
    layers), which sequence parallelism refuses; it is dropped, once checked to name the
    documents the cut uses."""
    B, S = breaks.shape
    if seq_idx.numel() != B * S:
        raise ValueError(f"seq_idx has {seq_idx.numel()} entries for a batch of {B} x {S} tokens")
    flat = seq_idx.reshape(-1)
    starts = breaks.clone()
    starts[:, 0] = True
    if not torch.equal(flat[1:] != flat[:-1], starts.reshape(-1)[1:]):
        raise ValueError("seq_idx changes where no document starts (or not where one does): it "
                         "must number the documents that position_ids and cu_seq_lens_q give")


def _varlen_arguments(documents: list[tuple[int, ...]], n: int) -> dict[str, Any]:
    """flash-attn's varlen arguments of rows of ``n`` tokens with these documents: the
    flattened batch's document bounds (int32) and the longest document."""
    bounds = [b * n + a for b, row in enumerate(documents) for a in row] + [len(documents) * n]
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(e - a for a, e in zip(bounds, bounds[1:]))
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": longest,
            "max_length_k": longest}
