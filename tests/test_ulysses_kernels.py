"""Attention kernels: (out, lse) and the lse-taking backward, against float64 math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL
from ulysses import kernels
from ulysses.kernels import attention_backward, attention_forward, local_attention, select_backend


def _qkv(B, S, H, K, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g).to(dtype),
            torch.randn(B, S, K, D, generator=g).to(dtype),
            torch.randn(B, S, K, D, generator=g).to(dtype),
            torch.randn(B, S, H, D, generator=g).to(dtype))


def test_math_reference_matches_torch_sdpa():
    """The reference itself, against torch's math SDPA with repeated kv heads."""
    q, k, v, dout = _qkv(2, 24, 6, 3, 8, torch.float64)
    for causal in (True, False):
        out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=0.3, backend="math")
        kr, vr = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, is_causal=causal,
                                             scale=0.3).transpose(1, 2)
        torch.testing.assert_close(out, ref)
        scores = q.transpose(1, 2) @ kr.transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,K", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_cpu_flash_matches_math(dtype, H, K, causal, scale):
    q, k, v, dout = _qkv(2, 40, H, K, 16, dtype, seed=H + K)
    s = kernels.default_scale(16, scale)
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=s, backend="cpu_flash")
    ref_out, ref_lse = attention_forward(q, k, v, causal=causal, softmax_scale=s, backend="math")
    assert lse.dtype == torch.float32 and lse.shape == (2, H, 40)
    torch.testing.assert_close(out.double(), ref_out.double(), **TOL[dtype])
    # bf16 scores are accumulated from bf16 products, so lse carries bf16-sized error too.
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=s,
                               backend="cpu_flash")
    ref_grads = attention_backward(dout.double(), q.double(), k.double(), v.double(),
                                   ref_out.double(), ref_lse.double(), causal=causal,
                                   softmax_scale=s, backend="math")
    for got, ref, t in zip(grads, ref_grads, (q, k, v)):
        assert got.shape == t.shape
        torch.testing.assert_close(got.double(), ref, **TOL[dtype])


def test_backward_uses_given_lse():
    """A shifted lse must change the gradient: backward trusts lse, as ring merging needs."""
    q, k, v, dout = _qkv(1, 16, 2, 2, 8, torch.float32)
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.35, backend="cpu_flash")
    good = attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.35,
                              backend="cpu_flash")
    bad = attention_backward(dout, q, k, v, out, lse + 1.0, causal=True, softmax_scale=0.35,
                             backend="cpu_flash")
    assert not torch.allclose(good[1], bad[1], atol=1e-3)


def test_local_attention_autograd():
    q, k, v, dout = _qkv(2, 20, 4, 2, 8, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = local_attention(q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    assert not lse.requires_grad
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    dq, dk, dv = torch.autograd.grad(ref, (q, k, v), dout)
    for got, want in zip((q.grad, k.grad, v.grad), (dq, dk, dv)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_backend(cpu, torch.float32, 64) == "cpu_flash"
    assert select_backend(cpu, torch.bfloat16, 64) == "cpu_flash"
    assert select_backend(cpu, torch.float32, 64, "math") == "math"
    assert select_backend(cuda, torch.float32, 64) == "sdpa_efficient"
    assert select_backend(cuda, torch.bfloat16, 64) in ("flash_attn", "sdpa_flash")
    assert select_backend(cuda, torch.bfloat16, 512) == "sdpa_efficient"
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        select_backend(cpu, torch.float32, 64, "flash3")
    with pytest.raises(ValueError, match="needs a CUDA tensor, got cpu"):
        select_backend(cpu, torch.bfloat16, 64, "sdpa_flash")
    with pytest.raises(ValueError, match="needs fp16/bf16"):
        select_backend(cuda, torch.float32, 64, "sdpa_flash")


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient"])
def test_cuda_wrappers_shape_check_on_meta(backend):
    """CI has no GPU: run the CUDA wrappers on meta tensors, which checks the aten op
    signatures, argument order and the shapes we hand back (GQA included)."""
    B, S, H, K, D = 2, 40, 8, 2, 64
    q = torch.empty(B, S, H, D, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(B, S, K, D, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.125, backend=backend)
    assert out.shape == q.shape and lse.shape == (B, H, S) and lse.dtype == torch.float32
    dq, dk, dv = attention_backward(torch.empty_like(out), q, k, v, out, lse, causal=True,
                                    softmax_scale=0.125, backend=backend)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "flash_attn"])
def test_cuda_backends_match_math(backend):
    if backend == "flash_attn" and not kernels.flash_attn_available():
        pytest.skip("flash_attn is not installed")
    q, k, v, dout = (t.cuda() for t in _qkv(2, 128, 8, 2, 64, torch.bfloat16))
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.125, backend=backend)
    ref_out, ref_lse = attention_forward(q, k, v, causal=True, softmax_scale=0.125, backend="math")
    torch.testing.assert_close(out.double(), ref_out.double(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.bfloat16])
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.125,
                               backend=backend)
    ref = attention_backward(dout.double(), q.double(), k.double(), v.double(), ref_out.double(),
                             ref_lse.double(), causal=True, softmax_scale=0.125, backend="math")
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got.double(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(q=(2, 8, 4, 16), k=(2, 8, 3, 16)), "multiple of kv heads (3)"),
    (dict(q=(2, 8, 4, 16), k=(2, 6, 2, 16), causal=True), "equal q and kv lengths"),
    (dict(q=(2, 8, 4), k=(2, 8, 2, 16)), "[batch, seq, heads, head_dim]"),
    (dict(q=(2, 8, 4, 16), k=(2, 8, 2, 8)), "agree on batch and head_dim"),
])
def test_bad_shapes(kwargs, needle):
    q = torch.zeros(kwargs["q"])
    k = torch.zeros(kwargs["k"])
    with pytest.raises(ValueError) as info:
        local_attention(q, k, k.clone(), causal=kwargs.get("causal", False))
    assert needle in str(info.value)
