"""Fused projections of a gated attention block (Qwen3.5, Qwen3-Next): ``fused_attention(...,
gated=True, norm_zero_centered=True)`` with partial rotary against the block written out as
transformers writes it, in float64 on the whole sequence; and each part of the gate checked
by breaking it.

The block: ``q_proj`` gives, per head, D query rows then D gate rows; zero-centered per-head
RMSNorms on q and k (``x * rstd * (1 + w)`` in fp32); RoPE on the first r of each head's D;
``o_proj(attn * sigmoid(gate))``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_pool
from helpers import TOL, get_mesh
from ulysses import gather_sequence, shard_sequence
from ulysses.attention import local_attention
from ulysses.fused_attention import fused_attention

transformers = pytest.importorskip("transformers", reason="the reference is HF's rotary")

from test_ulysses_fused_attention import D, E, _grads  # noqa: E402
from test_ulysses_fused_attention import _inputs as fused_inputs  # noqa: E402

R = 4  # rotary dims of the head dim D (partial: the first half)


def _params(seed, H, K, bias):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    p = dict(wq=rand(2 * H * D, E), wk=rand(K * D, E), wv=rand(K * D, E), wo=rand(E, H * D),
             q_norm_weight=rand(D), k_norm_weight=rand(D))
    if bias:
        p.update(bq=rand(2 * H * D), bk=rand(K * D), bv=rand(K * D), bo=rand(E))
    return p


def _inputs(seed, B, S):
    return fused_inputs(seed, B, S, rotary=R, offset=3)


def _hf_block(x, cos, sin, p, H, K, eps=1e-6):
    """Qwen3_5Attention.forward, written out (its rotary and its norm's arithmetic)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    B, s, _ = x.shape

    def norm(t, w):
        t32 = t.float()
        t32 = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)
        return (t32 * (1.0 + w.float())).type_as(t)

    q, gate = torch.chunk(F.linear(x, p["wq"], p.get("bq")).view(B, s, -1, 2 * D), 2, dim=-1)
    gate = gate.reshape(B, s, -1)
    q = norm(q, p["q_norm_weight"]).transpose(1, 2)
    k = norm(F.linear(x, p["wk"], p.get("bk")).view(B, s, -1, D), p["k_norm_weight"])
    k = k.transpose(1, 2)
    v = F.linear(x, p["wv"], p.get("bv")).view(B, s, -1, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = local_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                          backend="math")
    return F.linear(out.reshape(B, s, H * D) * torch.sigmoid(gate), p["wo"], p.get("bo"))


def _reference(H, K, B, S, bias, seed):
    x, dy, cos, sin = (t.double() for t in _inputs(seed, B, S))
    p = {n: t.double() for n, t in _params(seed, H, K, bias).items()}
    return _grads(lambda x, p: _hf_block(x, cos, sin, p, H, K), x, dy, p)


