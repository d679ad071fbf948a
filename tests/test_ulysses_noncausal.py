"""Non-causal attention with a symmetric window (``|q - k| < window``), packed documents,
sinks and padding, on one rank and across ranks, against a float64 reference that builds the
mask explicitly (nothing of ``ulysses.band`` is used). Each case also checks that the result
without its window (or documents) differs, so a path that dropped them fails here.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh, make_qkv
from test_ulysses_documents import KIND_MASKS
from test_ulysses_window_sinks import _sinks
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses.band import WindowAttention, document_pieces, mask_pieces
from ulysses.kernels import attention_with_lse, default_scale


def reference(q, k, v, dout, *, window=None, sinks=None, starts=None, kv_len=None):
    """float64 ``(out, dq, dk, dv, dsinks)`` of non-causal attention under the given mask."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = None if sinks is None else sinks.detach().double().requires_grad_()
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    kx, vx = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * default_scale(D, None)
    i = torch.arange(S)
    mask = torch.ones(B, S, S, dtype=torch.bool)
    if window is not None:
        mask &= (i[:, None] - i[None, :]).abs() < window
    if kv_len is not None:
        mask &= i[None, None, :] < kv_len
    if starts is not None:
        for b, row in enumerate(starts):
            doc = torch.bucketize(i, torch.tensor(row[1:]), right=True)
            mask[b] &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s[None, :, None, None].expand(B, H, S, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :S]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vx)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, None if s is None else s.grad


def _close(got, want, dtype, what):
    torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"{what}: {m}")


# --- the geometry ---------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 2, 5, 16, 100])
def test_symmetric_pieces_cover_each_visible_pair_once(window):
    """A local square, every zigzag and contiguous ring step of R = 3, and documents across
    them: each pair with ``|q - k| < window`` (in one document) computed once, no other."""
    R, c = 3, 5
    cases = [([(0, S, 0)], [(0, S, 0)]) for S in (1, 7, 33)]
    for r in range(R):
        for o in range(R):
            cases.append(([(r * c, c, 0), ((2 * R - 1 - r) * c, c, c)],
                          [(o * c, c, 0), ((2 * R - 1 - o) * c, c, c)]))
            cases.append(([(r * 2 * c, 2 * c, 0)], [(o * 2 * c, 2 * c, 0)]))
    starts = (0, 4, 5, 13, 22)
    for qs, ks in cases:
        Lq, Lk = sum(n for _, n, _ in qs), sum(n for _, n, _ in ks)
        for docs in (None, starts):
            want = torch.zeros(Lq, Lk, dtype=torch.int)
            for qg, qn, ql in qs:
                for kg, kn, kl in ks:
                    qi, ki = torch.arange(qg, qg + qn)[:, None], torch.arange(kg, kg + kn)[None]
                    vis = (qi - ki).abs() < window
                    if docs is not None:
                        edges = torch.tensor(docs[1:])
                        vis &= torch.bucketize(qi, edges, right=True) == \
                            torch.bucketize(ki, edges, right=True)
                    want[ql:ql + qn, kl:kl + kn] = vis.int()
            pieces = (mask_pieces(qs, ks, causal=False, window=window) if docs is None else
                      document_pieces(qs, ks, docs, 64, causal=False, window=window))
            got = torch.zeros(Lq, Lk, dtype=torch.int)
            for p in pieces:
                assert p.kind == "full" or p.q1 - p.q0 == p.k1 - p.k0, p
                got[p.q0:p.q1, p.k0:p.k1] += KIND_MASKS[p.kind](p.q1 - p.q0, p.k1 - p.k0)
            assert torch.equal(got, want), (qs, ks, docs)


# --- one rank -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("S,window,kv_len", [(61, 1, None), (64, 2, None), (61, 7, None),
                                             (64, 16, 50), (50, 200, None), (45, 9, 40)])
