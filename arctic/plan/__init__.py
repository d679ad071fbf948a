"""Memory planner: will this sequence length fit, and with which settings?

    python -m arctic.plan --model llama3-8b --seq-len 5000000 --gpus 8 \\
        --gpu-memory 80GiB --host-memory 2TiB --head-chunk 1 --tiled-mlp auto --offload
    python -m arctic.plan --model llama3-8b --gpus 8 --find-max --plot peak.png

The planner runs one real training step of the code that trains (:func:`build` and
:func:`train_step`, which ``benchmarks/scale_gpu.py`` runs on a GPU too): the HF model from
its config, :func:`arctic.recipe.apply_sp_recipe` (SP attention, head chunking, tiled MLP,
tiled loss, checkpointing with offload), FSDP2 over every rank with bf16 compute and fp32
sharded parameters, gradients and AdamW state, then forward, backward and the optimizer
step. It runs them under ``FakeTensorMode``: tensors have shapes, dtypes and storages but no
data, so a 5M-token step of an 8B model traces on a laptop in seconds. torch's fake process
group stands in for the W ranks (collectives return without moving data) and rank 0 is
traced; every rank of an SP group holds the same shapes.

Memory is MemTracker's account of every storage the step allocates (parameters, gradients,
optimizer state, activations, temporaries), the peak taken over the step; the chunk buffers
of head-chunked attention are reported apart. Offloaded activations are traced too: the host
pool counts their bytes instead of copying (fake tensors have nothing to copy), and their
device copies are freed at the offload and allocated again at the prefetch, as in training.

What it does not see: the CUDA caching allocator's fragmentation and rounding (use
``--gpu-memory`` with some headroom; ``--reserve`` sets it, default 5%), NCCL and CUDA context
memory outside the allocator (about 1 GiB, also inside the reserve), and kernels' workspaces
that live outside torch's allocator. ``benchmarks/scale_gpu.py`` measures the difference on
a real GPU.

A ZeRO-3 config (``--ds-config``) is planned with FSDP2 sharding: both keep 1/W of the
parameters, gradients and optimizer state per rank and gather one layer's parameters at a time.

The modules, one concern each: :mod:`~arctic.plan.models` (the catalogue of model names),
:mod:`~arctic.plan.units` (sizes as written), :mod:`~arctic.plan.step` (the training step and
the named stacks), :mod:`~arctic.plan.tracing` (the fake world and the peak tracker),
:mod:`~arctic.plan.estimate` (one setting's answer), :mod:`~arctic.plan.search` (the longest
length that fits) and :mod:`~arctic.plan.cli` (``python -m arctic.plan``).
"""

from arctic.plan.cli import main, parse_args, plot, report, settings_from_args
from arctic.plan.estimate import Estimate, plan
from arctic.plan.traces import TRACE_LAYERS
from arctic.plan.models import MODELS, model_config
from arctic.plan.search import find_max
from arctic.plan.step import (
                              STACKS,
                              build,
                              init_optimizer_state,
                              make_batch,
                              stack_config,
                              train_step,
)
from arctic.plan.tracing import KINDS, Peak, buffer_pools, fake_world, track_peak
from arctic.plan.units import GiB, format_gib, parse_bytes, parse_tokens

__all__ = ["GiB", "KINDS", "MODELS", "STACKS", "TRACE_LAYERS", "Estimate", "Peak", "buffer_pools",
           "build", "fake_world", "find_max", "format_gib", "init_optimizer_state", "main",
           "make_batch", "model_config", "parse_args", "parse_bytes", "parse_tokens", "plan",
           "plot", "report", "settings_from_args", "stack_config", "track_peak", "train_step"]
