"""Memory planner: will this sequence length fit, and with which settings?

    python -m arctic.plan --model llama3-8b --seq-len 5000000 --gpus 8 \\
        --gpu-memory 80GiB --host-memory 2TiB --head-chunk 1 --tiled-mlp auto --offload
    python -m arctic.plan --model llama3-8b --gpus 8 --find-max --plot peak.png

The planner runs one real training step of the code that trains (:func:`build` and
:func:`train_step`, which ``benchmarks/scale_gpu.py`` runs on a GPU too): the HF model from
its config, :func:`arctic.engine.apply_sp_recipe` (SP attention, head chunking, tiled MLP,
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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from arctic.config import SequenceParallelConfig, _load

GiB = 1 << 30

MODELS: dict[str, tuple[str, dict]] = {
    # name -> (transformers config class, its arguments), from the published config.json files
    "llama3-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama3.2-3b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3-32b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "llama3-70b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # examples/train.py's CPU demo model
    "tiny-llama": ("LlamaConfig", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)),
}


def model_config(name: str, *, layers: int | None = None, max_positions: int | None = None):
    """A transformers config: a name from :data:`MODELS` or a ``config.json`` path.
    ``layers`` overrides the decoder layer count (a 2-layer 8B-shaped model for GPU checks)."""
    import transformers

    if name in MODELS:
        cls_name, kwargs = MODELS[name]
        config = getattr(transformers, cls_name)(**kwargs)
    elif Path(name).is_file():
        config = transformers.AutoConfig.from_pretrained(Path(name).parent if
                                                         Path(name).name == "config.json"
                                                         else name)
    else:
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a config.json path, "
                         f"got {name!r}")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        config.num_hidden_layers = layers
    if max_positions is not None:
        config.max_position_embeddings = max(config.max_position_embeddings, max_positions)
    config.use_cache = False
    return config


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"1.5TiB"``, ``"80GB"`` (decimal), or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 1.5TiB, 80GB)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    return int(number * (1024 if binary or not unit else 1000) ** power)


def parse_tokens(text: str) -> int:
    """``"5M"``, ``"512K"``, ``"5000000"`` -> tokens (K = 1024, M = 1024**2 as in "64K")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?)\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a token count: {text!r} (e.g. 5000000, 512K, 4M)")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


# --- the step that trains (also run for real by benchmarks/scale_gpu.py) --------------------

def build(config, sp: SequenceParallelConfig, mesh, *, device, shard: bool = True,
          host_memory_limit: int | None = None):
    """The training setup of ``examples/train_fsdp.py`` at scale: the model from ``config``
    (fp32 parameters), :func:`arctic.engine.apply_sp_recipe`, FSDP2 over every rank with bf16
    compute and fp32 gradient reduction, AdamW. ``shard=False`` keeps the parameters whole,
    in bf16 (single-device references). Returns ``(model, optimizer)``."""
    from transformers import AutoModelForCausalLM

    from arctic.engine import apply_sp_recipe
    from arctic.fsdp import apply_fsdp

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    apply_sp_recipe(model, config=sp, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=host_memory_limit)
    if shard:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        apply_fsdp(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    else:
        model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer


def init_optimizer_state(model: nn.Module, optimizer) -> None:
    """Create AdamW's state (as after the first step) so the planned step is a steady one:
    zero gradients, one step, gradients dropped."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_batch(seq_len: int, vocab: int, mesh, device) -> dict:
    """This rank's shard of one packed sequence of ``seq_len`` tokens (``arctic.data``)."""
    from arctic.data import prepare_sp_batch

    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return {k: v.to(device) for k, v in prepare_sp_batch({"input_ids": ids}, mesh).items()}


def train_step(model: nn.Module, optimizer, batch: dict) -> torch.Tensor:
    """One training step: the SP loss, backward, AdamW, gradients dropped."""
    loss = model(**batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


STACKS: dict[str, dict] = {
    # name -> SequenceParallelConfig fields (sequence_parallel_size comes from the world)
    "ulysses": dict(loss_tiles=1),
    "alst": dict(tiled_mlp="auto", loss_tiles="auto", activation_checkpointing=True,
                 offload_activations=True),
    "ours": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                 activation_checkpointing=True, offload_activations=True),
    "ours-no-offload": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                            activation_checkpointing=True),
    "hybrid": dict(ring_degree=2, head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                   activation_checkpointing=True, offload_activations=True),
}
"""Named stacks. ``ulysses``: SP attention alone (one loss tile: the full logits).
``alst``: DeepSpeed ALST's recipe (Ulysses without head chunking, tiled MLP and loss,
checkpointing with the layer inputs offloaded), built from our code. ``ours``: the same with
head chunking (one head per chunk). ``hybrid``: ``ours`` over ring 2 x Ulysses W/2."""


def stack_config(stack: str | dict, *, world: int) -> SequenceParallelConfig:
    """A named stack (:data:`STACKS`) or a dict of fields as a config over ``world`` ranks."""
    fields = STACKS[stack] if isinstance(stack, str) else stack
    return SequenceParallelConfig(**{"sequence_parallel_size": world, **fields})


# --- tracing under FakeTensorMode -------------------------------------------------------------