def test_symmetric_window_one_rank(S, window, kv_len, dtype):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    q, k, v, dout = make_qkv(2, 2, S, 4, 2, 16, dt)
    sinks = _sinks(4).to(dt)
    for s in (None, sinks):
        want = reference(q, k, v, dout, window=window, sinks=s, kv_len=kv_len)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s_leaf = None if s is None else s.clone().requires_grad_()
        attn = WindowAttention(window=window, scale=default_scale(16, None), backend="cpu_flash",
                               causal=False, kv_len=kv_len)
        out, _ = attention_with_lse(*leaves, attn, s_leaf)
        out.backward(dout)
        _close(out, want[0], dt, "out")
        for name, leaf, g in zip(("dq", "dk", "dv"), leaves, want[1:4]):
            _close(leaf.grad, g, dt, name)
        if s is not None:
            _close(s_leaf.grad, want[4], dt, "dsinks")
    if window < S:
        assert (reference(q, k, v, dout, kv_len=kv_len)[0] - want[0]).abs().max() > 1e-2


# --- across ranks ---------------------------------------------------------------------------

# (world, ulysses, ring, zigzag, heads, kv heads, head chunk, window, sinks, documents, pad)
CASES = {
    "u2_window": (2, 2, 1, True, 4, 2, None, 16, False, None, False),
    "u4_chunked_window_sinks": (4, 4, 1, True, 8, 2, 1, 37, True, None, False),
    "u2r2_zigzag_chunked_window_sinks": (4, 2, 2, True, 4, 2, 1, 21, True, None, False),
    "r2_contiguous_documents_window": (2, 1, 2, False, 2, 2, None, 12, False,
                                       ((0, 50, 97), (0, 30)), False),
    "u2_documents_sinks": (2, 2, 1, True, 4, 4, 2, None, True, ((0, 50, 97), (0, 30)), False),
    "r2_zigzag_documents": (2, 1, 2, True, 2, 1, None, None, False,
                            ((0, 20, 45, 97), (0, 64, 70)), False),
    "u2_padded_window": (2, 2, 1, True, 4, 2, 1, 11, False, None, True),
    "r2_zigzag_padded_window": (2, 1, 2, True, 2, 1, None, 30, False, None, True),
    "u2_seq_chunk_documents_window": (2, 2, 1, True, 4, 2, 1, 9, True,
                                      ((0, 20, 45, 97), (0, 64)), False),
    "u2r2_seq_chunk_window": (4, 2, 2, True, 4, 2, 1, 25, False, None, False),
}
SEQ_CHUNK = {"u2_seq_chunk_documents_window": 3, "u2r2_seq_chunk_window": 2}
SLOW = {"u4_chunked_window_sinks", "r2_zigzag_documents", "u2r2_seq_chunk_window"}
S, PADDED = 128, 121


def _rank_case(name):
    world, U, R, zigzag, H, K, chunk, window, with_sinks, starts, pad = CASES[name]
    mesh = get_mesh(world, U, R, zigzag)
    n = PADDED if pad else S
    q, k, v, dout = make_qkv(4, 2, n, H, K, 8, torch.float32)
    sinks = _sinks(H).requires_grad_() if with_sinks else None
    local = [shard_sequence(t, mesh, dim=1, pad=pad).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*local, mesh=mesh, causal=False, head_chunk_size=chunk,
                            window=window, sinks=sinks, segments=starts,
                            unpadded_len=n if pad else None, seq_chunk=SEQ_CHUNK.get(name))
    out.backward(shard_sequence(dout, mesh, dim=1, pad=pad))
    full = [gather_sequence(t, mesh, dim=1, unpadded_len=n if pad else None)
            for t in (out.detach(), *(x.grad for x in local))]
    return full, None if sinks is None else sinks.grad


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_non_causal_across_ranks(name):
    world, U, R, zigzag, H, K, chunk, window, with_sinks, starts, pad = CASES[name]
    q, k, v, dout = make_qkv(4, 2, PADDED if pad else S, H, K, 8, torch.float32)
    sinks = _sinks(H) if with_sinks else None
    want = reference(q, k, v, dout, window=window, sinks=sinks, starts=starts)
    results = dist_pool.run(_rank_case, name, world_size=world)
    for full, _ in results:
        for what, got, ref in zip(("out", "dq", "dk", "dv"), full, want):
            _close(got, ref, torch.float32, f"{name} {what}")
    if with_sinks:
        dsinks = torch.stack([d for _, d in results]).sum(0)
        _close(dsinks, want[4], torch.float32, f"{name} dsinks")
    plain = reference(q, k, v, dout, sinks=sinks)
    assert (plain[0] - want[0]).abs().max() > 1e-2
