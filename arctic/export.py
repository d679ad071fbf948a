"""Export the trained model from a training checkpoint, as a HF model directory.

    python -m arctic.export CHECKPOINT OUT [--config CONFIG_JSON] [--dtype DTYPE]

writes ``OUT/config.json`` and ``OUT/model.safetensors`` (``save_pretrained``), which
``AutoModelForCausalLM.from_pretrained(OUT)`` (a vision-language model:
``AutoModelForImageTextToText``) loads on a plain transformers install. It runs
in one process, without a process group: each kind of checkpoint is read whole on the host.

The checkpoint kinds, told apart by their files (:func:`find_checkpoint`):

- ``torch.distributed.checkpoint`` (DCP) directories with the model under the key
  ``"model"``: ``examples/train_fsdp.py``'s ``--save-dir/step{N}`` (its ``.metadata`` is
  written last, so a step without one is unfinished), and the HF Trainer's under FSDP2,
  ``checkpoint-N/dcp``. Tensors keep the dtype they were stored in.
- DeepSpeed checkpoints: ``examples/train.py``'s ``--save-dir`` (``latest``, ``step{N}/``) and
  the HF Trainer's ``checkpoint-N`` (``latest``, ``global_stepN/``). ZeRO stages 1-3 are
  merged by DeepSpeed's own ``zero_to_fp32`` into the fp32 master weights; stage 0 is the
  module's state as stored.

A save directory or a Trainer output directory stands for its newest finished checkpoint.
Parameter names: every stage of the SP recipe changes module instances only (forwards, hooks,
attributes), so a sharded model's state dict already has the HF names; the wrapper prefixes
torch itself may add (activation-checkpoint wrappers, ``torch.compile``) are taken off, and
the names are checked against the model built from the config, strictly.

The model's config comes from ``--config``, else from the first ``config.json`` in the
checkpoint's directory or above it (the examples write one into ``--save-dir``; the Trainer
into each ``checkpoint-N``). An attention implementation of ours in it is dropped: the
exported config must load where arctic is not installed.

:func:`zero3_full_state_dict` is the training-side counterpart for DeepSpeed ZeRO-3: the
whole state dict gathered from a live engine, for ``save_model``.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from arctic.config import zero_stage
from arctic.hf.attention import IMPLEMENTATIONS, REGISTERED
from arctic.train.hf_fsdp import DCP_DIR as TRAINER_DCP_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` choices."""
TRAINER_STATE = "trainer_state.json"
"""The Trainer writes it last into a ``checkpoint-N``: a checkpoint without it (or with a part
of it) is unfinished."""
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Path components torch's wrappers add to parameter names (checkpoint_wrapper,
``torch.compile``, FSDP1)."""
ACCEPTED = ("a DCP checkpoint directory with the key 'model' (examples/train_fsdp.py's "
            "--save-dir/step{N}, or a Trainer checkpoint-N holding dcp/); a DeepSpeed "
            "checkpoint (a directory with 'latest' and its tag directory, or a tag directory "
            "with *_model_states.pt); or a directory of those: a --save-dir with step{N}/ or a "
            "Trainer output directory with checkpoint-N/")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One checkpoint found on disk."""

    kind: Literal["dcp", "deepspeed"]
    path: Path
    """The DCP directory (with ``.metadata``) or the DeepSpeed tag directory."""


def _step(name: str, prefix: str) -> int | None:
    m = re.fullmatch(rf"{prefix}(\d+)", name)
    return int(m.group(1)) if m else None


def _is_dcp(path: Path) -> bool:
    return (path / ".metadata").is_file()


def _is_deepspeed_tag(path: Path) -> bool:
    if not (path.is_dir() and any(path.glob("*model_states.pt"))):
        return False
    if (path / "zero").is_dir():  # ds_to_universal's layout: one folder per parameter
        raise ValueError(f"{path} is a DeepSpeed universal checkpoint; export the checkpoint "
                         f"it was converted from (the tag without '_universal')")
    return True


