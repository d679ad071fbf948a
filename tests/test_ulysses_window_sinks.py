"""Sliding windows and attention sinks, against a float64 reference with an explicit mask.

The reference builds the full ``[S, S]`` score matrix, masks it (causal, window, documents),
appends the sink column, and lets autograd differentiate it: nothing of ``ulysses.band`` or
``ulysses.sinks`` is used. Each case also checks that the result *without* the feature
differs, so a path that dropped the window or the sinks would fail here.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh, make_qkv
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses.band import WindowAttention, band_pieces
from ulysses.kernels import attention_with_lse, default_scale


def reference(q, k, v, dout, *, window=None, sinks=None, starts=None, causal=True,
              kv_len=None):
    """float64 ``(out, dq, dk, dv, dsinks)`` of attention with the given mask: causal or not,
    a window (``|q - k| < window``: behind a causal mask the keys before the query), packed
    documents, sinks, and keys from ``kv_len`` on masked as padding."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = None if sinks is None else sinks.detach().double().requires_grad_()
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    kx, vx = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * default_scale(D, None)
    i = torch.arange(S)
    mask = torch.ones(B, S, S, dtype=torch.bool)                             # [B, q, k]
    if causal:
        mask &= i[None, :] <= i[:, None]
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


def _sinks(H, seed=7):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2


# --- the geometry ---------------------------------------------------------------------------

def _mask_of(pieces, Lq, Lk):
    m = torch.zeros(Lq, Lk, dtype=torch.int)
    for p in pieces:
        n, w = p.q1 - p.q0, p.k1 - p.k0
        tri = {"full": torch.ones(n, w, dtype=torch.int),
               "causal": torch.ones(n, w, dtype=torch.int).tril(),
               "anticausal": torch.ones(n, w, dtype=torch.int).triu()}[p.kind]
        assert p.kind == "full" or n == w, p
        m[p.q0:p.q1, p.k0:p.k1] += tri
    return m


@pytest.mark.parametrize("window", [None, 1, 2, 5, 16, 100])
def test_band_pieces_cover_each_visible_pair_once(window):
    """Every (query, key) pair is computed once if visible and never otherwise, for a local
    square and for every zigzag and contiguous ring step of R = 3."""
    cases = [([(0, S, 0)], [(0, S, 0)]) for S in (1, 7, 33)]
    R, c = 3, 5
    for r in range(R):
        for o in range(R):
            cases.append(([(r * c, c, 0), ((2 * R - 1 - r) * c, c, c)],
                          [(o * c, c, 0), ((2 * R - 1 - o) * c, c, c)]))
            cases.append(([(r * 2 * c, 2 * c, 0)], [(o * 2 * c, 2 * c, 0)]))
    for qs, ks in cases:
        Lq, Lk = sum(n for _, n, _ in qs), sum(n for _, n, _ in ks)
        want = torch.zeros(Lq, Lk, dtype=torch.int)
        for qg, qn, ql in qs:
            for kg, kn, kl in ks:
                qi = torch.arange(qg, qg + qn)[:, None]
                ki = torch.arange(kg, kg + kn)[None, :]
                vis = ki <= qi
                if window is not None:
                    vis &= qi - ki < window
                want[ql:ql + qn, kl:kl + kn] = vis.int()
        assert torch.equal(_mask_of(band_pieces(qs, ks, window), Lq, Lk), want), (qs, ks)


def test_window_costs_about_window_keys_per_query():
    """At S = 4096 and window 128 the pieces cover about 128 keys per query, not S / 2."""
    pieces = [p for a in range(0, 4096, 127)
              for p in band_pieces([(a, min(127, 4096 - a), a)], [(0, 4096, 0)], 128)]
    area = sum((p.q1 - p.q0) * (p.k1 - p.k0) for p in pieces)
    assert area / 4096 < 2 * 128


# --- one rank -------------------------------------------------------------------------------

