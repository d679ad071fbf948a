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


def train_step(model: nn.Module, optimizer, batch: dict, *, on_phase=None) -> torch.Tensor:
    """One training step: the SP loss, backward, AdamW, gradients dropped. ``on_phase(name)``
    is called as "forward", "backward" and "optimizer" end (the planner's per-phase peaks)."""
    mark = on_phase or (lambda name: None)
    loss = model(**batch)
    mark("forward")
    loss.backward()
    mark("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    return loss.detach()


STACKS: dict[str, dict] = {
    # name -> SequenceParallelConfig fields (sequence_parallel_size comes from the world)
    "ulysses": dict(loss_tiles=1),
    "alst": dict(tiled_mlp="auto", tiled_norms=False, loss_tiles="auto",
                 activation_checkpointing=True, offload_activations=True),
    "ours": dict(head_chunk_size=1, fuse_projections=True, tiled_mlp="auto", loss_tiles="auto",
                 activation_checkpointing=True, offload_activations=True),
    "ours-unfused": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                         activation_checkpointing=True, offload_activations=True),
    "ours-no-offload": dict(head_chunk_size=1, tiled_mlp="auto", loss_tiles="auto",
                            activation_checkpointing=True),
    "hybrid": dict(ring_degree=2, head_chunk_size=1, fuse_projections=True, tiled_mlp="auto",
                   loss_tiles="auto", activation_checkpointing=True, offload_activations=True),
}
"""Named stacks. ``ulysses``: SP attention alone (one loss tile: the full logits).
``alst``: DeepSpeed ALST's recipe (Ulysses without head chunking, tiled MLP and loss,
checkpointing with the layer inputs offloaded), built from our code. ``ours``: the same with
head chunking (one head per chunk) and the q/k/v/o projections fused into the chunk loop;
``ours-unfused`` without that fusion. ``hybrid``: ``ours`` over ring 2 x Ulysses W/2. Ours
also tile the RMSNorms (:func:`arctic.tiling.apply_tiled_norms`); ALST does not."""


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
    largest: list = field(default_factory=list)
    """What is alive at the peak, grouped by the op and module that made it:
    ``(label, tensors, bytes)``, largest first (at the last 1% step of the peak's climb)."""

    def summary(self) -> dict:
        return {"device_peak_bytes": self.total, "by_kind": dict(self.by_kind),
                "host_peak_bytes": self.host,
                "largest_at_peak": [{"made_by": k, "tensors": c, "bytes": b}
                                    for k, c, b in self.largest]}