def _rank(world, ulysses, H, K, B, S, chunk, bias, seed, seq_chunk=None, tile_budget=None,
          broken=None, norm_tile=None):
    import ulysses.head_projection as hp

    if norm_tile is not None:  # the normed projections over sequence tiles of 3 positions
        hp.NORM_TILE_BYTES = norm_tile
    mesh = get_mesh(world, ulysses, world // ulysses)
    x, dy, cos, sin = (shard_sequence(t, mesh) for t in _inputs(seed, B, S))
    p = _params(seed, H, K, bias)
    extra = {} if tile_budget is None else {"chunk_budget_bytes": tile_budget}
    restore = hp.gated_output_backward
    if broken == "gate gradient":  # the gate's rows of q_proj get no gradient
        hp_fn = hp.gated_output_backward
        import ulysses.fused_attention as fa

        def no_gate(*args):
            grads = args[-2]
            saved = grads.weight.clone(), None if grads.bias is None else grads.bias.clone()
            hp_fn(*args)
            grads.weight.copy_(saved[0])
        fa.gated_output_backward = no_gate
    try:
        got = _grads(lambda x, p: fused_attention(
            x, cos, sin, **p, num_heads=H, num_kv_heads=K, mesh=mesh, head_chunk_size=chunk,
            gated=broken != "ungated", norm_zero_centered=True, seq_chunk=seq_chunk,
            **extra) if broken != "ungated" else fused_attention(
            x, cos, sin, **{**p, "wq": p["wq"].view(H, 2 * D, E)[:, :D].reshape(H * D, E)},
            num_heads=H, num_kv_heads=K, mesh=mesh, head_chunk_size=chunk,
            norm_zero_centered=True), x, dy, p)
    finally:
        import ulysses.fused_attention as fa

        fa.gated_output_backward = restore
        hp.NORM_TILE_BYTES = 1 << 28
    for n in ("y", "x"):
        got[n] = gather_sequence(got[n], mesh, dim=1)
    for n in sorted(set(got) - {"y", "x"}):
        if got[n] is None:
            got[n] = torch.zeros_like(p[n])
        torch.distributed.all_reduce(got[n])
    return got


CASES = {  # world, ulysses, H, K, chunk, bias, seq_chunk, tile budget (bytes), norm tile
    "u2-gqa-c1": (2, 2, 4, 2, 1, False, None, None),
    "u2-norm-tiles-bias": (2, 2, 4, 2, 1, True, None, None, 4 * 2 * 2 * D * 3),
    "u2-gqa-c2-bias-tiled-output": (2, 2, 4, 2, 2, True, None, 1024),
    "u4-replicated-kv-c1": (4, 4, 4, 2, 1, True, None, None),
    "u2xr2-ring": (4, 2, 4, 2, 1, False, None, None),
    "u2-seq-chunk": (2, 2, 4, 2, 1, True, 2, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gated_block_matches_the_hf_block(case):
    """y, dx and every weight, bias and norm gradient (summed over ranks) within fp32
    tolerance of the float64 HF block; one case tiles the gated output over 4 rows, one the
    normed q and k projections over 3 positions (B = 2)."""
    world, ulysses, H, K, chunk, bias, seq_chunk, budget, *norm_tile = CASES[case]
    seed = sum(map(ord, case)) % 1000
    ref = _reference(H, K, 2, 32, bias, seed)
    for got in dist_pool.run(_rank, world, ulysses, H, K, 2, 32, chunk, bias, seed, seq_chunk,
                             budget, None, *norm_tile, world_size=world):
        assert set(got) == set(ref)
        for name in ref:
            torch.testing.assert_close(got[name].double(), ref[name], **TOL[torch.float32],
                                       msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("broken", ["ungated", "gate gradient"])
def test_each_part_of_the_gate_fails_when_broken(broken):
    """Without the gate the output is wrong; with the gate's gradient dropped, q_proj's gate
    rows are."""
    ref = _reference(4, 2, 2, 32, False, 5)
    got = dist_pool.run(_rank, 2, 2, 4, 2, 2, 32, 1, False, 5, None, None, broken,
                        world_size=2)[0]
    name = "y" if broken == "ungated" else "wq"
    if broken == "ungated":
        assert (got["y"].double() - ref["y"]).abs().max() > 1e-2
    else:
        gate_rows = ref["wq"].view(4, 2, D, E)[:, 1]
        assert gate_rows.abs().max() > 1e-2
        assert (got[name].double().view(4, 2, D, E)[:, 1] - gate_rows).abs().max() > 1e-2


def _rank_shape_errors():
    from helpers import value_error_of

    mesh = get_mesh(2, 2)
    x, _, cos, sin = _inputs(0, 1, 8)
    p = _params(0, 4, 2, False)
    call = lambda **kw: value_error_of(lambda: fused_attention(  # noqa: E731
        **{"x": x, "cos": cos, "sin": sin, **p, "num_heads": 4, "num_kv_heads": 2,
           "mesh": mesh, "head_chunk_size": 1, "gated": True, "norm_zero_centered": True,
           **kw}))
    wide = torch.ones(1, 8, 2 * D)
    return {"plain_wq": call(wq=p["wq"][:4 * D]), "wide_rotary": call(cos=wide, sin=wide),
            "odd_rotary": call(cos=cos[..., :3], sin=sin[..., :3]),
            "no_norm": call(q_norm_weight=None, k_norm_weight=None)}


def test_gated_shapes_are_checked():
    """A gated call with a q_proj of H D rows, rotary tables wider than the head or of odd
    width, and a zero-centered norm without norm weights are refused before any
    collective."""
    errors = dist_pool.run(_rank_shape_errors, world_size=2)[0]
    assert "wq must have shape (64, 32), got (32, 32)" in errors["plain_wq"]
    assert "at most head_dim=8" in errors["wide_rotary"]
    assert "r even" in errors["odd_rotary"]
    assert "norm_zero_centered=True needs q_norm_weight" in errors["no_norm"]