def fake_world(world: int) -> None:
    """Make this process rank 0 of ``world`` ranks on torch's fake process group (replacing
    an earlier fake group of another size). Refuses a real process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise ValueError("the planner needs a process of its own: a real process group "
                             "is initialized here")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


KINDS = ("parameters", "gradients", "optimizer", "activations", "attention buffers",
         "temporaries")


@dataclass
class Peak:
    """Per-rank device memory at the peak of a traced step, and the host bytes of offload."""

    total: int
    by_kind: dict[str, int]
    host: int = 0

    def summary(self) -> dict:
        return {"device_peak_bytes": self.total, "by_kind": dict(self.by_kind),
                "host_peak_bytes": self.host}


def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    names = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters",
             _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer",
             _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
             _MemRefType.OTH: "temporaries"}

    class Tracker(MemTracker):
        """MemTracker that also notes, at each new peak, the bytes of head-chunk buffers
        (storages a :class:`ulysses.BufferPool` allocated) alive at that moment."""

        def __init__(self) -> None:
            super().__init__()
            self.pool_storages: weakref.WeakSet = weakref.WeakSet()
            self.pool_at_peak: dict = {}

        def _update_peak_stats(self, peak_state) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            for dev, value in self._peak_mem.items():
                if before.get(dev) != value:
                    self.pool_at_peak[dev] = sum(
                        st.nbytes() for st in list(self.pool_storages)
                        if st.device.type == dev.type)

        def breakdown(self, device_type: str) -> Peak:
            snaps = {d: s for d, s in self.get_tracker_snapshot("peak").items()
                     if d.type == device_type}
            if not snaps:
                return Peak(0, dict.fromkeys(KINDS, 0))
            dev, snap = next(iter(snaps.items()))
            kinds = dict.fromkeys(KINDS, 0)
            for ref, value in snap.items():
                if ref in names:
                    kinds[names[ref]] += value
            pool = self.pool_at_peak.get(dev, 0)
            kinds["attention buffers"] = pool
            # Pool buffers were counted as activations (forward) or temporaries (backward).
            for k in ("temporaries", "activations"):
                take = min(pool, kinds[k])
                kinds[k] -= take
                pool -= take
            return Peak(snap["Total"], kinds)

    return Tracker


@contextlib.contextmanager
def track_peak(*, track=()):
    """Track every storage allocated inside the block (plus ``track``: modules, optimizers,
    tensors that exist before it). Yields the tracker; ``tracker.breakdown("cpu")`` after."""
    from ulysses.buffer_pool import BufferPool

    tracker = _tracker_class()()
    tracker.track_external(*track)
    acquire = BufferPool.acquire

    def noting_acquire(pool, numel, dtype, device):
        before = pool.stats.allocated
        buf = acquire(pool, numel, dtype, device)
        if pool.stats.allocated != before:
            tracker.pool_storages.add(buf.untyped_storage())
        return buf

    BufferPool.acquire = noting_acquire
    try:
        with tracker:
            yield tracker
    finally:
        BufferPool.acquire = acquire


@dataclass
class Estimate:
    """The planner's answer for one setting."""

    model: str
    stack: str
    seq_len: int
    world: int
    gpus_per_node: int
    sp: dict
    peak: Peak
    device_budget: int
    host_budget: int
    refused: str | None = None
    trace_s: float = 0.0

    @property
    def fits(self) -> bool:
        return (self.refused is None and self.peak.total <= self.device_budget and
                self.peak.host <= self.host_budget)

    def limit(self) -> str:
        if self.refused is not None:
            return self.refused
        if self.peak.host > self.host_budget:
            return "host memory for offloaded layer inputs"
        return max(self.peak.by_kind, key=self.peak.by_kind.get)


def plan(model: str, seq_len: int, *, gpus: int, nodes: int = 1, stack: str | dict = "ours",
         gpu_memory: int = 80 * GiB, host_memory: int = int(1.5 * 1024) * GiB,
         reserve: float = 0.05, layers: int | None = None, shard: bool = True) -> Estimate:
    """Trace one training step of ``model`` at ``seq_len`` tokens over ``gpus * nodes`` ranks
    (rank 0) and compare its peak with the budgets: ``gpu_memory * (1 - reserve)`` per rank on
    the device, and the offload pool's limit, 80% of ``host_memory`` per node split among
    its ``gpus`` ranks (what :class:`offload.HostBufferPool` allows itself)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = gpus * nodes
    sp = stack_config(stack, world=world)
    if seq_len % (world * 2) != 0:  # zigzag: 2 x sp chunks of equal length
        seq_len += world * 2 - seq_len % (world * 2)
    config = model_config(model, layers=layers, max_positions=seq_len)
    host_limit = int(0.8 * host_memory) // gpus
    name = stack if isinstance(stack, str) else "custom"
    fake_world(world)
    start = time.perf_counter()
    refused = None
    mesh = sp.dims(world).build_mesh("cpu")  # outside: the mesh reads its rank map
    with FakeTensorMode(allow_non_fake_inputs=True):
        model_, optimizer = build(config, sp, mesh, device="cpu", shard=shard,
                                  host_memory_limit=host_limit)
        init_optimizer_state(model_, optimizer)
        batch = make_batch(seq_len, config.vocab_size, mesh, "cpu")
        session = getattr(model_, "activation_offload", None)
        with track_peak(track=(model_, optimizer, *batch.values())) as tracker:
            try:
                train_step(model_, optimizer, batch)
            except ValueError as e:  # the offload pool refused: host memory
                refused = str(e).split(". Fix")[0]
    peak = tracker.breakdown("cpu")
    if session is not None:
        peak.host = session.pool.stats.peak_host_bytes
    return Estimate(model=model, stack=name, seq_len=seq_len, world=world, gpus_per_node=gpus,
                    sp={k: getattr(sp, k) for k in ("sequence_parallel_size", "ring_degree",
                                                    "head_chunk_size", "tiled_mlp", "loss_tiles",
                                                    "activation_checkpointing",
                                                    "offload_activations")},
                    peak=peak, device_budget=int(gpu_memory * (1 - reserve)),
                    host_budget=host_limit, refused=refused,
                    trace_s=time.perf_counter() - start)
