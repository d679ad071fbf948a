"""The first-use check of attention kernels (:mod:`ulysses.self_check`), with deliberately
wrong stand-in kernels in place of ``cpu_flash``: each kind of wrongness is refused with a
``ValueError`` that names the kernel, before any collective; the verdict is cached; turned
off (by the call or by the config key) the wrong kernel runs."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dist_pool
from helpers import get_mesh, make_qkv
from ulysses import (SequenceParallelDims, kernels, local_attention, self_check, shard_sequence,
                     ulysses_attention)

GOOD_FORWARD = kernels._FORWARD["cpu_flash"]
GOOD_BACKWARD = kernels._BACKWARD["cpu_flash"]


def _scaled_out(q, k, v, causal, scale):
    out, lse = GOOD_FORWARD(q, k, v, causal, scale)
    return out * 1.05, lse


def _wrong_dk(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = GOOD_BACKWARD(dout, q, k, v, out, lse, causal, scale)
    return dq, dk.flip(1), dv


def _stale_lse_rows(dout, q, k, v, out, lse, causal, scale):
    """Right for lengths that are multiples of 32 only: past the last full block of 32 rows
    it reads another lse (as an unpadded lse read by torch's efficient backward would)."""
    full = lse.shape[-1] // 32 * 32
    stale = lse.clone()
    stale[..., full:] = stale[..., full:] - 3.0
    return GOOD_BACKWARD(dout, q, k, v, out, stale, causal, scale)


def _first_row_lse(dout, q, k, v, out, lse, causal, scale):
    """Right for batch 1 only: every batch row reads row 0's lse (an lse layout misread)."""
    return GOOD_BACKWARD(dout, q, k, v, out, lse[:1].expand_as(lse), causal, scale)


@pytest.fixture
def stand_in(monkeypatch):
    """Install a stand-in ``cpu_flash`` forward/backward; the verdicts start and end empty."""
    self_check.forget()

    def install(forward=GOOD_FORWARD, backward=GOOD_BACKWARD):
        monkeypatch.setitem(kernels._FORWARD, "cpu_flash", forward)
        monkeypatch.setitem(kernels._BACKWARD, "cpu_flash", backward)

    yield install
    self_check.forget()


def _qkv(B=1, S=64, H=4, K=2, D=16, dtype=torch.float32):
    q, k, v, _ = make_qkv(0, B, S, H, K, D, dtype)
    return q, k, v


@pytest.mark.parametrize("forward, backward, named", [
    (_scaled_out, GOOD_BACKWARD, "out"),
    (GOOD_FORWARD, _wrong_dk, "dk"),
    (GOOD_FORWARD, _stale_lse_rows, "dq"),
    (GOOD_FORWARD, _first_row_lse, "dq"),
], ids=["wrong-out", "wrong-dk", "stale-lse-past-32-rows", "batch-row-0-lse"])
def test_a_wrong_kernel_is_refused_and_named(stand_in, forward, backward, named):
    # The caller's shape (S = 64, batch 1) would never show the last two: the check's own
    # problem (length 45, batch 2) does.
    stand_in(forward, backward)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"'cpu_flash' disagrees.*{named} .*torch "
                                         rf"{re.escape(torch.__version__)}") as e:
        local_attention(q, k, v, causal=True, backend="cpu_flash")
    assert "attention_backend" in str(e.value)  # says what to do
    # The verdict is kept: the next call is refused without running the check again.
    calls = []
    stand_in(lambda *a: calls.append(1) or forward(*a), backward)
    with pytest.raises(ValueError, match="cpu_flash"):
        local_attention(q, k, v, causal=True, backend="cpu_flash")
    assert calls == []


def test_a_right_kernel_is_checked_once_per_combination(stand_in):
    calls = []

    def counting(q, k, v, causal, scale):
        calls.append((q.shape, causal))
        return GOOD_FORWARD(q, k, v, causal, scale)

    stand_in(counting)
    q, k, v = _qkv()
    local_attention(q, k, v, causal=True, backend="cpu_flash")
    local_attention(q, k, v, causal=True, backend="cpu_flash")
    checked = (torch.Size([2, self_check.CHECK_LEN, 4, 16]), True)
    assert calls == [checked, (q.shape, True), (q.shape, True)]
    # Another mask, dtype or head dim is another combination.
    calls.clear()
    local_attention(q, k, v, causal=False, backend="cpu_flash")
    local_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=False,
                    backend="cpu_flash")
    assert [c[0][1] for c in calls] == [self_check.CHECK_LEN, 64, self_check.CHECK_LEN, 64]


def test_turned_off_the_wrong_kernel_runs(stand_in):
    stand_in(_scaled_out)
    q, k, v = _qkv()
    out = local_attention(q, k, v, causal=True, backend="cpu_flash", self_check=False)
    want = local_attention(q, k, v, causal=True, backend="math")
    assert (out - want).abs().max() > 1e-2  # the wrong result went through
    with pytest.raises(ValueError, match="kernel_self_check must be True or False"):
        SequenceParallelDims(2, 2, kernel_self_check="no")


