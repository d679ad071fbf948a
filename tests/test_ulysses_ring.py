"""Ring and hybrid Ulysses x Ring attention against single-device float64 attention.

Every rank shards the full tensors with the public ``shard_sequence`` (zigzag by default) and
also shards ``arange(S)``, which says which global positions its rows are; its output and
gradient rows are compared with the reference's rows at those positions.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import DTYPES, TOL, get_mesh, make_qkv, reference
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses.ring import RingAttention, _block, _valid_keys

D = 16


def _rank_hybrid(ulysses, ring, H, K, B, S, causal, dtype_name, seed, chunk=None, zigzag=True,
                 pad=False):
    """On each rank: shard, run ulysses_attention fwd+bwd on a (dp=1, R, U) mesh."""
    mesh = get_mesh(ulysses * ring, ulysses, ring, zigzag)
    shard = lambda t, value=0: shard_sequence(t, mesh, pad=pad, pad_value=value)  # noqa: E731
    q, k, v, dout = make_qkv(seed, B, S, H, K, D, DTYPES[dtype_name])
    q, k, v = (shard(t).clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(q, k, v, mesh=mesh, causal=causal, head_chunk_size=chunk,
                            unpadded_len=S if pad else None)
    out.backward(shard(dout))
    positions = shard(torch.arange(S)[None], value=S)[0]  # padded rows: position S (dropped)
    return dict(positions=positions, out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                gathered=gather_sequence(out.detach(), mesh, unpadded_len=S))


def _errors(results, H, K, B, S, causal, dtype_name, seed) -> dict[str, float]:
    """Max abs error of every rank's rows against the fp64 reference, per tensor; also
    checks each rank got distinct positions covering the whole sequence."""
    dtype = DTYPES[dtype_name]
    ref = dict(zip(("out", "dq", "dk", "dv"),
                   reference(*make_qkv(seed, B, S, H, K, D, dtype), causal=causal)))
    seen = torch.cat([r["positions"] for r in results])
    assert sorted(seen[seen < S].tolist()) == list(range(S)), "shards must cover S exactly once"
    errors = dict.fromkeys(ref, 0.0)
    for res in results:
        keep = res["positions"] < S
        idx = res["positions"][keep]
        for name in ref:
            got, want = res[name][:, keep].double(), ref[name][:, idx]
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{name}: {m}")
            errors[name] = max(errors[name], (got - want).abs().max().item())
        torch.testing.assert_close(res["gathered"].double(), ref["out"], **TOL[dtype])
    return errors


CASES = [(1, 2), (1, 4), (2, 2), (4, 2)]  # (U, R); (4, 2) is 8 ranks


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("ulysses,ring", [
    pytest.param(u, r, marks=pytest.mark.slow) if u * r == 8 else (u, r) for u, r in CASES
], ids=[f"u{u}r{r}" for u, r in CASES])  # 8 ranks (20 s) in the slow set; u2r2 is hybrid too
def test_matches_reference(ulysses, ring, causal):
    """GQA Hq=8, Hkv=2 (U=4 replicates kv), B=2, fp32, zigzag."""
    args = dict(H=8, K=2, B=2, S=32, causal=causal, dtype_name="fp32", seed=ulysses * 10 + ring)
    results = dist_pool.run(_rank_hybrid, ulysses, ring, **args, world_size=ulysses * ring)
    _errors(results, **args)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_chunked_hybrid(causal):
    """(U, R) = (2, 2) with head_chunk_size=1: each head chunk is a2a'd, ring-attended, a2a'd
    back."""
    args = dict(H=8, K=2, B=2, S=32, causal=causal, dtype_name="fp32", seed=5)
    results = dist_pool.run(_rank_hybrid, 2, 2, **args, chunk=1, world_size=4)
    _errors(results, **args)


@pytest.mark.parametrize("ulysses,ring", [(1, 4), (2, 2)], ids=["u1r4", "u2r2"])
def test_contiguous_layout(ulysses, ring):
    """zigzag=False: blocks in rank order; causal skips the blocks of later ranks."""
    args = dict(H=8, K=2, B=2, S=32, causal=True, dtype_name="fp32", seed=11)
    results = dist_pool.run(_rank_hybrid, ulysses, ring, **args, zigzag=False, world_size=4)
    _errors(results, **args)


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("ulysses,ring,S", [(1, 4, 29), (2, 2, 21), (1, 2, 5)],
                         ids=["u1r4-S29", "u2r2-S21", "u1r2-S5"])
def test_padding(ulysses, ring, S, causal, zigzag):
    """Lengths that do not divide: pad=True, and unpadded_len masks the padded keys (a block
    may be partly or wholly padding; S=5 on R=2 leaves a whole chunk of padding)."""
    args = dict(H=4, K=2, B=1, S=S, causal=causal, dtype_name="fp32", seed=S)
    results = dist_pool.run(_rank_hybrid, ulysses, ring, **args, zigzag=zigzag, pad=True,
                            world_size=ulysses * ring)
    _errors(results, **args)


def test_bf16_hybrid():
    args = dict(H=8, K=2, B=2, S=64, causal=True, dtype_name="bf16", seed=2)
    _errors(dist_pool.run(_rank_hybrid, 2, 2, **args, world_size=4), **args)


def test_mqa_and_uneven_heads_hybrid():
    """Hq=6, Hkv=1 on (U, R) = (2, 2): kv replicated within the Ulysses group, uneven
    nowhere; and Hq=6, Hkv=3 on U=2: 2 and 1 kv heads per rank."""
    for H, K in ((6, 1), (6, 3)):
        args = dict(H=H, K=K, B=2, S=32, causal=True, dtype_name="fp32", seed=H + K)
        _errors(dist_pool.run(_rank_hybrid, 2, 2, **args, world_size=4), **args)


def test_error_does_not_grow_with_ring_size():
    """fp32: the max error at R=4 stays below 2x the error at R=1 (the same sequence, U=1).
    ring-flash-attention users report error growing with the ring (its issues #42, #67)."""
    args = dict(H=4, K=2, B=1, S=512, causal=True, dtype_name="fp32", seed=0)
    base = _errors(dist_pool.run(_rank_hybrid, 1, 1, **args, world_size=1), **args)
    ring4 = _errors(dist_pool.run(_rank_hybrid, 1, 4, **args, world_size=4), **args)
    for name in base:
        assert ring4[name] < 2 * base[name], (name, ring4[name], base[name])


def _rank_shard_roundtrip(ulysses, ring, S, zigzag):
    mesh = get_mesh(ulysses * ring, ulysses, ring, zigzag)
    position_ids = torch.arange(S).expand(2, S)              # [B, S]
    x = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    pos_local = shard_sequence(position_ids, mesh)
    x_local = shard_sequence(x, mesh)
    full = gather_sequence(x_local, mesh)
    # Each rank uses its copy differently: sp rank q weights position p by (q + 1) * p.
    weight = torch.distributed.get_rank() + 1
    (full * torch.arange(S).view(1, S, 1) * weight).sum().backward()
    return dict(pos=pos_local, x_local=x_local.detach(), x=x.detach(), full=full.detach(),
                grad=x.grad, pos_full=gather_sequence(pos_local, mesh))


@pytest.mark.parametrize("ulysses,ring,zigzag", [(2, 2, True), (1, 4, True), (4, 1, True),
                                                 (2, 2, False)])
def test_shard_and_gather_sequence_and_position_ids(ulysses, ring, zigzag):
    S = 32
    results = dist_pool.run(_rank_shard_roundtrip, ulysses, ring, S, zigzag, world_size=4)
    c = S // (2 * ring)
    for sp_rank, res in enumerate(results):
        r, u = divmod(sp_rank, ulysses)
        if zigzag and ring > 1:  # ring rank r: chunks r and 2R-1-r, split among its U ranks
            pair = list(range(r * c, (r + 1) * c)) + list(range((2 * ring - 1 - r) * c,
                                                                 (2 * ring - r) * c))
            n = len(pair) // ulysses
            want = pair[u * n:(u + 1) * n]
        else:
            n = S // (ulysses * ring)
            want = list(range(sp_rank * n, (sp_rank + 1) * n))
        assert res["pos"][0].tolist() == want
        assert torch.equal(res["x_local"], res["x"][:, want])
        assert res["pos_full"][0].tolist() == list(range(S))
        assert torch.equal(res["full"], res["x"])
        # Each rank's leaf gets, on its own rows only, the sum of the gradients of every
        # rank's copy (the all-gather's backward): (1 + 2 + 3 + 4) x position.
        expect = torch.zeros(2, S, 3)
        expect[:, want] = 10 * torch.tensor(want, dtype=torch.float32).view(1, -1, 1)
        assert torch.equal(res["grad"], expect)


def _work(R: int, L: int, causal: bool, zigzag: bool) -> list[list[int]]:
    """(query rows x keys) of every rank's kernel call at every ring step, from the schedule;
    a causal block counts half."""
    table = []
    for rank in range(R):
        cfg = RingAttention(group=None, rank=rank, size=R, causal=causal, scale=1.0,
                            backend="math", zigzag=zigzag)
        row = []
        for t in range(R):
            blk = _block(cfg, t, L)
            row.append(0 if blk is None else (L - blk[0]) * blk[1] // (2 if blk[2] else 1))
        table.append(row)
    return table


@pytest.mark.parametrize("R", [2, 4, 8])
def test_zigzag_balances_causal_work(R):
    L = 64
    zig = _work(R, L, causal=True, zigzag=True)
    # Every rank does the same work at every step: no rank waits on another's compute.
    assert all(row == zig[0] for row in zig)
    assert all(w == L * L // 2 for w in zig[0])
    flat = _work(R, L, causal=True, zigzag=False)
    assert sum(map(sum, zig)) == sum(map(sum, flat))  # the same total, fully masked skipped
    assert max(map(sum, flat)) == (2 * R - 1) * L * L // 2  # rank R-1 does R - 1/2 blocks
    assert min(map(sum, flat)) == L * L // 2


def test_padding_keys_are_a_prefix():
    """Non-causal padding: each owner's real keys are a prefix of its block, in both layouts."""
    R, L = 4, 8
    for zigzag in (True, False):
        positions = (torch.arange(R * L).view(2 * R, L // 2) if zigzag else
                     torch.arange(R * L).view(R, L))
        for kv_len in range(1, R * L + 1):
            cfg = RingAttention(group=None, rank=0, size=R, causal=False, scale=1.0,
                                backend="math", zigzag=zigzag, kv_len=kv_len)
            for owner in range(R):
                block = (torch.cat([positions[owner], positions[2 * R - 1 - owner]]) if zigzag
                         else positions[owner])
                real = (block < kv_len).tolist()
                n = _valid_keys(cfg, owner, L)
                assert real == [True] * n + [False] * (L - n), (zigzag, kv_len, owner)


def _rank_ring_attention_fn(S, causal, segments=None):
    """The flash_attn_func-shaped ``ring_attention`` on the ring group gives what
    ``ulysses_attention`` gives on the same (U=1, R=4) mesh, packed documents included."""
    from ulysses import ring_attention

    mesh = get_mesh(4, 1, 4)
    q, k, v, dout = (shard_sequence(t, mesh) for t in make_qkv(1, 2, S, 8, 2, D, torch.float32))
    got = []
    for fn in (lambda *t: ring_attention(*t, group=mesh["ring"].get_group(), causal=causal,
                                         segments=segments),
               lambda *t: ulysses_attention(*t, mesh=mesh, causal=causal, segments=segments)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        got.append([out.detach()] + [t.grad for t in leaves])
    return got


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments", [None, ((0, 3, 13), (0, 20))], ids=["one", "documents"])
def test_ring_attention_function(causal, segments):
    for a, b in dist_pool.run(_rank_ring_attention_fn, 32, causal, segments, world_size=4):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
