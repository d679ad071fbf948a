"""ulysses_attention on 1, 2 and 4 gloo ranks against single-device float64 attention.

Full tensors come from one seed, are sharded with the public ``shard_sequence``, and every
rank's output and input-gradient shards are compared with the reference's matching slices
(tolerances per dtype in ``helpers.TOL``).
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import DTYPES, TOL, get_mesh, make_qkv, reference
from ulysses import shard_sequence, ulysses_attention

D = 16


def _rank_ulysses(world, ulysses, H, K, B, S, causal, dtype_name, seed, softmax_scale=None,
                  pad=False):
    """On each rank: shard, run ulysses_attention fwd+bwd, return local shards."""
    mesh = get_mesh(world, ulysses)
    dp_rank = mesh["dp"].get_local_rank()
    q, k, v, dout = make_qkv(seed + dp_rank, B, S, H, K, D, DTYPES[dtype_name])
    q, k, v = (shard_sequence(t, mesh, pad=pad).clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(q, k, v, mesh=mesh, causal=causal, softmax_scale=softmax_scale,
                            unpadded_len=S if pad else None)
    out.backward(shard_sequence(dout, mesh, pad=pad))
    return dict(dp=dp_rank, sp=mesh["ulysses"].get_local_rank(), out=out.detach(),
                dq=q.grad, dk=k.grad, dv=v.grad,
                contiguous=all(t.is_contiguous() for t in (out, q.grad, k.grad, v.grad)))


def _check(results, H, K, B, S, causal, dtype_name, seed, softmax_scale=None):
    dtype = DTYPES[dtype_name]
    refs = {}
    for res in results:
        assert res["contiguous"], "outputs and gradients must be contiguous"
        if res["dp"] not in refs:
            q, k, v, dout = make_qkv(seed + res["dp"], B, S, H, K, D, dtype)
            refs[res["dp"]] = reference(q, k, v, dout, causal=causal, softmax_scale=softmax_scale)
        n = res["out"].shape[1]
        start = res["sp"] * n
        valid = max(0, min(n, S - start))  # positions of this shard that are not padding
        for name, ref in zip(("out", "dq", "dk", "dv"), refs[res["dp"]]):
            got = res[name][:, :valid].double()
            torch.testing.assert_close(got, ref[:, start:start + valid], **TOL[dtype],
                                       msg=lambda m: f"{name} dp={res['dp']} sp={res['sp']}: {m}")


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_reference(world, causal, dtype_name):
    args = dict(H=8, K=4, B=2, S=32, causal=causal, dtype_name=dtype_name, seed=world)
    results = dist_pool.run(_rank_ulysses, world, world, **args, world_size=world)
    _check(results, **args)


@pytest.mark.parametrize("H,K", [(8, 2), (8, 1), (4, 4), (6, 6), (6, 2), (12, 6), (10, 5)],
                         ids=["gqa-replicated", "mqa", "one-head-per-rank", "uneven-mha",
                              "uneven-replicated", "uneven-gqa", "uneven-gqa-odd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gqa_and_uneven_heads_u4(H, K, causal):
    args = dict(H=H, K=K, B=2, S=32, causal=causal, dtype_name="fp32", seed=H * 10 + K)
    results = dist_pool.run(_rank_ulysses, 4, 4, **args, world_size=4)
    _check(results, **args)


def test_gqa_bf16_u4():
    args = dict(H=8, K=1, B=2, S=32, causal=True, dtype_name="bf16", seed=3)
    _check(dist_pool.run(_rank_ulysses, 4, 4, **args, world_size=4), **args)


def test_dp2_x_ulysses2_groups_get_different_data():
    """2 x 2 mesh: each dp group attends over its own sequence (seed + dp rank)."""
    args = dict(H=8, K=2, B=2, S=32, causal=True, dtype_name="fp32", seed=7)
    results = dist_pool.run(_rank_ulysses, 4, 2, **args, world_size=4)
    assert sorted((r["dp"], r["sp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The two dp groups really did see different data.
    assert not torch.allclose(results[0]["out"], results[2]["out"])
    _check(results, **args)


def test_custom_softmax_scale():
    args = dict(H=4, K=2, B=1, S=32, causal=True, dtype_name="fp32", seed=11,
                softmax_scale=0.37)
    _check(dist_pool.run(_rank_ulysses, 2, 2, **args, world_size=2), **args)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_padded_sequence(causal):
    """S=30 on 4 ranks: pad=True pads to 32, unpadded_len masks the tail for full attention."""
    args = dict(H=4, K=4, B=2, S=30, causal=causal, dtype_name="fp32", seed=5)
    results = dist_pool.run(_rank_ulysses, 4, 4, **args, pad=True, world_size=4)
    assert results[0]["out"].shape[1] == 8
    _check(results, **args)