def _newest(path: Path, prefix: str, finished) -> Path | None:
    """The highest-numbered ``{prefix}{N}`` directory in ``path`` for which ``finished``."""
    steps = sorted(((n, d) for d in path.iterdir() if d.is_dir() and
                    (n := _step(d.name, prefix)) is not None), reverse=True)
    return next((d for _, d in steps if finished(d)), None)


def _deepspeed_latest(path: Path) -> Path | None:
    latest = path / "latest"
    if not latest.is_file():
        return None
    tag = path / latest.read_text().strip()
    if not _is_deepspeed_tag(tag):
        raise ValueError(f"{latest} names the DeepSpeed tag {tag.name!r}, but {tag} holds no "
                         f"*_model_states.pt")
    return tag


def trainer_checkpoint_complete(path: str | Path) -> bool:
    """Whether the HF Trainer finished writing the ``checkpoint-N`` at ``path``: its
    :data:`TRAINER_STATE`, which :class:`arctic.train.trainer.SequenceParallelTrainer`'s main
    process writes after every rank's files, is there and reads whole."""
    try:
        json.loads((Path(path) / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return False
    return True


def _trainer_checkpoint(path: Path) -> Checkpoint | None:
    """A finished HF Trainer ``checkpoint-N`` (FSDP2: ``dcp/``; DeepSpeed: ``latest``)."""
    if not trainer_checkpoint_complete(path):
        return None
    if _is_dcp(path / TRAINER_DCP_DIR):
        return Checkpoint("dcp", path / TRAINER_DCP_DIR)
    tag = _deepspeed_latest(path)
    return Checkpoint("deepspeed", tag) if tag is not None else None


def find_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint that ``path`` names, by its files; a directory of checkpoints (a
    ``--save-dir``, a Trainer output directory) names its newest finished one. ``ValueError``
    saying what was found and what is accepted otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; accepted: {ACCEPTED}")
    if _is_dcp(path):
        return Checkpoint("dcp", path)
    if _is_dcp(path / TRAINER_DCP_DIR):
        return Checkpoint("dcp", path / TRAINER_DCP_DIR)
    if _is_deepspeed_tag(path):
        return Checkpoint("deepspeed", path)
    tag = _deepspeed_latest(path)
    if tag is not None:
        return Checkpoint("deepspeed", tag)
    trainer = _newest(path, "checkpoint-", lambda d: _trainer_checkpoint(d) is not None)
    if trainer is not None:
        return _trainer_checkpoint(trainer)
    step = _newest(path, "step", _is_dcp)
    if step is not None:
        return Checkpoint("dcp", step)
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(entries[:20]) + (f", ... ({len(entries)} in all)" if len(entries) > 20
                                       else "")
    hf = ("; it holds HF weights already, which from_pretrained loads as they are"
          if any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file() else "")
    raise ValueError(f"{path} is no checkpoint this exporter reads (found: {shown or 'nothing'}; "
                     f"unfinished checkpoints, a step{{N}} without .metadata or a checkpoint-N "
                     f"without {TRAINER_STATE}, are passed over){hf}; accepted: {ACCEPTED}")


def read_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    """The ``"model"`` entry of the DCP checkpoint at ``path``, whole, on the host, in the
    dtypes it was stored in (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    # planner_data maps each flat key to its path in the saved nested dict: ("model", name).
    model = {}
    for key, where in metadata.planner_data.items():
        if where[0] != "model":
            continue
        meta = metadata.state_dict_metadata[key]
        if len(where) != 2 or not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{path}: the model entry {'.'.join(map(str, where))} is not a "
                             f"tensor of a flat model state dict ({type(meta).__name__})")
        model[where[1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        tops = sorted({where[0] for where in metadata.planner_data.values()})
        raise ValueError(f"{path} is a DCP checkpoint without a 'model' entry (its keys: {tops}); "
                         f"the exporter reads the model that get_state_dict/"
                         f"get_model_state_dict saved under 'model'")
    dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return model


def read_deepspeed_model(tag: Path) -> dict[str, torch.Tensor]:
    """The whole model of the DeepSpeed checkpoint in the tag directory ``tag``: the fp32
    master weights merged by ``zero_to_fp32`` for ZeRO stages 1-3, the module as stored for
    stage 0."""
    states = sorted(tag.glob("*model_states.pt"))
    first = next((f for f in states if f.name in ("mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_model_states.pt")),
                 states[0])
    # DeepSpeed's own pickles (its config and version objects): not loadable weights-only.
    saved = torch.load(first, map_location="cpu", weights_only=False)
    stage = zero_stage(saved.get("ds_config") or {})
    if stage == 0:
        return {k: v for k, v in saved["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    del saved
    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name)
    except FileNotFoundError as e:  # a rank's files missing: an unfinished checkpoint
        raise ValueError(f"{tag}: the ZeRO-{stage} checkpoint is incomplete ({e})") from e


def find_config(checkpoint: Checkpoint, given: Path) -> Path:
    """The first ``config.json`` from the checkpoint's directory up to ``given`` and the
    directory holding ``given``; ``ValueError`` naming where it looked."""
    looked, d = [], checkpoint.path
    stop = given.parent.resolve()
    while True:
        looked.append(d)
        if (d / "config.json").is_file():
            return d / "config.json"
        if d.resolve() == stop or d.parent == d:
            break
        d = d.parent
    raise ValueError(f"no config.json in {', '.join(map(str, looked))}; pass the model's HF "
                     f"config with --config (a config.json, or a directory holding one)")


def _ours(name) -> bool:
    return isinstance(name, str) and (name == REGISTERED or name in IMPLEMENTATIONS)


def _plain_attention(config: dict) -> dict:
    """``config`` (a config.json's dict) without an attention implementation of ours, in it
    or in a sub-config: the exported one must load where arctic is not installed."""
    out = {}
    for key, value in config.items():
        if key in ("attn_implementation", "_attn_implementation") and _ours(value):
            continue
        out[key] = _plain_attention(value) if isinstance(value, dict) else value
    return out


def load_config(path: Path):
    """The HF config at ``path`` (a config.json or a directory holding one), its attention
    implementation the default unless the file names a stock one."""
    from transformers import AutoConfig, PretrainedConfig

    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--config {path}: no such config.json")
    # HF's own reader: it decodes what save_pretrained encodes (an infinite float, such as
    # Nemotron-H's time_step_limit, as {"__float__": "Infinity"})
    try:
        raw = PretrainedConfig.get_config_dict(str(path))[0]
    except OSError as e:  # not JSON
        raise ValueError(f"--config {path}: {e}") from None
    if "model_type" not in raw:
        raise ValueError(f"{path} has no model_type: not a HF model config")
    config = AutoConfig.for_model(**_plain_attention(raw))
    if _ours(getattr(config, "_attn_implementation", None)):
        config._attn_implementation = None
    return config


def strip_wrappers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with torch's wrapper path components taken out of its names."""
    out = {}
    for name, tensor in state.items():
        clean = name
        for prefix in _WRAPPER_PREFIXES:
            clean = clean.replace(prefix, "")
        if clean in out:
            raise ValueError(f"two entries are {clean!r} once wrapper names are taken off")
        out[clean] = tensor
    return out


def new_model(config):
    """The model of ``config``, as it was trained, on the meta device: the class its
    ``architectures`` names (``save_pretrained`` writes the model's class there; a
    vision-language model's ``...ForConditionalGeneration``), else the causal LM of its type,
    else its image-text-to-text model (a VLM config without ``architectures``)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        for name in getattr(config, "architectures", None) or ():
            found = getattr(transformers, name, None)
            if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
                return found(config)
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            try:
                return auto.from_config(config)
            except ValueError:  # not a model type of this auto class
                continue
    raise ValueError(f"{type(config).__name__} (model_type {config.model_type!r}) is neither a "
                     f"causal LM's nor a vision-language model's config, and its architectures "
                     f"{getattr(config, 'architectures', None)} name no transformers class")


def build_model(config, state: dict[str, torch.Tensor]):
    """The HF model of ``config`` (:func:`new_model`) holding ``state`` (strictly: a missing
    or unexpected name raises ``ValueError`` naming it). Tied parameters may appear under one
    of their names; under several, the values must agree."""
    model = new_model(config)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    state = dict(state)
    for group in names.values():
        present = [n for n in group if n in state]
        if present and len(present) < len(group):
            state.update({n: state[present[0]] for n in group if n not in state})
        for n in present[1:]:
            if not torch.equal(state[n], state[present[0]]):
                raise ValueError(f"{present[0]} and {n} are one tied parameter in "
                                 f"{type(model).__name__}, but the checkpoint holds different "
                                 f"values for them (config tie_word_embeddings="
                                 f"{getattr(config, 'tie_word_embeddings', None)})")
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit {type(model).__name__} of the config: "
                         f"missing {missing}, unexpected {unexpected}")
    model.load_state_dict(state, strict=True, assign=True)
    if any(len(group) > 1 for group in names.values()):
        model.tie_weights()  # assign=True gave each name its own tensor: tie them again
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"parameters not filled from the checkpoint: {left}")
    return model


def export(checkpoint: str | Path, out: str | Path, config: str | Path | None = None,
           dtype: str | None = None) -> Path:
    """Write the model of ``checkpoint`` (any kind :func:`find_checkpoint` accepts) to ``out``
    as a HF model directory (``config.json``, ``model.safetensors``). ``config``: the model's
    HF config (file or directory); default :func:`find_config`. ``dtype``: one of
    :data:`DTYPES` to cast the floating-point weights to; default as stored (fp32 masters
    from ZeRO 1-3). Returns ``out``."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    given, out = Path(checkpoint), Path(out)
    found = find_checkpoint(given)
    config_path = Path(config) if config is not None else find_config(found, given)
    hf_config = load_config(config_path)
    read = read_dcp_model if found.kind == "dcp" else read_deepspeed_model
    state = strip_wrappers(read(found.path))
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v
                 for k, v in state.items()}
    model = build_model(hf_config, state)
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(floats) == 1:
        model.config.dtype = floats.pop()  # what from_pretrained(dtype="auto") gives
    model.save_pretrained(out)
    return out


def zero3_full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole state dict of a DeepSpeed ZeRO-3 engine (or its module), gathered one
    parameter at a time: on rank 0, host copies in the parameters' dtype (what ZeRO-2's
    ``save_model`` writes, and what ``stage3_gather_16bit_weights_on_model_save`` would give);
    on other ranks, ``{}``. Every rank must call it (each gather is a collective). Tied
    parameters appear under each of their names, as in ``state_dict()``."""
    import deepspeed
    import torch.distributed as dist

    module = getattr(model, "module", model)  # the engine's model
    main = not dist.is_initialized() or dist.get_rank() == 0
    state, done = {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in done:  # a tied parameter, gathered once
            if main:
                state[name] = state[done[id(tensor)]]
            continue
        done[id(tensor)] = name
        if hasattr(tensor, "ds_id"):  # partitioned by ZeRO-3
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                if main:
                    state[name] = tensor.detach().to("cpu", copy=True)
        elif main:  # buffers are not partitioned
            state[name] = tensor.detach().to("cpu", copy=True)
    return state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m arctic.export",
                                description="Write the HF model (config.json, "
                                            "model.safetensors) of a training checkpoint.")
    p.add_argument("checkpoint", type=Path, help="a checkpoint, or a directory of them "
                                                 "(the newest finished one is exported)")
    p.add_argument("out", type=Path, help="the HF model directory to write")
    p.add_argument("--config", type=Path, default=None,
                   help="the model's HF config.json (or its directory); default: the first "
                        "config.json in the checkpoint's directory or above it")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the floating-point weights; default: as stored")
    args = p.parse_args(argv)
    found = find_checkpoint(args.checkpoint)
    print(f"exporting the {found.kind} checkpoint {found.path}", flush=True)
    export(args.checkpoint, args.out, config=args.config, dtype=args.dtype)
    print(f"wrote {args.out} (from_pretrained loads it)", flush=True)


if __name__ == "__main__":
    main()
