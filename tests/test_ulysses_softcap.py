"""Attention logit softcapping: the blockwise kernel (:mod:`ulysses.softcap`) and the float64
reference against autograd through the formula itself, at odd lengths, GQA, two batch rows,
causal and not, across several query and key blocks."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh, make_qkv
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses import softcap as blockwise
from ulysses.kernels import attention_backward, attention_forward, default_scale

CAP = 2.0  # small against the scores' spread, so the cap changes the result


def _autograd(q, k, v, dout, causal, cap, window=None):
    """``(out, dq, dk, dv)`` in float64 by autograd through ``cap * tanh(z / cap)`` (and a
    causal sliding ``window``)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    H, K, D = q.shape[2], k.shape[2], q.shape[3]
    kx, vx = k.repeat_interleave(H // K, 2), v.repeat_interleave(H // K, 2)
    z = torch.einsum("bqhd,bkhd->bhqk", q, kx) * default_scale(D, None)
    z = cap * torch.tanh(z / cap) if cap else z
    if causal:
        S = q.shape[1]
        i = torch.arange(S)
        hidden = (i[None, :] > i[:, None]) | (
            (i[:, None] - i[None, :] >= window) if window else torch.zeros(S, S, dtype=torch.bool))
        z = z.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(z, -1), vx)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("S", [45, 301])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("backend,dtype", [("cpu_flash", torch.float32),
                                           ("cpu_flash", torch.bfloat16),
                                           ("math", torch.float64)])
def test_softcap_matches_autograd(monkeypatch, S, causal, backend, dtype):
    # small blocks: several query and key blocks, with causal skipping, at these lengths
    monkeypatch.setattr(blockwise, "Q_BLOCK", 32)
    monkeypatch.setattr(blockwise, "K_BLOCK", 64)
    q, k, v, dout = make_qkv(3, 2, S, 4, 2, 16, dtype)
    q = q * 3  # scores well past the cap
    scale = default_scale(16, None)
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend,
                                 softcap=CAP)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                               backend=backend, softcap=CAP)
    want = _autograd(q, k, v, dout, causal, CAP)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        torch.testing.assert_close(got.double(), ref, **TOL[dtype],
                                   msg=lambda m: f"{name}: {m}")
    uncapped = _autograd(q, k, v, dout, causal, 0.0)
    assert (uncapped[0] - want[0]).abs().max() > 0.1  # the cap changes the result


def _traced_peak(shortcuts: bool, causal: bool) -> tuple[int, int]:
    """Peak bytes (MemTracker) and block iterations of the blockwise kernel's forward and
    backward traced on fake tensors, as the memory planner traces, with or without its
    shortcuts."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from ulysses.torch_internals import step_mem_tracker

    from ulysses.trace_shortcuts import memory_trace

    calls, scores = [0], blockwise._scores

    def counting(*args, **kwargs):
        calls[0] += 1
        return scores(*args, **kwargs)

    blockwise._scores = counting
    try:
        with FakeTensorMode(), memory_trace() if shortcuts else contextlib.nullcontext():
            q, k, v, dout = make_qkv(0, 1, 300, 4, 2, 16, torch.float32)
            tracker = step_mem_tracker()
            tracker.track_external(q, k, v, dout)
            with tracker:
                out, lse = blockwise.softcap_forward(q, k, v, causal, 0.25, 5.0)
                blockwise.softcap_backward(dout, q, k, v, out, lse, causal, 0.25, 5.0)
            peak = tracker.get_tracker_snapshot("peak")[q.device]["Total"]
    finally:
        blockwise._scores = scores
    return peak, calls[0]


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["causal", "full"])  # full: 17 s, the same shortcuts
def test_memory_trace_shortcuts_keep_the_peak(monkeypatch, causal):
    """In the planner's trace the kernel runs only block iterations whose shapes differ from
    the two before (without it a 1M-token trace would run millions of blocks): the same peak,
    byte for byte, with fewer iterations."""
    monkeypatch.setattr(blockwise, "Q_BLOCK", 16)
    monkeypatch.setattr(blockwise, "K_BLOCK", 48)
    full, cut = _traced_peak(False, causal), _traced_peak(True, causal)
    assert full[0] == cut[0] and cut[1] < full[1] / 3, (full, cut)


def test_softcap_lse_is_the_capped_log_sum_exp():
    q, k, v, _ = make_qkv(4, 1, 45, 2, 1, 8, torch.float32)
    _, lse = blockwise.softcap_forward(q, k, v, True, 0.5, CAP)
    z = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().expand(-1, -1, 2, -1)) * 0.5
    z = (CAP * torch.tanh(z / CAP)).masked_fill(torch.ones(45, 45, dtype=torch.bool).triu(1),
                                               float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=1e-5, rtol=1e-5)


# name -> (world, ulysses, ring, head chunk, seq_chunk, window)
SP_CASES = {
    "u2": (2, 2, 1, None, None, None),
    "u2_chunks_seq_chunk_window": (2, 2, 1, 1, 3, 7),
    "u2r2_chunks_window": (4, 2, 2, 1, None, 9),
}
SP_S = 64


def _rank_sp(name):
    world, U, R, chunk, seq_chunk, window = SP_CASES[name]
    mesh = get_mesh(world, U, R)
    q, k, v, dout = make_qkv(5, 2, SP_S, 4, 2, 16, torch.float32)
    local = [shard_sequence(t, mesh, dim=1).requires_grad_() for t in (q * 3, k, v)]
    out = ulysses_attention(*local, mesh=mesh, causal=True, head_chunk_size=chunk,
                            seq_chunk=seq_chunk, window=window, softcap=CAP)
    out.backward(shard_sequence(dout, mesh, dim=1))
    return [gather_sequence(t, mesh, dim=1) for t in (out.detach(), *(x.grad for x in local))]


@pytest.mark.parametrize("name", list(SP_CASES))
def test_softcap_across_ranks(name):
    """Ulysses, head chunks with sequence chunks and a window, a zigzag ring with a window:
    each equals the float64 reference, for every rank's gathered result."""
    world, _, _, _, _, window = SP_CASES[name]
    q, k, v, dout = make_qkv(5, 2, SP_S, 4, 2, 16, torch.float32)
    want = _autograd(q * 3, k, v, dout, True, CAP, window)  # gradients with respect to 3q
    for full in dist_pool.run(_rank_sp, name, world_size=world):
        for what, got, ref in zip(("out", "dq", "dk", "dv"), full, want):
            torch.testing.assert_close(got.double(), ref, **TOL[torch.float32],
                                       msg=lambda m: f"{name} {what}: {m}")
