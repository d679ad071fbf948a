"""offload.disk: past the host limit, saved activations spill to files; gradients stay bit for
bit those of host-only offload, with either I/O backend (plain files on threads, DeepSpeed's
aio op: ``offload.disk_aio``), a plan that host plus disk cannot hold is refused before any
layer runs, and no file outlives its step, a failed forward, the process, or a killed one.
Single process; what is spilled is counted exactly (``OffloadStats``). The default
``disk_io="auto"`` takes aio only where DeepSpeed has it pre-built, so the tests that do not
name a backend run plain files unless the install has it; those that name ``"aio"`` are
marked slow (they may JIT-build the op) and skip, with the reason, where it cannot run."""

from __future__ import annotations

import gc
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
import offload.disk
import offload.disk_aio
from arctic.config import SequenceParallelConfig
from offload import HostBufferPool, OffloadSession, offload_saved_activations
from offload.disk import PREFIX

B, S, E, BLOCKS = 4, 64, 32, 5
HIDDEN = B * S * E * 4  # one block input, fp32


class _Fails(nn.Module):
    """A block that raises in its forward while ``fail`` is set (a failure mid-forward)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.fail = block, False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("block failed")
        return self.block(x)


def _blocks(pool: HostBufferPool, prefetch: bool = True) -> nn.Sequential:
    """An input projection and BLOCKS checkpointed Linear-GELU-Linear blocks whose inputs
    (``[B, S, E]``, one per block, none a leaf) go to ``pool``."""
    torch.manual_seed(0)
    blocks = [_Fails(nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E)))
              for _ in range(BLOCKS)]
    model = nn.Sequential(nn.Linear(E, E), *blocks)
    return offload.apply_activation_checkpointing(model, layers=blocks, offload_to_cpu=True,
                                                  pool=pool, min_offload_bytes=0,
                                                  prefetch=prefetch)


def _step(model, seed=1, device="cpu"):
    x = torch.randn(B, S, E, generator=torch.Generator().manual_seed(seed)).to(device)
    model(x).square().sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def _files(pool) -> int:
    return len(os.listdir(pool.disk.path)) if os.path.isdir(pool.disk.path) else 0


def _skip_unless_aio(tmp_path) -> None:
    """Skip, with the reason, when DeepSpeed's aio op cannot serve ``tmp_path`` (no libaio,
    no deepspeed). It may JIT-build the op (minutes, once per install): the tests that call
    this are marked slow, so the default run (CI) never builds it."""
    reason = offload.disk_aio.unusable(str(tmp_path / "probe"), build=True)
    if reason is not None:
        pytest.skip(f"DeepSpeed's aio op is not usable here: {reason}")


IOS = ["threads", pytest.param("aio", marks=pytest.mark.slow)]
"""The backends a parity test runs: plain files in the default run, aio with -m slow."""


# Each backend's file reader, which the tier looks up at each read.
READERS = {"threads": (offload.disk, "_read_file"), "aio": (offload.disk_aio, "read")}


@pytest.mark.parametrize("io", IOS)
def test_spilled_blocks_give_bit_identical_gradients_and_leave_no_file(tmp_path, monkeypatch,
                                                                       io):
    if io == "aio":
        _skip_unless_aio(tmp_path)
    host_only = _blocks(HostBufferPool(limit_bytes=1 << 30))
    ref = [_step(host_only, seed) for seed in (1, 2)]
    pool = HostBufferPool(limit_bytes=HIDDEN * 3 // 2, disk_dir=tmp_path,  # room for 1 block
                          disk_io=io)
    assert pool.disk.io == io
    model = _blocks(pool)
    reads, seen, in_backward = [], [], [False]
    module, name = READERS[io]
    read = getattr(module, name)
    monkeypatch.setattr(module, name, lambda path, out: (
        reads.append(threading.current_thread().name), read(path, out))[1])
    for i, block in enumerate(model[1:]):
        block.block.register_forward_pre_hook(  # the inner module: the recompute calls it
            lambda m, a, i=i: seen.append((i, pool.stats.prefetches, _files(pool)))
            if in_backward[0] else None)
    for seed, want in zip((1, 2), ref):  # the second step reuses the pool
        pool.reset_stats()
        x = torch.randn(B, S, E, generator=torch.Generator().manual_seed(seed))
        loss = model(x).square().sum()
        assert len(os.listdir(pool.disk.path)) == BLOCKS - 1  # one file per spilled input
        in_backward[0] = True
        loss.backward()
        in_backward[0] = False
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        assert torch.equal(grad, want)
        s = pool.stats
        # Block 0's input fills the host; block 1's does not fit, so it and all later go to disk.
        assert (s.peak_host_bytes, s.bytes_spilled) == (HIDDEN, (BLOCKS - 1) * HIDDEN)
        assert s.peak_disk_bytes == s.bytes_spilled and s.bytes_offloaded == BLOCKS * HIDDEN
        assert s.disk_bytes == s.host_bytes == 0 and s.bytes_restored == s.bytes_offloaded
        assert os.listdir(tmp_path) == []
    # Block i's recompute finds block i-1's read already started (block 4, the first in
    # backward, is read on the spot, blocks 3..1 on the I/O threads), and the files of the
    # blocks whose backward is done deleted: (block, prefetches, files) at each recompute.
    assert seen[-BLOCKS:] == [(4, 1, 4), (3, 2, 3), (2, 3, 2), (1, 4, 1), (0, 4, 0)]
    assert reads[:1] == ["MainThread"] and len(reads) == 2 * (BLOCKS - 1)
    assert all(name.startswith("arctic-offload-io") for name in reads[1:BLOCKS - 1])


def test_without_prefetch_the_disk_reads_still_run_a_layer_ahead(tmp_path, monkeypatch):
    """prefetch=False with a disk tier: block i's recompute starts the read of block i-1's
    file into host memory (on the I/O threads), with no copy back started (no prefetch);
    the copy follows at the unpack. Gradients are bit for bit those of host-only offload,
    and no file is left."""
    host_only = _blocks(HostBufferPool(limit_bytes=1 << 30))
    ref = _step(host_only)
    pool = HostBufferPool(limit_bytes=HIDDEN * 3 // 2, disk_dir=tmp_path, disk_io="threads")
    model = _blocks(pool, prefetch=False)
    stages, reads, seen, in_backward = [], [], [], [False]
    stage = offload.disk._Spilled.stage
    monkeypatch.setattr(offload.disk._Spilled, "stage",
                        lambda self: (stages.append(1), stage(self))[1])
    read = offload.disk._read_file
    monkeypatch.setattr(offload.disk, "_read_file", lambda path, out: (
        reads.append(threading.current_thread().name), read(path, out))[1])
    for i, block in enumerate(model[1:]):
        block.block.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, len(stages))) if in_backward[0] else None)
    x = torch.randn(B, S, E, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().sum()
    in_backward[0] = True
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grad, ref)
    # block 4 (the first in backward) read on the spot; each recompute staged the block
    # before it that is on disk (block 0's input is in host memory: nothing to read)
    assert seen == [(4, 1), (3, 2), (2, 3), (1, 3), (0, 3)]
    assert reads[0] == "MainThread" and len(reads) == BLOCKS - 1
    assert all(name.startswith("arctic-offload-io") for name in reads[1:])
    s = pool.stats
    assert s.prefetches == 0 and s.bytes_restored == s.bytes_offloaded == BLOCKS * HIDDEN
    assert os.listdir(tmp_path) == []


def _bits(t):
    return t.resolve_conj().contiguous().view(torch.uint8)


@pytest.mark.parametrize("io", IOS)
def test_spilled_tensors_keep_their_bits_dtype_and_layout(tmp_path, io):
    if io == "aio":
        _skip_unless_aio(tmp_path)
    pool = HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_io=io)  # everything spills
    g = torch.Generator().manual_seed(0)
    chunk = offload.disk_aio.CHUNK_BYTES
    odd = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])  # NaN, -0, inf, subnormal
    tensors = {
        "fp32, NaN, -0, inf, subnormal": odd,
        "bf16, permuted": torch.randn(3, 5, 7, generator=g).bfloat16().permute(2, 0, 1),
        "fp16, a view into a larger storage": torch.randn(20, generator=g).half()[4:12],
        "fp32, not dense (comes back contiguous)": torch.randn(4, 6, generator=g)[:, ::2],
        "int64": torch.randint(-2**62, 2**62, (9,), generator=g),
        "bool": torch.rand(5, 5, generator=g) > 0.5,
        "complex64, conjugated view": torch.randn(6, dtype=torch.complex64, generator=g).conj(),
        "empty": torch.empty(0, 3),
        "uint8, two aio chunks and a ragged tail": torch.randint(
            0, 256, (chunk + offload.disk_aio.ALIGN + 3,), dtype=torch.uint8, generator=g),
    }
    session = OffloadSession(pool, min_bytes=0)
    with session.group() as hooks:
        packed = [hooks.pack(t) for t in tensors.values()]
    assert len(os.listdir(pool.disk.path)) == len(tensors)
    for (name, t), p in zip(tensors.items(), packed):
        for out in (hooks.unpack(p), hooks.unpack(p)):  # read twice (retain_graph)
            assert out.dtype == t.dtype and torch.equal(_bits(out), _bits(t)), name
            dense = torch.empty_like(t, device="meta").stride()
            assert out.stride() == dense and out.untyped_storage().nbytes() == t.nbytes, name
    assert pool.stats.bytes_spilled == sum(t.nbytes for t in tensors.values())
    del packed, p
    assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == 0


def test_a_layer_spills_whole_and_the_layers_after_it_follow(tmp_path):
    pool = HostBufferPool(limit_bytes=3000, disk_dir=tmp_path)
    session = OffloadSession(pool, min_bytes=0)
    big, small = torch.randn(500), torch.randn(100)  # 2000 and 400 bytes
    packed = []
    for group in ([big], [big.clone(), small.clone()], [small.clone()]):
        with session.group() as hooks:
            packed += [hooks.pack(t) for t in group]
    # The first group's tensor is on the host; the second does not fit whole, so its small
    # tensor (which would) follows it to disk, as does all of the third group.
    assert (pool.stats.peak_host_bytes, pool.stats.bytes_spilled) == (2000, 2800)
    assert len(os.listdir(pool.disk.path)) == 3
    del packed, hooks  # backward is over: the groups are gone, and so are the files
    assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == pool.stats.host_bytes == 0
    with session.group() as hooks:  # the next forward starts on the host again
        again = hooks.pack(small.clone())
    assert pool.stats.host_bytes == 400 and pool.stats.bytes_spilled == 2800
    assert isinstance(again, tuple) and os.listdir(tmp_path) == []


def test_hf_layers_spill_through_arctic_and_match_host_offload(tmp_path):
    pytest.importorskip("transformers", reason="the HF case needs transformers ([hf])")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic import apply_activation_checkpointing

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    hidden = 2 * 64 * 128 * 4

    def grads(**kw):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        apply_activation_checkpointing(model, offload_to_cpu=True, min_offload_bytes=0, **kw)
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), model

    # A refused directory leaves the model as it was: checkpointing can be applied after.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="offload_dir='.*missing' is not an existing directory"):
        apply_activation_checkpointing(model, offload_to_cpu=True,
                                       offload_dir=str(tmp_path / "missing"))
    apply_activation_checkpointing(model, offload_to_cpu=True, host_memory_limit=1 << 30)
    want, _ = grads(host_memory_limit=1 << 30)
    # Layer 0's input and the RoPE cos/sin and position ids it shares fit; layers 1, 2 spill.
    got, model = grads(host_memory_limit=hidden + hidden // 4, offload_dir=str(tmp_path))
    assert torch.equal(got, want)
    stats = model.activation_offload.pool.stats
    assert stats.bytes_spilled == 2 * hidden and stats.disk_bytes == 0
    assert os.listdir(tmp_path) == []


def test_refused_before_the_first_block_when_host_and_disk_cannot_hold_it(tmp_path,
                                                                          monkeypatch):
    ran = []

    def model_of(pool):
        model = _blocks(pool)
        model[1].block.register_forward_pre_hook(lambda m, a: ran.append(1))
        return model

    capped = model_of(HostBufferPool(limit_bytes=HIDDEN, disk_dir=tmp_path,
                                     disk_limit_bytes=3 * HIDDEN))  # 4 of 5 blocks
    where = re.escape(repr(str(tmp_path)))
    with pytest.raises(ValueError, match=rf"offloading the inputs of 5 checkpointed layers needs "
                                         rf"0\.00 GiB \(163,840 bytes\) per rank, more than the "
                                         rf"host limit .* plus the disk budget of 0\.00 GiB "
                                         rf"\(98,304 bytes\) in {where} \(disk_limit_bytes"):
        _step(capped)
    # The disk's free space is the budget, split among the node's ranks.
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 6 * HIDDEN))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pool = HostBufferPool(limit_bytes=HIDDEN, disk_dir=tmp_path)
    assert pool.disk.limit_bytes == 3 * HIDDEN
    with pytest.raises(ValueError, match=rf"in {where} \(the directory's free space"):
        _step(model_of(pool))
    assert ran == [] and os.listdir(tmp_path) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # 1 + 6 blocks' room: it runs
    _step(model_of(HostBufferPool(limit_bytes=HIDDEN, disk_dir=tmp_path)))
    assert ran == [1, 1]  # forward and recompute
    # Without the up-front plan (an offload block), the budget still holds, file by file.
    pool = HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_limit_bytes=3000)
    x = torch.randn(500, requires_grad=True) * 1  # 2000 bytes
    with offload_saved_activations(pool, min_bytes=0):
        y = x.sin()
        with pytest.raises(ValueError, match=rf"to {where} would make the offload files "
                                             rf"0\.00 GiB \(4,000 bytes\), over the disk "
                                             rf"budget of 0\.00 GiB \(3,000 bytes\)"):
            y.exp()
    del y
    assert os.listdir(tmp_path) == []


def test_a_failed_forward_leaves_no_file_and_the_pool_goes_on(tmp_path):
    pool = HostBufferPool(limit_bytes=HIDDEN * 3 // 2, disk_dir=tmp_path)
    model = _blocks(pool)
    want = _step(_blocks(HostBufferPool(limit_bytes=1 << 30)))
    model[4].fail = True  # block 3 (model[0] is the input projection) raises
    with pytest.raises(RuntimeError, match="block failed"):
        _step(model)
    gc.collect()  # the traceback's frames held the partial graph
    # Blocks 1 and 2 spilled, and block 3's input (saved before its forward ran).
    assert pool.stats.bytes_spilled == 3 * HIDDEN
    assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == 0
    model[4].fail = False
    assert torch.equal(_step(model), want) and os.listdir(tmp_path) == []


def test_files_go_at_exit_and_dead_processes_dirs_at_start(tmp_path):
    script = (f"import os, torch\n"
              f"from offload import HostBufferPool, offload_saved_activations\n"
              f"pool = HostBufferPool(limit_bytes=1, disk_dir={str(tmp_path)!r})\n"
              f"x = torch.randn(1000, requires_grad=True)\n"
              f"with offload_saved_activations(pool, min_bytes=0):\n"
              f"    y = x.exp()  # y, a global, holds the graph at exit: the file stays\n"
              f"print(len(os.listdir(pool.disk.path)), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    # The last line: DeepSpeed (io="auto" may load its aio op) logs warnings to stdout.
    assert proc.returncode == 0 and out.strip().splitlines()[-1:] == ["1"], (out, err)
    assert "Exception ignored" not in err, err
    assert os.listdir(tmp_path) == []
    # A killed process leaves its directory; the next tier made there removes it, and leaves
    # those of running processes, of other hosts and other names.
    host, dead = socket.gethostname(), proc.pid
    names = {f"{PREFIX}{host}-{dead}-0a1b": False, f"{PREFIX}{host}-{os.getppid()}-2c3d": True,
             f"{PREFIX}elsewhere-{dead}-4e5f": True, "not-ours": True}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "1.bin").write_bytes(b"x")
    HostBufferPool(limit_bytes=1, disk_dir=tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, stays in names.items() if stays)


def test_fake_tensors_spill_without_writing(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    pool = HostBufferPool(limit_bytes=5000, disk_dir=tmp_path)
    with FakeTensorMode():
        x = torch.randn(1000, requires_grad=True) * 1  # 4000 bytes: the host holds one
        with offload_saved_activations(pool, min_bytes=0):
            y = x.sin().exp()
        assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == 4000
        y.sum().backward()
    assert (pool.stats.bytes_spilled, pool.stats.peak_host_bytes) == (4000, 4000)
    del x, y
    assert pool.stats.disk_bytes == 0 and os.listdir(tmp_path) == []


def test_offload_dir_is_checked_in_config_and_arguments(tmp_path):
    on = {"activation_checkpointing": True, "offload_activations": True}
    cfg = SequenceParallelConfig.from_ds_config({"ulysses": {**on, "offload_dir": str(tmp_path)}})
    assert cfg.offload_dir == str(tmp_path)
    with pytest.raises(ValueError, match=r"ulysses.offload_dir='.*' needs offload_activations"):
        SequenceParallelConfig.from_ds_config({"ulysses": {"activation_checkpointing": True,
                                                           "offload_dir": str(tmp_path)}})
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"ulysses.offload_dir='{missing}' is not an existing "
                                         f"directory"):
        SequenceParallelConfig.from_ds_config({"ulysses": {**on, "offload_dir": missing}})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not an existing directory"):
        SequenceParallelConfig(**on, offload_dir=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="offload_dir must be a directory path"):
        SequenceParallelConfig(**on, offload_dir=3)
    layers = [nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="offload_dir='.*' needs offload_to_cpu=True"):
        offload.apply_activation_checkpointing(nn.Sequential(*layers), layers=layers,
                                               offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="offload_dir was given with a pool"):
        offload.apply_activation_checkpointing(
            nn.Sequential(*layers), layers=layers, offload_to_cpu=True,
            pool=HostBufferPool(limit_bytes=1), offload_dir=str(tmp_path))
    assert not SequenceParallelConfig(**on, offload_dir=str(tmp_path),
                                      offload_prefetch=False).offload_prefetch
    with pytest.raises(ValueError, match="offload_prefetch=false needs offload_activations"):
        SequenceParallelConfig(activation_checkpointing=True, offload_prefetch=False)
    with pytest.raises(ValueError, match="offload_prefetch must be true or false"):
        SequenceParallelConfig(**on, offload_prefetch="no")
    with pytest.raises(ValueError, match="disk_limit_bytes=5 needs disk_dir"):
        HostBufferPool(limit_bytes=1, disk_limit_bytes=5)
    with pytest.raises(ValueError, match="disk_limit_bytes must be a positive int"):
        HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_limit_bytes=0)
    with pytest.raises(ValueError, match="disk_dir='.*missing' is not an existing directory"):
        HostBufferPool(limit_bytes=1, disk_dir=missing)
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefetch", [True, False])
def test_cuda_spill_is_bit_identical_to_host_offload(tmp_path, prefetch):
    """On a GPU: spilled inputs go through pinned staging and the side stream (without
    prefetch: read a layer ahead into pinned memory, copied on the compute's stream);
    deterministic kernels (cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set if unset) so that
    equality means something. Not run in CI, which has no GPU."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        want = _step(_blocks(HostBufferPool(limit_bytes=1 << 30)).cuda(), device="cuda")
        pool = HostBufferPool(limit_bytes=HIDDEN * 3 // 2, disk_dir=tmp_path)
        model = _blocks(pool, prefetch).cuda()
        for _ in range(2):
            assert torch.equal(_step(model, device="cuda"), want)
            torch.cuda.synchronize()
            assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == 0
        assert pool.stats.bytes_spilled == 2 * (BLOCKS - 1) * HIDDEN
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("host_blocks", [0.5, 1.5, 2.0, 3.2])
def test_the_planners_disk_figure_bounds_what_spills(tmp_path, host_blocks):
    """The planner's disk bytes (``arctic.plan.estimate._spill``: the overflow past the host
    limit plus one layer, for whole-layer spilling) against a real spill: never below what
    the pool wrote to disk, and at most one layer above it."""
    from arctic.plan.estimate import _spill

    host_only = HostBufferPool(limit_bytes=1 << 30)
    _step(_blocks(host_only))
    inputs = host_only.stats.peak_host_bytes  # what host-only offload holds at once
    limit = int(HIDDEN * host_blocks)
    pool = HostBufferPool(limit_bytes=limit, disk_dir=tmp_path)
    _step(_blocks(pool))
    spilled, planned = pool.stats.peak_disk_bytes, _spill(inputs, 0, limit, BLOCKS)
    assert spilled > 0 and pool.stats.peak_host_bytes <= limit
    assert spilled <= planned <= spilled + -(-inputs // BLOCKS), (spilled, planned, inputs)