def one_rank_case(S: int, window: int, dtype: str, *, seed: int, causal: bool = True,
                  kv_len: int | None = None) -> None:
    """``WindowAttention`` on one rank, with and without sinks, against the reference; and the
    window must change the result (so the check can fail)."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    q, k, v, dout = make_qkv(seed, 2, S, 4, 2, 16, dt)
    sinks = _sinks(4).to(dt)
    for s in (None, sinks):
        want = reference(q, k, v, dout, window=window, sinks=s, causal=causal, kv_len=kv_len)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s_leaf = None if s is None else s.clone().requires_grad_()
        attn = WindowAttention(window=window, scale=default_scale(16, None), backend="cpu_flash",
                               causal=causal, kv_len=kv_len)
        out, _ = attention_with_lse(*leaves, attn, s_leaf)
        out.backward(dout)
        _close(out, want[0], dt, "out")
        for name, leaf, g in zip(("dq", "dk", "dv"), leaves, want[1:4]):
            _close(leaf.grad, g, dt, name)
        if s is not None:
            _close(s_leaf.grad, want[4], dt, "dsinks")
    if window < S:
        plain = reference(q, k, v, dout, causal=causal, kv_len=kv_len)
        assert (plain[0] - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("S,window", [(64, 1), (64, 2), (61, 7), (64, 16), (64, 64), (50, 200)])
def test_window_attention_one_rank(S, window, dtype):
    one_rank_case(S, window, dtype, seed=0)


# --- across ranks ---------------------------------------------------------------------------

# (world, ulysses, ring, zigzag, heads, kv heads, chunk, window, sinks, documents)
CASES = {
    "u2_window": (2, 2, 1, True, 4, 2, None, 16, False, None),
    "u4_chunked_window_sinks": (4, 4, 1, True, 8, 2, 1, 37, True, None),
    "u4_replicated_kv_chunked": (4, 4, 1, True, 4, 2, 1, 9, True, None),
    "u2r2_zigzag_chunked_window_sinks": (4, 2, 2, True, 4, 2, 1, 21, True, None),
    "r4_zigzag_window": (4, 1, 4, True, 2, 1, None, 13, False, None),
    "r2_contiguous_window_sinks": (2, 1, 2, False, 2, 2, None, 40, True, None),
    "u2_documents_window_sinks": (2, 2, 1, True, 4, 4, 2, 11, True, ((0, 50, 97), (0, 30))),
    "u4_seq_chunk_window_sinks": (4, 4, 1, True, 8, 2, 1, 37, True, None),
    "u2r2_zigzag_seq_chunk_window_sinks": (4, 2, 2, True, 4, 2, 1, 21, True, None),
}
SEQ_CHUNK = {"u4_seq_chunk_window_sinks": 3, "u2r2_zigzag_seq_chunk_window_sinks": 2}
"""Cases run by the sequence-chunked loop (:mod:`ulysses.seq_chunk`), blocks per piece."""
S = 128


def run_case(case, *, seed: int, length: int, seq_chunk=None, causal=True, pad=False):
    """On each rank: ``ulysses_attention`` forward and backward of ``case`` (a ``CASES``
    tuple) on this rank's shards of ``length`` tokens; returns the gathered out, dq, dk, dv
    and this rank's dsinks."""
    world, U, R, zigzag, H, K, chunk, window, with_sinks, starts = case
    mesh = get_mesh(world, U, R, zigzag)
    # a per-document mesh cuts by the documents (gathers too)
    cut = {"segments": starts} if zigzag == "per_document" and starts is not None else {}
    q, k, v, dout = make_qkv(seed, 2, length, H, K, 8, torch.float32)
    sinks = _sinks(H).requires_grad_() if with_sinks else None
    local = [shard_sequence(t, mesh, dim=1, pad=pad, **cut).requires_grad_()
             for t in (q, k, v)]
    out = ulysses_attention(*local, mesh=mesh, causal=causal, head_chunk_size=chunk,
                            window=window, sinks=sinks, segments=starts,
                            unpadded_len=length if pad else None, seq_chunk=seq_chunk)
    out.backward(shard_sequence(dout, mesh, dim=1, pad=pad, **cut))
    full = [gather_sequence(t, mesh, dim=1, unpadded_len=length if pad else None, **cut)
            for t in (out.detach(), *(x.grad for x in local))]
    return full, None if sinks is None else sinks.grad


def check_case(name, case, *, seed: int, length: int = S, **run) -> tuple:
    """Run ``case`` across its ranks and compare with the float64 reference (the sinks'
    gradient summed over the ranks, each holding its heads' share); returns the reference's
    inputs and result for the caller's checks that the features matter."""
    world, U, R, zigzag, H, K, chunk, window, with_sinks, starts = case
    q, k, v, dout = make_qkv(seed, 2, length, H, K, 8, torch.float32)
    sinks = _sinks(H) if with_sinks else None
    want = reference(q, k, v, dout, window=window, sinks=sinks, starts=starts,
                     causal=run.get("causal", True))
    results = dist_pool.run(run_case, case, seed=seed, length=length, **run, world_size=world)
    for full, _ in results:
        for what, got, ref in zip(("out", "dq", "dk", "dv"), full, want):
            _close(got, ref, torch.float32, f"{name} {what}")
    if with_sinks:
        dsinks = torch.stack([d for _, d in results]).sum(0)
        _close(dsinks, want[4], torch.float32, f"{name} dsinks")
    return (q, k, v, dout, sinks), want


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "u2r2_zigzag_seq_chunk_window_sinks" else n
                                  for n in CASES])
def test_window_and_sinks_across_ranks(name):
    window, starts = CASES[name][7], CASES[name][9]
    (q, k, v, dout, sinks), want = check_case(name, CASES[name], seed=1,
                                              seq_chunk=SEQ_CHUNK.get(name))
    if sinks is not None:
        no_sinks = reference(q, k, v, dout, window=window, starts=starts)
        assert (no_sinks[0] - want[0]).abs().max() > 1e-2
    no_window = reference(q, k, v, dout, sinks=sinks, starts=starts)
    assert (no_window[0] - want[0]).abs().max() > 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU CI has none)")
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient"])
def test_window_and_sinks_on_cuda(backend):
    """The band pieces and sinks on the CUDA kernels (bf16), against the fp64 reference."""
    q, k, v, dout = make_qkv(3, 2, 300, 8, 2, 64, torch.bfloat16)
    sinks = _sinks(8).to(torch.bfloat16)
    want = reference(q, k, v, dout, window=37, sinks=sinks)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    s_leaf = sinks.cuda().requires_grad_()
    attn = WindowAttention(window=37, scale=default_scale(64, None), backend=backend)
    out, _ = attention_with_lse(*leaves, attn, s_leaf)
    out.backward(dout.cuda())
    for what, got, ref in zip(("out", "dq", "dk", "dv", "dsinks"),
                              (out, *(x.grad for x in leaves), s_leaf.grad), want):
        _close(got.cpu(), ref, torch.bfloat16, what)
