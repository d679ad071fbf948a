"""``fused_attention(..., input_norm=)`` (:mod:`ulysses.input_norm`): the block's input norm
run inside, on the row tiles each projection reads. Against the float64 block on
``norm(x)``; each part checked by breaking it; and the normed input no longer saved."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh
from ulysses import gather_sequence, shard_sequence
from ulysses.fused_attention import fused_attention
from ulysses.input_norm import InputNorm

pytest.importorskip("transformers", reason="the reference is HF's rotary")

from test_ulysses_fused_attention import D, E, _grads  # noqa: E402
from test_ulysses_fused_gated import _hf_block, _inputs, _params  # noqa: E402

H, K, B, S = 4, 2, 2, 32


def _norm(t, w, eps=1e-6):
    """Qwen3.5's RMSNorm (zero-centered, in fp32)."""
    t32 = t.float()
    t32 = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)
    return (t32 * (1.0 + w.float())).type_as(t)


def _with_norm_weight(seed):
    p = _params(seed, H, K, True)
    p["input_norm"] = torch.randn(E, generator=torch.Generator().manual_seed(seed)) / 4
    return p


def _reference(seed):
    x, dy, cos, sin = (t.double() for t in _inputs(seed, B, S))
    p = {n: t.double() for n, t in _with_norm_weight(seed).items()}

    def block(x, p):
        return _hf_block(_norm(x, p["input_norm"]), cos, sin,
                         {n: t for n, t in p.items() if n != "input_norm"}, H, K)
    return _grads(block, x, dy, p)


def _rank(world, ulysses, seed, seq_chunk=None, broken=None):
    import ulysses.fused_attention as fa
    import ulysses.input_norm as inorm

    mesh = get_mesh(world, ulysses, world // ulysses)
    x, dy, cos, sin = (shard_sequence(t, mesh) for t in _inputs(seed, B, S))
    p = _with_norm_weight(seed)
    inorm.NORM_ROW_BYTES = 4 * E * 5  # tiles of 5 rows: several per piece
    tiles, backward = inorm.row_tiles, fa.norm_backward
    if broken == "a tile skipped":
        inorm.row_tiles = lambda *a: (lambda got: got[:1] + got[2:])(tiles(*a))
    if broken == "no norm backward":
        fa.norm_backward = lambda x, norm, d: d

    def block(x, p):
        w = p["input_norm"]
        weights = {n: t for n, t in p.items() if n != "input_norm"}
        return fused_attention(x, cos, sin, **weights, num_heads=H, num_kv_heads=K, mesh=mesh,
                               head_chunk_size=1, gated=True, norm_zero_centered=True,
                               seq_chunk=seq_chunk,
                               input_norm=InputNorm(lambda t: _norm(t, w), (w,)))
    try:
        got = _grads(block, x, dy, p)
    finally:
        inorm.NORM_ROW_BYTES, inorm.row_tiles, fa.norm_backward = 1 << 28, tiles, backward
    for n in ("y", "x"):
        got[n] = gather_sequence(got[n], mesh, dim=1)
    for n in sorted(set(got) - {"y", "x"}):
        if got[n] is None:  # (broken: no gradient reached it)
            got[n] = torch.zeros_like(p[n])
        torch.distributed.all_reduce(got[n])
    return got


CASES = {"u2": (2, 2, None), "u2xr2-ring": (4, 2, None), "u2-seq-chunk": (2, 2, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_input_norm_inside_matches_the_block_on_normed_input(case):
    """y, dx, the norm weight's gradient and every other gradient (summed over ranks) within
    fp32 tolerance of the float64 block on ``norm(x)``, the norm in tiles of 5 rows."""
    world, ulysses, seq_chunk = CASES[case]
    ref = _reference(7)
    for got in dist_pool.run(_rank, world, ulysses, 7, seq_chunk, world_size=world):
        assert set(got) == set(ref)
        for name in ref:
            torch.testing.assert_close(got[name].double(), ref[name], **TOL[torch.float32],
                                       msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("broken", ["a tile skipped", "no norm backward"])
def test_the_input_norm_fails_the_check_when_broken(broken):
    """A tile of the norm's backward left out, or no norm backward at all (dx stays the
    gradient of ``norm(x)``): dx is wrong, and so is the norm weight's gradient."""
    ref = _reference(7)
    got = dist_pool.run(_rank, 2, 2, 7, None, broken, world_size=2)[0]
    assert (got["x"].double() - ref["x"]).abs().max() > 1e-2
    assert (got["input_norm"].double() - ref["input_norm"]).abs().max() > 1e-2


def _rank_saved_bytes() -> dict[str, int]:
    """Bytes of the storages the fused block saves for backward, besides the caller's x."""
    mesh = get_mesh(2, 2)
    x, _, cos, sin = (shard_sequence(t, mesh) for t in _inputs(3, B, S))
    p = _params(3, H, K, False)
    w = torch.zeros(E)
    out = {}
    for inside in (False, True):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        x_in = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if inside:
                fused_attention(x_in, cos, sin, **p, num_heads=H, num_kv_heads=K, mesh=mesh,
                                head_chunk_size=1, gated=True, norm_zero_centered=True,
                                input_norm=InputNorm(lambda t: _norm(t, w)))
            else:  # normed as a tiled norm does: under no grad, the result a leaf
                normed = _norm(x_in.detach(), w).requires_grad_()
                fused_attention(normed, cos, sin, **p, num_heads=H, num_kv_heads=K,
                                mesh=mesh, head_chunk_size=1, gated=True,
                                norm_zero_centered=True)
        seen.pop(x_in.untyped_storage().data_ptr(), None)
        out["inside" if inside else "before"] = sum(seen.values())
    out["hidden"] = x.numel() * x.element_size()
    return out


def test_the_normed_input_is_not_saved():
    """With the norm inside, the block saves the caller's x, not a normed copy: one
    ``[B, s, E]`` tensor less."""
    got = dist_pool.run(_rank_saved_bytes, world_size=2)[0]
    assert got["before"] - got["inside"] == got["hidden"], got


def _rank_refusal() -> str:
    from helpers import value_error_of

    mesh = get_mesh(2, 2)
    x, _, cos, sin = _inputs(0, 1, 8)
    return value_error_of(lambda: fused_attention(
        x, cos, sin, **_params(0, H, K, False), num_heads=H, num_kv_heads=K, mesh=mesh,
        head_chunk_size=1, gated=True, norm_zero_centered=True, input_norm=torch.ones(E)))


def test_an_input_norm_that_is_not_one_is_refused():
    assert "input_norm must be a ulysses.input_norm.InputNorm, got Tensor" in \
        dist_pool.run(_rank_refusal, world_size=2)[0]