def _tracker_class():
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    from torch.utils.weak import WeakIdKeyDictionary

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
            self.phases: dict[str, Peak] = {}
            self.labels = WeakIdKeyDictionary()  # storage -> (what made it, bytes)
            self.largest_at_peak: dict = {}
            self._labeled_at: dict = {}
            self._op = "before the step"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = func.__name__.split(".")[0]
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t) -> None:
            super()._track(reftype, t)
            for st in get_untyped_storages(t):
                if st not in self.labels:
                    where = max(self._mod_tracker.parents, key=len, default="")
                    phase = "backward" if self._mod_tracker.is_bw else "forward"
                    self.labels[st] = (f"{self._op} in {where or 'the step'} ({phase})",
                                       st.nbytes(), t.device.type)

        def _largest(self, top: int = 6) -> list[tuple[str, int, int]]:
            """The live storages grouped by what made them: (label, count, bytes), largest
            first."""
            groups: dict[str, list[int]] = {}
            for label, nbytes, device in list(self.labels.values()):
                if device == "meta":  # the offload pool's host buffers (planned, not real)
                    continue
                g = groups.setdefault(label, [0, 0])
                g[0] += 1
                g[1] += nbytes
            return sorted(((k, c, b) for k, (c, b) in groups.items()),
                          key=lambda x: -x[2])[:top]

        def end_phase(self, name: str, device_type: str = "cpu") -> None:
            """Note the peak since the last phase ended as ``name``'s, and start anew."""
            self.phases[name] = self.breakdown(device_type)
            self._labeled_at = {}
            self._peak_mem = {d: s[_TOTAL_KEY] for d, s in self._curr_mem_snap.items()}
            self._peak_mem_snap = {d: dict(s) for d, s in self._curr_mem_snap.items()}
            self.pool_at_peak = {d: sum(st.nbytes() for st in list(self.pool_storages))
                                 for d in self._curr_mem_snap}

        def _update_peak_stats(self, peak_state) -> None:
            # The step's peak only: MemTracker also keeps every module's peak, walking all
            # modules at each allocation, which makes a 32-layer trace quadratic.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    # (one device per trace; fake storages report "meta")
                    self.pool_at_peak[dev] = sum(st.nbytes() for st in list(self.pool_storages))
                    # What is alive at the peak, for the report; refreshed when the peak
                    # grew by 1% (each refresh walks every live storage).
                    if snap[_TOTAL_KEY] > 1.01 * self._labeled_at.get(dev, 0):
                        self._labeled_at[dev] = snap[_TOTAL_KEY]
                        self.largest_at_peak[dev] = self._largest()

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
            return Peak(snap["Total"], kinds, largest=list(self.largest_at_peak.get(dev) or []))

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
    peak_phase: str = ""
    phases: dict = field(default_factory=dict)
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


def _trace(config, sp, world: int, seq_len: int, *, shard: bool, host_limit: int):
    """One traced step: ``(phase peaks, host peak bytes, refusal or None)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_world(world)
    mesh = sp.dims(world).build_mesh("cpu")  # outside: the mesh reads its rank map
    refused = None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, optimizer = build(config, sp, mesh, device="cpu", shard=shard,
                                 host_memory_limit=host_limit)
        init_optimizer_state(model, optimizer)
        batch = make_batch(seq_len, config.vocab_size, mesh, "cpu")
        session = getattr(model, "activation_offload", None)
        with track_peak(track=(model, optimizer, *batch.values())) as tracker:
            try:
                train_step(model, optimizer, batch, on_phase=tracker.end_phase)
            except ValueError as e:  # the offload pool refused: host memory
                refused = str(e).split(". Fix")[0]
                tracker.end_phase("refused")
    host = session.pool.stats.peak_host_bytes if session is not None else 0
    return tracker.phases, host, refused


def _extrapolate(a: Peak, b: Peak, la: int, lb: int, layers: int) -> Peak:
    def line(x: int, y: int) -> int:
        return int(round(x + (y - x) * (layers - la) / (lb - la)))

    return Peak(line(a.total, b.total), {k: line(a.by_kind[k], b.by_kind[k]) for k in KINDS},
                line(a.host, b.host), largest=b.largest)


TRACE_LAYERS = (3, 4)
"""Layer counts traced when a model's own count is larger (see :func:`plan`)."""