def test_the_check_leaves_the_global_rng_alone(stand_in):
    q, k, v = _qkv()
    state = torch.get_rng_state()
    local_attention(q, k, v, causal=True, backend="cpu_flash")
    assert torch.equal(torch.get_rng_state(), state)


def test_a_kernel_that_raises_is_refused_with_its_error(stand_in):
    def broken(q, k, v, causal, scale):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    stand_in(broken)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="'cpu_flash' failed its first-use check.*"
                                         "RuntimeError: CUDA error"):
        local_attention(q, k, v, causal=True, backend="cpu_flash")


def test_fake_tensors_are_not_checked(stand_in):
    """The planner traces steps on fake tensors: nothing to compare, no kernel runs."""
    stand_in(_scaled_out)
    with FakeTensorMode():
        q = torch.empty(1, 64, 4, 16)
        self_check.verify("cpu_flash", q, causal=True)
    assert self_check._verdicts == {}


def test_window_and_sinks_are_part_of_the_check(stand_in):
    # A kernel wrong only on a view that starts inside its storage (a misread pointer
    # offset): whole tensors never show it, a window's band pieces (row blocks) do.
    def wrong_at_an_offset(q, k, v, causal, scale):
        out, lse = GOOD_FORWARD(q, k, v, causal, scale)
        return (out * 1.05, lse) if q.storage_offset() else (out, lse)

    stand_in(wrong_at_an_offset)
    q, k, v = _qkv()
    self_check.verify("cpu_flash", q, causal=True)
    self_check.verify("cpu_flash", q, causal=True, sinks=True)
    with pytest.raises(ValueError, match="causal, window, on cpu"):
        self_check.verify("cpu_flash", q, causal=True, window=8)


def test_a_causal_ring_checks_the_unmasked_kernel_too(stand_in):
    def wrong_unmasked(q, k, v, causal, scale):
        out, lse = GOOD_FORWARD(q, k, v, causal, scale)
        return (out, lse) if causal else (out * 1.05, lse)

    stand_in(wrong_unmasked)
    q, k, v = _qkv()
    self_check.verify_call("cpu_flash", q, causal=True, window=None, sinks=False, ring=False)
    with pytest.raises(ValueError, match="not causal"):  # off-diagonal ring blocks
        self_check.verify_call("cpu_flash", q, causal=True, window=None, sinks=False, ring=True)


def _ranks_with_a_wrong_kernel(world, ring):
    """Every rank installs the wrong stand-in (workers persist: restored after)."""
    self_check.forget()
    kernels._FORWARD["cpu_flash"] = _scaled_out
    try:
        mesh = get_mesh(world, world // ring, ring)
        q, k, v, _ = make_qkv(1, 1, 64, 4, 2, 16, torch.float32)
        local = [shard_sequence(t, mesh, dim=1) for t in (q, k, v)]
        try:
            ulysses_attention(*local, mesh=mesh, causal=True, backend="cpu_flash")
        except ValueError as e:
            return str(e)
        return None
    finally:
        kernels._FORWARD["cpu_flash"] = GOOD_FORWARD
        self_check.forget()


@pytest.mark.parametrize("ring", [1, 2], ids=["ulysses", "ring"])
def test_every_rank_refuses_before_any_collective(ring):
    messages = dist_pool.run(_ranks_with_a_wrong_kernel, 2, ring, world_size=2, timeout=60)
    assert all(m is not None and "'cpu_flash' disagrees" in m for m in messages), messages


def test_the_check_is_not_seen_by_the_callers_modes(stand_in):
    """A FLOP counter (step_gpu's MFU) or memory tracker around the first call does not count
    the check, and a default-device context does not move its inputs."""
    from torch.utils.flop_counter import FlopCounterMode

    q = _qkv()[0]
    with FlopCounterMode(display=False) as flops, torch.device("meta"):
        self_check.verify("cpu_flash", q, causal=True)
    assert flops.get_total_flops() == 0
    assert list(self_check._verdicts.values()) == [None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
def test_the_cuda_kernels_pass_their_check(backend):
    """Each SDPA kernel this GPU admits passes at the check's odd length, with a window and
    sinks too; the cost of a first check is a few milliseconds."""
    device = torch.device("cuda")
    try:
        kernels.check_supported(backend, device, torch.bfloat16, 64)
    except ValueError as e:
        pytest.skip(str(e))
    for kw in (dict(causal=True), dict(causal=False), dict(causal=True, window=16, sinks=True)):
        result = self_check.compare_with_reference(backend, device, torch.bfloat16, 64, **kw)
        assert result["ok"], (kw, result)
        print(f"{backend} {kw}: {result['seconds'] * 1e3:.2f} ms, errors {result['errors']}")
