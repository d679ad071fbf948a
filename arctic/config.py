"""Sequence-parallel settings, read from the same DeepSpeed JSON that configures the engine.

DeepSpeed's own keys are read where they exist:

- ``sequence_parallel_size``: ranks sharing one sequence (ring x Ulysses);
- ``seq_parallel_communication_data_type``: "fp32", "bf16" or "fp16";
- ``activation_checkpointing``: the block's presence turns checkpointing on, and its
  ``cpu_checkpointing`` turns on activation offload.

Our block, ``"ulysses": {...}``, holds the rest (the fields of :class:`SequenceParallelConfig`
below). An unknown key there is a ``ValueError`` that lists the valid ones. DeepSpeed itself
ignores the block, so one file serves both.

    {
      "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3},
      "sequence_parallel_size": 8,
      "ulysses": {"ring_degree": 1, "head_chunk_size": 1, "tiled_mlp": "auto"}
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch

from offload.disk import IO_CHOICES, check_offload_dir
from ulysses import BACKENDS, SequenceParallelDims
from ulysses.state_passing import MODES as MIXER_MODES

BLOCK = "ulysses"
COMM_DTYPES = ("fp32", "bf16", "fp16")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTN_IMPLEMENTATIONS = ("ulysses_sdpa", "ulysses_flash_attention_2")
RING_LAYOUTS = ("zigzag", "contiguous", "per_document")


def _tiles_or_none(name: str, value) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ulysses.{name} must be null, a positive int or \"auto\", got {value!r}")


@dataclass(kw_only=True, slots=True)
class SequenceParallelConfig:
    """Everything sequence parallelism needs from the config; checked on construction."""

    sequence_parallel_size: int = 1
    """Ranks sharing one sequence: ``ring_degree * ulysses_degree`` (DeepSpeed's key)."""
    ring_degree: int = 1
    """Ranks in one ring; the rest of ``sequence_parallel_size`` is Ulysses."""
    ring_layout: Literal["zigzag", "contiguous", "per_document"] = "zigzag"
    """How a ring cuts the sequence (``ring_degree > 1``; no effect without a ring):
    ``"zigzag"`` (2R chunks of the row, ring rank r taking r and 2R-1-r), ``"contiguous"``
    (block r), or ``"per_document"`` (each packed document cut that way, so every document's
    work is spread evenly; :attr:`ulysses.SequenceParallelDims.per_document`)."""
    head_chunk_size: int | Literal["auto"] | None = None
    """Query heads attended at a time per rank; None = all (plain Ulysses)."""
    seq_chunk: int | Literal["auto"] | None = None
    """Sequence blocks per rank's piece inside each head chunk (FPDT-style,
    :mod:`ulysses.seq_chunk`): the exchanges and kernels run block by block, the kv chunk
    and its dk/dv sums wait in host memory. An int, or ``"auto"`` (the fewest blocks whose
    buffers fit 1 GiB); None: not cut. Needs head_chunk_size."""
    fuse_projections: bool = False
    """Compute q/k/v, RoPE and o_proj inside the head-chunk loop (no all-heads q/k/v;
    :mod:`arctic.hf.fused`); needs head_chunk_size."""
    attn_implementation: Literal["ulysses_sdpa", "ulysses_flash_attention_2"] = "ulysses_sdpa"
    """The HF attention name to switch models to."""
    attention_backend: str | None = None
    """The attention kernel by name (:data:`ulysses.BACKENDS`: ``"sdpa_cudnn"``, ``"fa3"``,
    ``"fa4"``, ``"flash_attn"``, ``"sdpa_flash"``, ...); None: the fastest for the device,
    dtype and head dim (:func:`ulysses.select_backend`)."""
    tiled_mlp: int | Literal["auto"] | None = None
    """MLP sequence tiles; None = no tiling."""
    tiled_norms: bool = True
    """With ``tiled_mlp``, also tile the RMSNorms over the sequence (their float32 backward
    temporaries are the next peak; :func:`arctic.tiling.apply_tiled_norms`)."""
    tiled_layer: bool = False
    """With ``tiled_mlp``, run all of each decoder layer after attention (residual add,
    post-attention norm, MLP, residual add) as one unit over tiled_mlp's tiles: its backward
    holds one hidden-sized gradient where the separately tiled norm and MLP hold three, and
    it saves the attention output instead of the norm's and the MLP's inputs
    (:mod:`arctic.tiling.layer`; Llama, Mistral, Qwen2 and Qwen3 decoder layers)."""
    loss_tiles: int | Literal["auto"] | None = "auto"
    """Sequence tiles of the logits + loss. null: no SP loss; the model's forward returns this
    rank's logits, for a loss of one's own (see docs/own_script.md; ``labels=`` still gives
    HF's loss of the whole sequence)."""
    activation_checkpointing: bool = False
    """Checkpoint each decoder layer."""
    offload_activations: bool = False
    """Move checkpointed layer inputs to host memory (needs activation_checkpointing)."""
    offload_dir: str | None = None
    """A directory (best on a local NVMe) where the offloaded layer inputs that do not fit
    the host limit spill, whole layers at a time, and are read back one layer ahead in
    backward (:mod:`offload.disk`); None: none, past the limit the step is refused. Needs
    offload_activations; it must exist and be writable. The budget there is its free space,
    split among the node's ranks, agreed over all ranks."""
    offload_io: Literal["auto", "aio", "threads"] | None = None
    """How the offload_dir tier reads and writes its files: ``"aio"``, DeepSpeed's async I/O
    op (``AsyncIOBuilder``: libaio, O_DIRECT; refused where it cannot be used, with the
    reason, when the model is set up); ``"threads"``, plain file I/O on a thread pool;
    ``"auto"``, aio where it is usable, else threads (:mod:`offload.disk`). None: ``"auto"``.
    Needs offload_dir."""
    offload_prefetch: bool = True
    """With offload_activations, each layer's recompute in backward starts the copy back of
    the previous layer's inputs (on CUDA on a side stream, hidden behind this layer's
    backward). False: each layer's inputs come back when its recompute needs them, on the
    compute's stream (DeepSpeed's ``cpu_checkpointing`` restores so): the backward's peak
    holds one hidden-sized layer input less, and the step waits for each copy (a layer's
    input per layer: ``S_local * hidden * 2`` bytes at the host link's speed). With
    offload_dir, the reads of the disk tier's files still start a layer ahead, into host
    memory. Needs offload_activations."""
    recompute_attention: bool = True
    """False: keep each layer's attention output and lse from the forward (on the host with
    the layer input when offloading) and recompute only norms, projections, RoPE and MLP in
    backward (needs activation_checkpointing; :mod:`ulysses.keep`). Costs about
    ``2 * S_local * hidden`` bytes per layer (bf16) more."""
    kernel_self_check: bool = True
    """Check each attention kernel against the float64 reference the first time it runs in
    the process (a tiny forward and backward on the device, once; :mod:`ulysses.self_check`):
    a kernel that disagrees is refused with a ``ValueError`` instead of training on wrong
    gradients. Process-wide: the last model set up decides."""
    mixer_parallelism: Literal["auto", "all_to_all", "state_passing"] = "auto"
    """How a hybrid's linear mixers (gated delta nets, KDA, Mamba2, Mamba1) run their scans:
    an all-to-all over heads (the degree must split the mixer's heads), their state passed
    between the ranks' pieces (any degree; :mod:`ulysses.state_passing`), or ``"auto"``: the
    all-to-all where the heads split, else state passing. A value other than ``"auto"`` on a
    model without such a mixer is refused when the model is set up."""
    mixer_chunk: int | None = None
    """A hybrid's mixer layers in sequence chunks of at most this many positions of the
    rank's piece: the model's forward on one chunk at a time, checkpointed, its
    convolution's window and scan's state carried between chunks (:mod:`arctic.hf.mixer_chunks`;
    the scans then pass their state). Bounds a mixer layer's working set by the chunk. None:
    the whole piece. Refused on a model without such a mixer, and with
    ``mixer_parallelism="all_to_all"``."""
    communication_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """dtype of the sequence-parallel exchanges (DeepSpeed's
    ``seq_parallel_communication_data_type``): every all-to-all and ring hop, forward and
    backward, is cast to it and back, and the sums the exchanges make (gradients of
    replicated kv heads, dk/dv over head chunks and ring hops) are taken in the wider of it
    and the activations' dtype (``ulysses_attention(comm_dtype=...)``). None = the
    activations' dtype. Under :func:`arctic.initialize` DeepSpeed reads the same key for its
    gradient all-reduce dtype when sequence parallelism is on."""

    def __post_init__(self) -> None:
        for name in ("sequence_parallel_size", "ring_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.ring_layout not in RING_LAYOUTS:
            raise ValueError(f"ulysses.ring_layout must be one of {RING_LAYOUTS}, got "
                             f"{self.ring_layout!r}")
        if self.sequence_parallel_size % self.ring_degree != 0:
            raise ValueError(f"ulysses.ring_degree ({self.ring_degree}) must divide "
                             f"sequence_parallel_size ({self.sequence_parallel_size})")
        _tiles_or_none("head_chunk_size", self.head_chunk_size)
        _tiles_or_none("tiled_mlp", self.tiled_mlp)
        _tiles_or_none("seq_chunk", self.seq_chunk)
        if self.seq_chunk is not None and self.head_chunk_size is None:
            raise ValueError("ulysses.seq_chunk needs ulysses.head_chunk_size (an int or "
                             "\"auto\"): sequence blocks are cut inside a head chunk")
        _tiles_or_none("loss_tiles", self.loss_tiles)
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"ulysses.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                             f"got {self.attn_implementation!r}")
        if self.mixer_chunk is not None and (isinstance(self.mixer_chunk, bool) or
                                             not isinstance(self.mixer_chunk, int) or
                                             self.mixer_chunk < 1):
            raise ValueError(f"ulysses.mixer_chunk must be a positive int or null, got "
                             f"{self.mixer_chunk!r}")
        if self.mixer_parallelism not in MIXER_MODES:
            raise ValueError(f"ulysses.mixer_parallelism must be one of {MIXER_MODES}, got "
                             f"{self.mixer_parallelism!r}")
        if self.attention_backend is not None and self.attention_backend not in BACKENDS:
            raise ValueError(f"ulysses.attention_backend must be null or one of {BACKENDS}, got "
                             f"{self.attention_backend!r}")
        for name in ("fuse_projections", "tiled_norms", "tiled_layer", "activation_checkpointing",
                     "offload_activations", "recompute_attention", "kernel_self_check"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ulysses.{name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
        if self.fuse_projections and self.head_chunk_size is None:
            raise ValueError("ulysses.fuse_projections needs ulysses.head_chunk_size (an int or "
                             "\"auto\"): the projections are fused into the head-chunk loop")
        if self.tiled_layer and self.tiled_mlp is None:
            raise ValueError("ulysses.tiled_layer needs ulysses.tiled_mlp (an int or \"auto\"): "
                             "the layer's tail runs over the MLP's tiles")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError("offload_activations needs activation_checkpointing: only "
                             "checkpointed layer inputs are offloaded")
        if self.offload_dir is not None:
            if not self.offload_activations:
                raise ValueError(f"ulysses.offload_dir={self.offload_dir!r} needs "
                                 f"offload_activations: the directory holds what the host "
                                 f"offload pool cannot")
            check_offload_dir(self.offload_dir, name="ulysses.offload_dir")
        if not isinstance(self.offload_prefetch, bool):
            raise ValueError(f"ulysses.offload_prefetch must be true or false, got "
                             f"{self.offload_prefetch!r}")
        if not self.offload_prefetch and not self.offload_activations:
            raise ValueError("ulysses.offload_prefetch=false needs offload_activations: it "
                             "stops the copy back of offloaded layer inputs a layer ahead")
        if self.offload_io is not None:
            if self.offload_io not in IO_CHOICES:
                raise ValueError(f"ulysses.offload_io must be null or one of {IO_CHOICES}, got "
                                 f"{self.offload_io!r}")
            if self.offload_dir is None:
                raise ValueError(f"ulysses.offload_io={self.offload_io!r} needs "
                                 f"ulysses.offload_dir: it is how that directory's files are "
                                 f"read and written")
        if not self.recompute_attention and not self.activation_checkpointing:
            raise ValueError("ulysses.recompute_attention=false needs activation_checkpointing: "
                             "without checkpointing nothing is recomputed")
        if self.communication_dtype not in (None, *COMM_DTYPES):
            raise ValueError(f"seq_parallel_communication_data_type must be one of {COMM_DTYPES}, "
                             f"got {self.communication_dtype!r}")

    @property
    def comm_dtype(self) -> torch.dtype | None:
        """:attr:`communication_dtype` as a torch dtype (None stays None)."""
        return None if self.communication_dtype is None else _TORCH_DTYPES[self.communication_dtype]

    @property
    def ulysses_degree(self) -> int:
        return self.sequence_parallel_size // self.ring_degree

    def dims(self, world_size: int) -> SequenceParallelDims:
        """The mesh degrees for ``world_size`` ranks; ``ValueError`` if sp does not divide it."""
        if world_size % self.sequence_parallel_size != 0:
            valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"sequence_parallel_size ({self.sequence_parallel_size}) must divide "
                             f"the world size ({world_size}); valid sizes: {valid}")
        return SequenceParallelDims(world_size=world_size, ulysses_degree=self.ulysses_degree,
                                    ring_degree=self.ring_degree,
                                    zigzag=self.ring_layout != "contiguous",
                                    per_document=self.ring_layout == "per_document",
                                    kernel_self_check=self.kernel_self_check)

    @classmethod
    def from_ds_config(cls, path_or_dict: str | Path | dict[str, Any], *,
                       world_size: int | None = None) -> "SequenceParallelConfig":
        """Read a DeepSpeed config (a path to JSON, or the dict) and check it.

        With ``world_size``, also check that ``sequence_parallel_size`` divides it.
        """
        ds = load_ds_config(path_or_dict)
        block = ds.get(BLOCK)
        block = {} if block is None else block
        if not isinstance(block, dict):
            raise ValueError(f"the \"{BLOCK}\" block must be an object, got {type(block).__name__}")
        own = {f.name for f in fields(cls)} - {"sequence_parallel_size", "communication_dtype"}
        unknown = sorted(set(block) - own)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in the \"{BLOCK}\" block; valid keys: "
                             f"{sorted(own)}")
        values: dict[str, Any] = {"sequence_parallel_size": ds.get("sequence_parallel_size", 1)}
        comm = ds.get("seq_parallel_communication_data_type")
        if comm is not None:
            values["communication_dtype"] = str(comm).lower()
        ac = ds.get("activation_checkpointing")
        if isinstance(ac, dict):  # DeepSpeed's block: present means on
            _check_ds_checkpointing(ac)
            values["activation_checkpointing"] = True
            values["offload_activations"] = bool(ac.get("cpu_checkpointing", False))
        values.update(block)
        config = cls(**values)
        if world_size is not None:
            config.dims(world_size)
        return config


# DeepSpeed's activation_checkpointing keys that act only through deepspeed.checkpointing
# (Megatron-style models that call it). arctic checkpoints HF decoder layers with
# torch.utils.checkpoint (offload.checkpoint), where they would silently do nothing.
_DS_CHECKPOINTING_UNSUPPORTED = ("partition_activations", "contiguous_memory_optimization",
                                 "number_checkpoints", "synchronize_checkpoint_boundary",
                                 "profile")


def _check_ds_checkpointing(block: dict[str, Any]) -> None:
    """Refuse the keys of DeepSpeed's ``activation_checkpointing`` block that we do not honour:
    only ``cpu_checkpointing`` (-> offload_activations) has an effect here."""
    unknown = sorted(set(block) - {"cpu_checkpointing", *_DS_CHECKPOINTING_UNSUPPORTED})
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the \"activation_checkpointing\" block; "
                         f"only cpu_checkpointing is read")
    used = [k for k in _DS_CHECKPOINTING_UNSUPPORTED if block.get(k) not in (None, False)]
    if used:
        raise ValueError(f"activation_checkpointing.{used[0]}={block[used[0]]!r} is not "
                         f"supported: it acts through deepspeed.checkpointing, which HF models do "
                         f"not call, and arctic checkpoints each decoder layer with "
                         f"torch.utils.checkpoint instead. Remove it (or set it to false/null); "
                         f"cpu_checkpointing is honoured (offloads the layer inputs)")


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config asks for: 0, 1, 2 or 3.

    Read as DeepSpeed reads ``zero_optimization.stage``: 0 when the block, or its ``stage``,
    is absent or null; ``true`` and ``false`` are stages 1 and 0 (DeepSpeed's deprecated
    ``"zero_optimization": true`` included). A bare value in place of the block
    (``"zero_optimization": 3``) is taken as the stage. Any other stage (``"3"``, ``4``) is a
    ``ValueError``: the engine, FSDP2 and the planner each act on the stage, and a malformed
    one must not pass for "no ZeRO".
    """
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    if stage is None:
        return 0
    if isinstance(stage, bool):
        return int(stage)
    if not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage


def load_ds_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict: a dict is returned as it is, a path is read as JSON.

    ``ValueError`` names the file when it is missing, not JSON, or not a JSON object, so
    every entry point (the engine, the Trainer, FSDP2's example, the planner) refuses a bad
    file with the same message before anything starts.
    """
    if isinstance(path_or_dict, dict):
        check_top_level_keys(path_or_dict)
        return path_or_dict
    path = Path(path_or_dict)
    if not path.is_file():
        raise ValueError(f"DeepSpeed config {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {str(path)!r} must hold a JSON object")
    check_top_level_keys(data)
    return data


SP_KEYS = ("sequence_parallel_size", "seq_parallel_communication_data_type", BLOCK)
"""The top-level keys that sequence parallelism reads (DeepSpeed's two, and our block)."""


def _squeezed(key: str) -> str:
    return "".join(c for c in key.lower() if c.isalnum())


def check_top_level_keys(ds: dict[str, Any]) -> None:
    """Refuse a top-level key that looks like one of :data:`SP_KEYS` but is not one of them
    (``"sequence_paralel_size"``, ``"Ulysses"``, ``"ulysses_degree"``): DeepSpeed ignores
    unknown keys, so the typo would train without sequence parallelism, silently.

    Close means: the same letters and digits whatever the case and separators, the same
    prefix (``sequence_parallel``, ``seq_parallel``, ``ulysses``), or a
    :class:`difflib.SequenceMatcher` ratio of at least 0.8 on those letters. DeepSpeed's own
    top-level keys are all below that (its ``communication_data_type`` is 0.79 from ours)."""
    import difflib

    prefixes = {"sequence_parallel_size": ("sequenceparallel", "seqparallel"),
                "seq_parallel_communication_data_type": ("seqparallelcomm",),
                BLOCK: ("ulysses",)}
    for key in ds:
        if not isinstance(key, str) or key in SP_KEYS:
            continue
        squeezed = _squeezed(key)
        ratios = {ours: difflib.SequenceMatcher(None, squeezed, _squeezed(ours)).ratio()
                  for ours in SP_KEYS}
        close = [ours for ours in SP_KEYS if squeezed == _squeezed(ours) or ratios[ours] >= 0.8
                 or squeezed.startswith(prefixes[ours])]
        if close:
            ours = max(close, key=ratios.get)
            raise ValueError(
                f"unknown top-level key {key!r} in the DeepSpeed config: did you mean "
                f"{ours!r}? DeepSpeed ignores keys it does not know, so this one would "
                f"train without its effect; the sequence-parallel keys are {list(SP_KEYS)}")