def plan(model: str, seq_len: int, *, gpus: int, nodes: int = 1, stack: str | dict = "ours",
         gpu_memory: int = 80 * GiB, host_memory: int = int(1.5 * 1024) * GiB,
         reserve: float = 0.05, layers: int | None = None, shard: bool = True,
         full_trace: bool = False) -> Estimate:
    """Trace one training step of ``model`` at ``seq_len`` tokens over ``gpus * nodes`` ranks
    (rank 0) and compare its peak with the budgets: ``gpu_memory * (1 - reserve)`` per rank on
    the device, and the offload pool's limit, 80% of ``host_memory`` per node split among
    its ``gpus`` ranks (what :class:`offload.HostBufferPool` allows itself).

    Depth: a step's memory is affine in the number of identical decoder layers, phase by
    phase (forward, backward, optimizer): each layer adds its parameter, gradient and
    optimizer shards and its offloaded (or kept) input, while the activation peak is one
    layer's. So unless ``full_trace``, a model deeper than 4 layers is traced at 3 and 4
    layers and each phase's figures are extended along that line to the real depth; the
    step's peak is the largest phase. ``tests/test_plan.py`` checks this against full traces.
    """
    world = gpus * nodes
    sp = stack_config(stack, world=world)
    if seq_len % (world * 2) != 0:  # zigzag: 2 x sp chunks of equal length
        seq_len += world * 2 - seq_len % (world * 2)
    config = model_config(model, layers=layers, max_positions=seq_len)
    host_limit = int(0.8 * host_memory) // gpus
    name = stack if isinstance(stack, str) else "custom"
    start = time.perf_counter()
    depth = config.num_hidden_layers
    if full_trace or depth <= TRACE_LAYERS[1]:
        phases, host, refused = _trace(config, sp, world, seq_len, shard=shard,
                                       host_limit=host_limit)
        peaks = {k: replace(v, host=host) for k, v in phases.items()}
    else:
        la, lb = TRACE_LAYERS
        traced = []
        for n in (la, lb):
            config.num_hidden_layers = n
            phases, host, refused = _trace(config, sp, world, seq_len, shard=shard,
                                           host_limit=1 << 62)
            traced.append({k: replace(v, host=host) for k, v in phases.items()})
        config.num_hidden_layers = depth
        peaks = {k: _extrapolate(traced[0][k], traced[1][k], la, lb, depth)
                 for k in traced[0]}
        host = max(p.host for p in peaks.values())
        refused = None
        if host > host_limit:
            refused = (f"offloading the inputs of {depth} checkpointed layers needs "
                       f"{host / GiB:.2f} GiB of host memory per rank, more than the offload "
                       f"limit of {host_limit / GiB:.2f} GiB")
    phase = max(peaks, key=lambda k: peaks[k].total)
    peak = replace(peaks[phase], host=host)
    return Estimate(model=model, stack=name, seq_len=seq_len, world=world, gpus_per_node=gpus,
                    sp={k: getattr(sp, k) for k in ("sequence_parallel_size", "ring_degree",
                                                    "head_chunk_size", "fuse_projections",
                                                    "tiled_mlp", "tiled_norms", "loss_tiles",
                                                    "activation_checkpointing",
                                                    "offload_activations")},
                    peak=peak, device_budget=int(gpu_memory * (1 - reserve)),
                    host_budget=host_limit, refused=refused, peak_phase=phase,
                    phases={k: v.total for k, v in peaks.items()},
                    trace_s=time.perf_counter() - start)


# --- command line -------------------------------------------------------------------------------

