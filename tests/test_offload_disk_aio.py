"""offload.disk_aio, the disk tier's DeepSpeed aio backend: the same gradients as plain files
and host-only offload, O_DIRECT's padding never written into a tensor, "aio" refused with its
reason where the op is unusable (before any file or collective) and "auto" falling back, and
every reason named with its fix. The tests that run the op are marked slow (they may JIT-build
it, minutes) and skip, with the reason, where it cannot run (no libaio)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
import offload.disk
import offload.disk_aio
from offload import HostBufferPool
from test_offload_disk import BLOCKS, HIDDEN, _blocks, _skip_unless_aio, _step


@pytest.mark.slow  # may JIT-build the op (_skip_unless_aio)
def test_aio_threads_and_host_only_give_the_same_gradients(tmp_path):
    _skip_unless_aio(tmp_path)
    want = _step(_blocks(HostBufferPool(limit_bytes=1 << 30)))
    for io in ("aio", "threads"):
        pool = HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_io=io)  # every block spills
        assert torch.equal(_step(_blocks(pool)), want), io
        assert (pool.disk.io, pool.stats.bytes_spilled) == (io, BLOCKS * HIDDEN)
        assert os.listdir(tmp_path) == [] and pool.stats.disk_bytes == 0


@pytest.mark.slow  # may JIT-build the op (_skip_unless_aio)
def test_aio_reads_fill_the_tensor_alone_and_take_locked_memory_directly(tmp_path):
    """O_DIRECT moves whole 4 KiB blocks: a file is the bytes padded with zeros, and a read
    into a tensor whose size is no multiple of that writes nothing past it, whether it goes
    through a bounce buffer or (page-locked and page-aligned) straight into the tensor."""
    _skip_unless_aio(tmp_path)
    aio, align = offload.disk_aio, offload.disk_aio.ALIGN
    handle = aio._state["op"].aio_handle()
    region = handle.new_cpu_locked_tensor(4 * align, torch.empty(0, dtype=torch.uint8))
    try:
        n = align + 100
        src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
        aio.write(str(tmp_path / "a"), src)  # from unlocked memory: through a bounce buffer
        raw = (tmp_path / "a").read_bytes()
        assert raw == bytes(src.tolist()) + bytes(align - 100)
        for start in (0, 100):  # page-aligned (direct bulk, bounced tail), or not (bounced)
            region.fill_(0xAB)
            into = region[start:start + n]
            assert handle.is_pinned(into)
            assert aio.read(str(tmp_path / "a"), into) is into and torch.equal(into, src)
            assert (region[:start] == 0xAB).all() and (region[start + n:] == 0xAB).all()
            aio.write(str(tmp_path / f"from{start}"), into)  # from locked memory
            assert (tmp_path / f"from{start}").read_bytes() == raw
        (tmp_path / "a").write_bytes(raw[:align])  # truncated: an error, not a short read
        with pytest.raises(OSError, match=rf"a: {align} bytes before a read, expected {2 * align}"):
            aio.read(str(tmp_path / "a"), torch.empty(n, dtype=torch.uint8))
    finally:
        handle.free_cpu_locked_tensor(region)


def _unusable(reason, calls):
    return lambda scratch, build=True: (calls.append(build), reason)[1]


def test_io_aio_is_refused_with_its_reason_and_auto_takes_what_works(tmp_path, monkeypatch):
    calls, collectives = [], []
    monkeypatch.setattr(offload.disk_aio, "unusable", _unusable("libaio is missing", calls))
    monkeypatch.setattr(offload.disk, "min_over_group",
                        lambda value, group: (collectives.append(value), value)[1])
    with pytest.raises(ValueError, match=r"disk_io='aio' \(offload_io, ulysses.offload_io\) "
                                         r"cannot be used: libaio is missing. Fix that, or set "
                                         r"it to 'threads'"):
        HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_io="aio")
    assert collectives == [] and os.listdir(tmp_path) == []  # refused before either
    pool = HostBufferPool(limit_bytes=1, disk_dir=tmp_path)  # "auto"
    assert (pool.disk.io, pool.disk.io_reason) == ("threads", "libaio is missing")
    assert calls == [True, False]  # only "aio" may start a JIT build of the op
    assert torch.equal(_step(_blocks(pool)), _step(_blocks(HostBufferPool(limit_bytes=1 << 30))))
    monkeypatch.setattr(offload.disk_aio, "unusable", _unusable(None, calls))
    pool = HostBufferPool(limit_bytes=1, disk_dir=tmp_path)
    assert (pool.disk.io, pool.disk.io_reason) == ("aio", None)
    assert HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_io="threads").disk.io == "threads"
    assert calls == [True, False, False]  # "threads" asks nothing of DeepSpeed


def test_io_values_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"disk_io must be one of \('auto', 'aio', 'threads'\), "
                                         r"got 'fast'"):
        HostBufferPool(limit_bytes=1, disk_dir=tmp_path, disk_io="fast")
    with pytest.raises(ValueError, match="disk_io='aio' needs disk_dir"):
        HostBufferPool(limit_bytes=1, disk_io="aio")
    layers = [nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="offload_io='threads' needs offload_dir"):
        offload.apply_activation_checkpointing(nn.Sequential(*layers), layers=layers,
                                               offload_to_cpu=True, offload_io="threads")
    with pytest.raises(ValueError, match="offload_io must be one of .*got 'AIO'"):
        offload.apply_activation_checkpointing(nn.Sequential(*layers), layers=layers,
                                               offload_to_cpu=True, offload_dir=str(tmp_path),
                                               offload_io="AIO")
    assert os.listdir(tmp_path) == []


def test_aio_unusable_names_the_reason(tmp_path, monkeypatch):
    """Each way the op can be unusable comes back as a reason (not an exception), with the
    fix; a missing build under "auto" is not remembered, so "aio" can still build it."""
    import resource

    aio = offload.disk_aio
    monkeypatch.setattr(aio, "_state", {})  # as in a fresh process; the real state is kept
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", None)
    assert "deepspeed is not installed" in aio.unusable(str(tmp_path / "s"))
    monkeypatch.undo()
    pytest.importorskip("deepspeed", reason="the other reasons need deepspeed installed",
                        exc_type=ImportError)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(aio, "_state", {})
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    assert "apt-get install libaio-dev" in aio.unusable(str(tmp_path / "s"))
    monkeypatch.setattr(aio, "_state", {})
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    from deepspeed.git_version_info import installed_ops
    assert aio._prebuilt() == bool(installed_ops.get("async_io"))  # read without importing
    monkeypatch.setattr(aio, "_prebuilt", lambda: False)
    assert "io='aio' builds it" in aio.unusable(str(tmp_path / "s"), build=False)
    assert aio._state == {} and os.listdir(tmp_path) == []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 << 20, 8 << 20))
    assert aio._memlock_problem(48 << 20, {"CapEff": "0", "VmLck": "1024 kB"}) == (
        "its bounce buffers need 48 MiB of page-locked memory, over RLIMIT_MEMLOCK (8192 KiB, "
        "`ulimit -l`, 1024 KiB locked already); raise the limit or run with CAP_IPC_LOCK")
    assert aio._memlock_problem(48 << 20, {"CapEff": f"{1 << 14:x}", "VmLck": "0 kB"}) is None
    assert aio._memlock_problem(4 << 20, {"CapEff": "0", "VmLck": "0 kB"}) is None


def test_auto_falls_back_without_importing_deepspeed(tmp_path):
    """Where DeepSpeed has no pre-built op, "auto" decides from its install's files: the
    fallback costs no import of deepspeed (seconds, and its log lines) and no build."""
    pytest.importorskip("deepspeed", reason="needs deepspeed installed", exc_type=ImportError)
    if offload.disk_aio._prebuilt():
        pytest.skip("this DeepSpeed has the aio op pre-built: 'auto' takes it")
    code = ("import sys, offload.disk_aio as a\n"
            f"r = a.unusable({str(tmp_path / 's')!r}, build=False)\n"
            "assert 'DS_BUILD_AIO=1' in r, r\n"
            "assert 'deepspeed' not in sys.modules, 'imported deepspeed'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
