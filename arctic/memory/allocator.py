"""The CUDA caching allocator's setting for long-context jobs: expandable segments.

A long-context step allocates few tensors, each of GiBs, and their sizes change from layer to
layer and phase to phase. The default allocator carves fixed segments and cannot merge them,
so what it reserves runs well above what is allocated. On an H100, one rank of 8 of
Llama-3-8B, ``max_memory_reserved`` was 1.79x ``max_memory_allocated`` at 64K tokens per
rank, 1.63x at 128K and 1.32x at 384K; with ``expandable_segments:True``, 1.12x at 384K. The
memory planner counts allocated bytes, so a job launched at its limit needs this setting.

Our launch paths (:func:`arctic.initialize`, :class:`arctic.SequenceParallelTrainer`,
``examples/train_fsdp.py``) call :func:`use_expandable_segments`: it turns the setting on
unless the user configured the allocator, and warns when the user's configuration leaves it
off. Nothing happens without CUDA.
"""

from __future__ import annotations

import os
import warnings

import torch

from ulysses.torch_internals import set_cuda_allocator_settings

ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch reads either (``PYTORCH_ALLOC_CONF`` is the newer name)."""
SETTING = "expandable_segments:True"


def _settings(conf: str) -> dict[str, str]:
    """``"a:1,b:2"`` -> ``{"a": "1", "b": "2"}`` (torch's format for these variables)."""
    pairs = (item.split(":", 1) for item in conf.split(",") if item.strip())
    return {k.strip(): v.strip() for k, v in (p if len(p) == 2 else (p[0], "") for p in pairs)}


def use_expandable_segments() -> str:
    """Turn on the CUDA allocator's expandable segments for this process, unless the user
    configured the allocator. Returns what happened:

    - ``"no cuda"``: nothing to configure;
    - ``"set"``: ``PYTORCH_CUDA_ALLOC_CONF`` was unset (both names); it is set now, and
      applied to the running allocator if CUDA is already initialized;
    - ``"already"``: the user's configuration has it;
    - ``"user"``: the user's configuration leaves it off: kept as it is, with a warning
      (the planner's limits assume expandable segments).
    """
    if not torch.cuda.is_available():
        return "no cuda"
    given = {name: os.environ[name] for name in ENV_NAMES if os.environ.get(name)}
    if not given:
        os.environ[ENV_NAMES[0]] = SETTING
        if torch.cuda.is_initialized():
            set_cuda_allocator_settings(SETTING)
        return "set"
    name, conf = next(iter(given.items()))
    if _settings(conf).get("expandable_segments", "").lower() == "true":
        return "already"
    warnings.warn(f"{name}={conf!r} leaves the CUDA allocator's expandable segments off: at long "
                  f"context the default allocator reserves 1.3-1.8x what the step allocates, "
                  f"and the memory planner's limits assume expandable segments. Add "
                  f"{SETTING} to it (or unset it and let arctic set it)", stacklevel=2)
    return "user"


__all__ = ["ENV_NAMES", "SETTING", "use_expandable_segments"]