def _int_auto_none(text: str):
    low = text.lower()
    if low in ("none", "off", "no"):
        return None
    if low == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'auto' or 'none', got {text!r}")


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    convert.__name__ = parse.__name__
    return convert


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m arctic.plan",
        description="Trace one training step under FakeTensorMode and say whether it fits.")
    p.add_argument("--model", default="llama3-8b",
                   help=f"one of {', '.join(MODELS)}, or a config.json path")
    p.add_argument("--seq-len", type=_arg(parse_tokens), default=None,
                   help="tokens in one sequence (5000000, 4M, 512K); needed unless --find-max")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", type=_arg(parse_bytes), default=parse_bytes("80GiB"),
                   help="memory of one GPU (80GiB, 141GB)")
    p.add_argument("--host-memory", type=_arg(parse_bytes), default=parse_bytes("1.5TiB"),
                   help="host memory of one node")
    p.add_argument("--reserve", type=float, default=0.05,
                   help="fraction of GPU memory kept for the CUDA context, NCCL and "
                        "fragmentation (default 0.05)")
    stack = p.add_argument_group("settings (default: the 'ours' stack)")
    stack.add_argument("--stack", choices=sorted(STACKS), default=None,
                       help="a named stack; the flags below change it")
    stack.add_argument("--ds-config", type=Path, default=None,
                       help="a DeepSpeed JSON with our 'ulysses' block (ZeRO-3 is planned as "
                            "FSDP2: the same per-rank shards)")
    stack.add_argument("--ulysses", type=int, default=None, help="Ulysses degree")
    stack.add_argument("--ring", type=int, default=None, help="ring degree")
    stack.add_argument("--head-chunk", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="query heads per chunk: an int, auto or none")
    stack.add_argument("--tiled-mlp", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="MLP tiles: an int, auto or none")
    stack.add_argument("--loss-tiles", type=_int_auto_none, default=argparse.SUPPRESS,
                       help="logits + loss tiles: an int or auto")
    stack.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction,
                       default=None, help="q/k/v/o projections inside the head-chunk loop")
    stack.add_argument("--tiled-norms", action=argparse.BooleanOptionalAction, default=None,
                       help="tile the RMSNorms with the MLP")
    stack.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                       help="checkpoint layers and offload their inputs to the host")
    stack.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--layers", type=int, default=None,
                   help="override the decoder layer count (quick checks)")
    p.add_argument("--full-trace", action="store_true",
                   help="trace every layer instead of 3 and 4 layers extended to the real "
                        "depth (slower; the two agree, see tests/test_plan.py)")
    p.add_argument("--find-max", action="store_true",
                   help="bisect for the longest sequence that fits")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of peak memory against sequence length: these settings, plain "
                        "Ulysses, ALST-style and ours (needs matplotlib)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict:
    """The stack's SequenceParallelConfig fields from the command line."""
    world = args.gpus * args.nodes
    if args.ds_config is not None:
        if args.stack is not None:
            raise ValueError("give --stack or --ds-config, not both")
        ds = _load(args.ds_config)
        zero = ds.get("zero_optimization", {}).get("stage", 0)
        if zero not in (0, 3):
            raise ValueError(f"--ds-config has ZeRO stage {zero}: the planner plans full "
                             f"sharding (ZeRO-3 or FSDP2); use stage 3")
        if ds.get("zero_optimization", {}).get("offload_optimizer") or \
                ds.get("zero_optimization", {}).get("offload_param"):
            print("note: the config offloads the optimizer or parameters to the host; the "
                  "planner keeps them on the GPU (FSDP2 shards), so its device peak is an "
                  "upper bound", file=sys.stderr)
        fields = SequenceParallelConfig.from_ds_config(ds, world_size=world)
        fields = {k: getattr(fields, k) for k in (
            "sequence_parallel_size", "ring_degree", "head_chunk_size", "fuse_projections",
            "tiled_mlp", "tiled_norms",
            "loss_tiles", "activation_checkpointing", "offload_activations")}
    else:
        fields = dict(STACKS[args.stack or "ours"])
    ring = args.ring if args.ring is not None else fields.get("ring_degree", 1)
    if args.ulysses is not None:
        fields["sequence_parallel_size"] = args.ulysses * ring
    fields["ring_degree"] = ring
    for arg, key in (("head_chunk", "head_chunk_size"), ("tiled_mlp", "tiled_mlp"),
                     ("loss_tiles", "loss_tiles")):
        if hasattr(args, arg):
            fields[key] = getattr(args, arg)
    for arg in ("fuse_projections", "tiled_norms"):
        if getattr(args, arg) is not None:
            fields[arg] = getattr(args, arg)
    if args.checkpointing is not None:
        fields["activation_checkpointing"] = args.checkpointing
        if not args.checkpointing:
            fields["offload_activations"] = False
    if args.offload is not None:
        fields["offload_activations"] = args.offload
        if args.offload:
            fields["activation_checkpointing"] = True
    SequenceParallelConfig(**{"sequence_parallel_size": world, **fields}).dims(world)
    return fields


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def report(e: Estimate) -> str:
    lines = [f"{e.model}, {e.seq_len:,} tokens on {e.world} GPUs "
             f"({e.world // e.gpus_per_node} node(s) x {e.gpus_per_node}): "
             f"{e.seq_len // e.sp['sequence_parallel_size']:,} tokens per rank",
             "settings: " + ", ".join(f"{k}={v}" for k, v in e.sp.items()),
             f"per-rank device peak {_gib(e.peak.total)}  (budget {_gib(e.device_budget)})"]
    lines += [f"  {kind:<18}{_gib(v)}" for kind, v in e.peak.by_kind.items()]
    if e.peak.largest:
        lines.append(f"largest at the peak ({e.peak_phase}):")
        lines += [f"  {b / GiB:8.2f} GiB in {c:>3} tensor(s): {label}"
                  for label, c, b in e.peak.largest]
    lines.append(f"host, offloaded      {_gib(e.peak.host)}  (budget {_gib(e.host_budget)} per "
                 f"rank: 80% of the node's memory / {e.gpus_per_node})")
    verdict = "FITS" if e.fits else f"DOES NOT FIT (limit: {e.limit()})"
    lines.append(f"verdict: {verdict}   [traced in {e.trace_s:.0f} s]")
    return "\n".join(lines)


