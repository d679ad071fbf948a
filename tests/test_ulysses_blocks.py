"""Blocks seen whole by their own queries inside a causal attention (:mod:`ulysses.blocks`,
Gemma3's images): one rank and Ulysses SP=2 against a float64 masked reference, with packed
documents, a sliding window, GQA, two batch rows, head chunking and bf16; refusals."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh, make_qkv, value_error_of
from test_ulysses_window_sinks import reference
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses.blocks import BlockAttention, check_blocks
from ulysses.kernels import LocalAttention, attention_with_lse, default_scale

S, H, K, D = 32, 4, 2, 8
BLOCKS = (((3, 9), (12, 13), (20, 28)), ((14, 19),))  # row 1's block crosses 16 (SP=2's cut)


def block_reference(q, k, v, dout, blocks, **kw):
    """float64 ``(out, dq, dk, dv)``: the causal mask OR'ed with "same block", then the
    window and the documents AND'ed, as transformers builds Gemma3's masks."""
    n = q.shape[1]
    i = torch.arange(n)
    extra = torch.zeros(q.shape[0], n, n, dtype=torch.bool)
    for b, row in enumerate(blocks):
        for a, e in row:
            inside = (i >= a) & (i < e)
            extra[b] |= inside[:, None] & inside[None, :] & (i[None, :] > i[:, None])
    # reference() builds causal & window & documents; a key after its query is visible only
    # through a block, and the window (|q - k| < w) never hides one inside a block this short
    return _masked(q, k, v, dout, extra, **kw)


def _masked(q, k, v, dout, extra, *, window=None, starts=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    B, n = q.shape[:2]
    kx, vx = (t.repeat_interleave(q.shape[2] // k.shape[2], 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * default_scale(q.shape[-1], None)
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]).expand(B, n, n).clone() | extra
    if window is not None:
        mask &= (i[:, None] - i[None, :]) < window
    if starts is not None:
        for b, row in enumerate(starts):
            doc = torch.bucketize(i, torch.tensor(row[1:]), right=True)
            mask[b] &= doc[:, None] == doc[None, :]
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vx)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _close(got, want, dtype, what):
    torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"{what}: {m}")


def test_no_blocks_is_the_causal_reference():
    q, k, v, dout = make_qkv(0, 2, S, H, K, D, torch.float64)
    want = reference(q, k, v, dout)[:4]
    got = block_reference(q, k, v, dout, ((), ()))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_one_rank(dtype):
    q, k, v, dout = make_qkv(1, 2, S, H, K, D, dtype)
    attn = BlockAttention(LocalAttention(causal=True, scale=default_scale(D, None),
                                         backend="cpu_flash"), BLOCKS,
                          default_scale(D, None), "cpu_flash")
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = attention_with_lse(qs, ks, vs, attn, None)
    out.backward(dout)
    want = block_reference(q, k, v, dout, BLOCKS)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, qs.grad, ks.grad, vs.grad), want):
        _close(g, w, dtype, name)
    # the blocks change the result: plain causal attention fails the check
    causal = reference(q, k, v, dout)[0]
    assert (causal - want[0]).abs().max() > 0.5


def run_case(case: str, seed: int):
    sp = 2
    mesh = get_mesh(sp, sp)
    q, k, v, dout = make_qkv(seed, 2, S, H, K, D, torch.float32)
    kw, call = {}, {}
    if case == "documents":
        kw["starts"] = call["segments"] = ((0, 10, 20), (0, 12))
    if case == "window":
        kw["window"] = call["window"] = 6
    if case == "head-chunks":
        call["head_chunk_size"] = 1
    qs, ks, vs = (shard_sequence(t, mesh).detach().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qs, ks, vs, mesh=mesh, causal=True, blocks=BLOCKS, **call)
    out.backward(shard_sequence(dout, mesh))
    got = [gather_sequence(t.detach(), mesh) for t in (out, qs.grad, ks.grad, vs.grad)]
    return got, block_reference(q, k, v, dout, BLOCKS, **kw)


@pytest.mark.parametrize("case", ["plain", "documents", "window", "head-chunks"])
def test_ulysses_blocks_match_reference(case):
    for got, want in dist_pool.run(run_case, case, seed=3, world_size=2):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            _close(g, w, torch.float32, f"{case} {name}")


def _rank_refusals():
    got = {}
    q, k, v, _ = make_qkv(0, 2, S, H, K, D, torch.float32)
    for name, mesh, kw in (
            ("ring", get_mesh(2, 1, 2), {}),
            ("not-causal", get_mesh(2, 2), {"causal": False}),
            ("seq-chunk", get_mesh(2, 2), {"head_chunk_size": 1, "seq_chunk": 2}),
            ("crosses-document", get_mesh(2, 2), {"segments": ((0, 6), (0,))})):
        args = {"causal": True, **kw}
        qs, ks, vs = (shard_sequence(t, mesh) for t in (q, k, v))
        got[name] = value_error_of(lambda: ulysses_attention(qs, ks, vs, mesh=mesh,
                                                             blocks=BLOCKS, **args))
    return got


def test_block_refusals():
    got = dist_pool.run(_rank_refusals, world_size=2)[0]
    assert "ring" in got["ring"]
    assert "non-causal" in got["not-causal"]
    assert "seq_chunk" in got["seq-chunk"]
    assert "document" in got["crosses-document"]
    for bad in ([((5, 3),), ()], [((0, 4), (2, 6)), ()], [((0, 40),), ()], [()]):
        with pytest.raises(ValueError):
            check_blocks(bad, 2, S)
