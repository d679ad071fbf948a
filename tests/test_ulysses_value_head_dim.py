"""A value head dim of its own (multi-head latent attention: DeepSeek-V2/V3, Kimi), through
every path: the local kernel, plain Ulysses, head chunks, packed documents and Ulysses x Ring.
Each output and gradient equals float64 single-device attention computed without any padding
(an explicit softmax(q k^T) v with v at its own width).
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh
from ulysses import local_attention, shard_sequence, ulysses_attention

B, S, H, K = 2, 32, 4, 4
DOCS = (0, 11, 24)


def _tensors(seed: int, d_qk: int, d_v: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, d_qk, generator=g)
    k = torch.randn(B, S, K, d_qk, generator=g)
    v = torch.randn(B, S, K, d_v, generator=g)
    dout = torch.randn(B, S, H, d_v, generator=g)
    return q, k, v, dout


def _reference(q, k, v, dout, *, segments=None, scale=None):
    """fp64 causal attention by its definition, v at its own head dim; documents start at
    ``segments`` (the same for every row)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    pos = torch.arange(S)
    mask = pos[:, None] >= pos[None, :]
    if segments is not None:
        doc = torch.bucketize(pos, torch.tensor(segments[1:]), right=True)
        mask &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("d_qk,d_v", [(24, 16), (16, 24)], ids=["v_narrower", "v_wider"])
def test_local_attention(d_qk, d_v):
    q, k, v, dout = _tensors(0, d_qk, d_v)
    ref = _reference(q, k, v, dout, scale=0.3)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = local_attention(q, k, v, causal=True, softmax_scale=0.3)
    assert out.shape == (B, S, H, d_v)
    out.backward(dout)
    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


def _rank(ulysses, ring, d_qk, d_v, chunk, documents):
    mesh = get_mesh(ulysses * ring, ulysses, ring)
    segments = [DOCS] * B if documents else None
    q, k, v, dout = _tensors(1, d_qk, d_v)
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=chunk,
                            segments=segments)
    out.backward(shard_sequence(dout, mesh))
    positions = shard_sequence(torch.arange(S)[None], mesh)[0]
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("ulysses,ring,chunk,documents,d_v", [
    (2, 1, None, False, 16), (2, 1, None, True, 16), (4, 1, 1, True, 16), (2, 1, None, False, 32),
    (2, 2, None, True, 16), (2, 2, 1, False, 16)],
    ids=["u2", "u2_docs", "u4_chunk1_docs", "u2_v_wider", "u2r2_docs", "u2r2_chunk1"])
def test_ulysses_attention(ulysses, ring, chunk, documents, d_v):
    d_qk = 24
    q, k, v, dout = _tensors(1, d_qk, d_v)
    ref = _reference(q, k, v, dout, segments=DOCS if documents else None)
    for positions, *got in dist_pool.run(_rank, ulysses, ring, d_qk, d_v, chunk, documents,
                                         world_size=ulysses * ring):
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
            assert g.shape[-1] == want.shape[-1], name
            torch.testing.assert_close(g.double(), want[:, positions], **TOL[torch.float32],
                                       msg=lambda m: f"{name}: {m}")


def test_mismatched_value_heads_refused():
    q, k, v, _ = _tensors(0, 16, 16)
    with pytest.raises(ValueError, match="batch, sequence and heads"):
        local_attention(q, k, v[:, :, :2], causal=True)