def find_max(plan_at, *, start: int, granule: int, log=print) -> tuple[int, list[Estimate]]:
    """The longest multiple of ``granule`` tokens that fits, to within 2%. ``plan_at(n)`` traces
    ``n`` tokens. Returns it (0 if one granule does not fit) and every estimate made.

    Device and host memory grow about linearly with the length, so the search steps to where
    the line through the last two traces crosses the budget (regula falsi, kept inside the
    bracket of the longest length that fits and the shortest that does not), and halves the
    bracket when that step would not shrink it enough. Each step is one trace.
    """
    tried: list[Estimate] = []

    def load(e: Estimate) -> float:  # > 1: does not fit
        if e.refused is not None:
            return max(2.0, e.peak.host / max(1, e.host_budget))
        return max(e.peak.total / e.device_budget, e.peak.host / max(1, e.host_budget))

    def at(n: int) -> Estimate:
        e = plan_at(n)
        tried.append(e)
        log(f"  {n:>12,} tokens: peak {_gib(e.peak.total)}, host {_gib(e.peak.host)} -> "
            f"{'fits' if e.fits else 'does not fit (' + e.limit() + ')'}")
        return e

    snap = lambda n: max(granule, int(n) // granule * granule)  # noqa: E731
    lo, hi = None, None  # (n, load) of the longest fit / shortest misfit
    e = at(snap(start))
    if e.fits:
        lo = (e.seq_len, load(e))
    else:
        hi = (e.seq_len, load(e))
    while lo is None or hi is None:
        # Bracket. Memory is about a + b n with a > 0 (parameters, optimizer state), so scaling
        # by the line through the origin lands short of the crossing: step 5% past it when
        # growing, 2% short of it when shrinking, so the next trace lands on the other side.
        n, f = lo or hi
        if lo is not None:
            target = snap(n / f * 1.05) if f > 0 else 2 * n
            target = max(target, n + granule)
        else:
            target = min(snap(n / f * 0.98), snap(n // 2) if f > 2 else n - granule)
        if target == n or target < granule:
            break
        e = at(target)
        if e.fits:
            lo = (e.seq_len, load(e))
        else:
            hi = (e.seq_len, load(e))
        if hi is not None and hi[0] <= granule and not e.fits:
            return 0, tried
    if lo is None:  # not even one granule fits
        return 0, tried
    while hi[0] - lo[0] > max(granule, lo[0] // 50):
        (n0, f0), (n1, f1) = lo, hi
        guess = n0 + (1 - f0) * (n1 - n0) / (f1 - f0) if f1 > f0 else (n0 + n1) / 2
        width = n1 - n0
        if not (n0 + width / 10 < guess < n1 - width / 10):
            guess = min(max(guess, n0 + width / 10), n1 - width / 10)
        n = snap(guess)
        if n <= n0 or n >= n1:
            n = snap((n0 + n1) / 2)
            if n <= n0 or n >= n1:
                break
        e = at(n)
        if e.fits:
            lo = (e.seq_len, load(e))
        else:
            hi = (e.seq_len, load(e))
    return lo[0], tried


def plot(path: Path, series: dict[str, list[Estimate]], *, budget: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, estimates in series.items():
        pts = sorted((e.seq_len, e.peak.total) for e in estimates if e.refused is None)
        ax.plot([p[0] / 1e6 for p in pts], [p[1] / GiB for p in pts], marker="o", label=name)
    ax.axhline(budget / GiB, color="k", linestyle="--", linewidth=1, label="device budget")
    ax.set_xlabel("sequence length (M tokens)")
    ax.set_ylabel("per-rank peak device memory (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    try:
        return _main(parse_args(argv))
    except ValueError as e:  # bad settings: say what, no traceback
        raise SystemExit(f"error: {e}")


def _main(args: argparse.Namespace) -> int:
    if args.seq_len is None and not args.find_max:
        raise SystemExit("give --seq-len, or --find-max")
    fields = settings_from_args(args)
    model_config(args.model, layers=args.layers)  # an unknown model fails here, not mid-way
    world = args.gpus * args.nodes
    common = dict(gpus=args.gpus, nodes=args.nodes, gpu_memory=args.gpu_memory,
                  host_memory=args.host_memory, reserve=args.reserve, layers=args.layers,
                  full_trace=args.full_trace)

    def plan_at(n: int, stack=fields) -> Estimate:
        return plan(args.model, n, stack=stack, **common)

    result: dict = {"model": args.model, "gpus": args.gpus, "nodes": args.nodes,
                    "gpu_memory": args.gpu_memory, "host_memory": args.host_memory}
    estimates: list[Estimate] = []
    if args.seq_len is not None:
        e = plan_at(args.seq_len)
        estimates.append(e)
        print(report(e))
        result["estimate"] = _as_json(e)
    if args.find_max:
        sp = fields.get("sequence_parallel_size", world)
        print(f"finding the longest sequence that fits ({args.model}, {world} GPUs):")
        best, tried = find_max(plan_at, start=args.seq_len or 1 << 20, granule=1024 * sp)
        estimates += tried
        print(f"longest that fits: {best:,} tokens ({best / 1e6:.2f}M)")
        result["max_seq_len"] = best
        result["tried"] = [_as_json(e) for e in tried]
    if args.plot is not None:
        top = max(e.seq_len for e in estimates)
        lengths = sorted({max(1024 * world, int(top * f) // (1024 * world) * 1024 * world)
                          for f in (0.25, 0.5, 0.75, 1.0)})
        series = {"these settings": [e for e in estimates if e.seq_len in lengths]}
        for name in ("ulysses", "alst", "ours"):
            series[name] = [plan_at(n, STACKS[name]) for n in lengths]
        for n in lengths:
            if not any(e.seq_len == n for e in series["these settings"]):
                series["these settings"].append(plan_at(n))
        plot(args.plot, series, budget=int(args.gpu_memory * (1 - args.reserve)),
             title=f"{args.model}, {world} x {args.gpu_memory / GiB:.0f} GiB")
        print(f"wrote {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _as_json(e: Estimate) -> dict:
    return {"seq_len": e.seq_len, "stack": e.stack, "sp": e.sp, "fits": e.fits,
            "limit": None if e.fits else e.limit(), **e.peak.summary(),
            "device_budget": e.device_budget, "host_budget": e.host_budget,
            "trace_s": round(e.trace_s, 1)}


if __name__ == "__main__":
    sys.exit(main())
