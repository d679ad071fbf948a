"""accelerate's ``ParallelismConfig`` (``TrainingArguments(parallelism_config=...)``), read as
this package's sequence-parallel settings.

HF's ALST path turns Ulysses on with
``ParallelismConfig(sp_backend="deepspeed", sp_size=N, sp_handler=DeepSpeedSequenceParallelConfig(
sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))`` beside a DeepSpeed config;
accelerate then installs DeepSpeed's ``UlyssesSPAttentionHF`` (over the global
``ALL_ATTENTION_FUNCTIONS[<implementation>]`` entry) and its ``UlyssesSPDataLoaderAdapter``,
and the Trainer sends the loss to ``deepspeed_sp_compute_loss``.
:class:`arctic.train.trainer.SequenceParallelTrainer` reads the same object instead
(:func:`merge_parallelism_config`): ``sp_size`` becomes ``sequence_parallel_size``, the
handler's attention implementation picks the kernel, and the DeepSpeed JSON's ``"ulysses"``
block adds the rest (head chunks, tiling, offload, ring). The trainer then hands accelerate
``TrainingArguments`` without it, so none of DeepSpeed's pieces is installed as well.

What is refused (``ValueError``, naming the field): ``cp_size > 1`` or ``tp_size > 1``, data
parallel sizes other than 1 or ``world / sp_size`` (the mesh's data-parallel axis, whatever
accelerate would make of them: ZeRO shards over every rank), a backend other
than ``"deepspeed"``, fixed-length batches (``sp_seq_length_is_variable=False``: any length
is cut here), an attention implementation without a kernel here, and settings that disagree
with the DeepSpeed JSON's.
"""

from __future__ import annotations

from typing import Any

from arctic.config import SequenceParallelConfig, load_ds_config

SP_KEYS = ("sequence_parallel_size", "seq_parallel_communication_data_type", "ulysses")
"""The DeepSpeed config's keys that hold the SP settings (DeepSpeed itself never sees them)."""

ATTENTION = {"sdpa": {"attn_implementation": "ulysses_sdpa"},
             "flash_attention_2": {"attn_implementation": "ulysses_flash_attention_2"},
             "flash_attention_3": {"attn_implementation": "ulysses_sdpa",
                                   "attention_backend": "fa3"}}
"""``sp_attn_implementation`` -> the ``"ulysses"`` block's kernel keys: SDPA (its kernel chosen
by device and dtype), flash-attn 2 and flash-attn 3."""


def _size(pc, name: str) -> int:
    value = getattr(pc, name, None)
    return 1 if value is None else int(value)


def merge_parallelism_config(pc, ds: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The DeepSpeed config ``ds`` with the sequence parallelism of ``pc`` (accelerate's
    ``ParallelismConfig``, or None) merged in, for ``world_size`` ranks; ``ValueError`` for
    what cannot be honoured."""
    if pc is None:
        return ds
    for name in ("cp_size", "tp_size"):
        if _size(pc, name) > 1:
            raise ValueError(f"parallelism_config.{name}={_size(pc, name)} is not supported by "
                             f"SequenceParallelTrainer (sequence parallelism is its sp_size, "
                             f"with the ring and Ulysses degrees of the DeepSpeed config's "
                             f"\"ulysses\" block); set {name}=1")
    sp_size = _size(pc, "sp_size")
    dp = _size(pc, "dp_replicate_size") * _size(pc, "dp_shard_size")
    if sp_size > 0 and world_size % sp_size == 0 and dp not in (1, world_size // sp_size):
        raise ValueError(f"parallelism_config.dp_replicate_size x dp_shard_size = {dp}: the "
                         f"data-parallel degree is world / sp_size = {world_size // sp_size} "
                         f"here (ZeRO shards over every rank); give that, or leave them at 1")
    if sp_size <= 1:
        raise ValueError("parallelism_config has no sequence parallelism (sp_size=1); "
                         "SequenceParallelTrainer needs sp_size > 1 there, or "
                         "sequence_parallel_size in the DeepSpeed config")
    backend = getattr(pc, "sp_backend", None)
    if backend != "deepspeed":
        raise ValueError(f"parallelism_config.sp_backend={backend!r}: only \"deepspeed\" (HF's "
                         f"ALST path, whose settings this trainer reads) is accepted")
    handler = getattr(pc, "sp_handler", None)
    if handler is not None and handler.sp_seq_length_is_variable is False:
        raise ValueError("parallelism_config.sp_handler.sp_seq_length_is_variable=False (batches "
                         "of one fixed length) is DeepSpeed's adapter's assumption; this trainer "
                         "cuts batches of any length: leave it True")
    attn = (getattr(handler, "sp_attn_implementation", None) if handler is not None
            else None) or "sdpa"
    if attn not in ATTENTION:
        raise ValueError(f"parallelism_config.sp_handler.sp_attn_implementation={attn!r} has no "
                         f"sequence-parallel kernel here; use one of {sorted(ATTENTION)}")
    given = ds.get("sequence_parallel_size")
    if given is not None and given != sp_size:
        raise ValueError(f"parallelism_config.sp_size={sp_size} disagrees with the DeepSpeed "
                         f"config's sequence_parallel_size={given}; give one, or the same")
    block = dict(ds.get("ulysses") or {})
    for key, value in ATTENTION[attn].items():
        if key in block and block[key] != value:
            raise ValueError(f"parallelism_config.sp_handler.sp_attn_implementation={attn!r} "
                             f"asks for ulysses.{key}={value!r}, but the DeepSpeed config "
                             f"sets {block[key]!r}; give one, or the same")
        block[key] = value
    return {**ds, "sequence_parallel_size": sp_size, "ulysses": block}


def sp_settings(args, sp_config) -> tuple[dict, SequenceParallelConfig]:
    """The SP settings, from the DeepSpeed config, ``sp_config`` (a SequenceParallelConfig,
    or a DeepSpeed-form dict or JSON path of SP keys) and ``parallelism_config``."""
    pc = getattr(args, "parallelism_config", None)
    if isinstance(sp_config, SequenceParallelConfig):
        if args.deepspeed or pc is not None:
            raise ValueError("sp_config=SequenceParallelConfig(...) is the whole SP setting: "
                             "give it without parallelism_config, under FSDP2")
        sp_config.dims(args.world_size)  # sequence_parallel_size must divide the world
        return {}, sp_config
    ds = dict(load_ds_config(args.deepspeed)) if args.deepspeed else {}
    if sp_config is not None:
        given = dict(load_ds_config(sp_config))
        if args.deepspeed:
            raise ValueError("give the SP settings once: in the DeepSpeed config "
                             "(TrainingArguments(deepspeed=...)) or as sp_config=, not both")
        other = sorted(set(given) - set(SP_KEYS) - {"activation_checkpointing"})
        if other:
            raise ValueError(f"sp_config holds DeepSpeed settings {other}, which nothing reads "
                             f"under FSDP2; give only {list(SP_KEYS)}")
        ds = given
    ds = merge_parallelism_config(pc, ds, args.world_size)
    return ds, SequenceParallelConfig.from_ds_config(ds, world_size=args.world_size)
