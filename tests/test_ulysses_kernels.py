"""Attention kernels: (out, lse) and the lse-taking backward, against float64 math; which
CUDA kernel is chosen on which GPU, and why one is refused, without a GPU (the CUDA runs are
in test_ulysses_kernels_cuda.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, value_error_of
from ulysses import cuda_kernels, kernels
from ulysses.attention import local_attention
from ulysses.kernels import attention_backward, attention_forward, select_backend


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
    assert select_backend(cuda, torch.bfloat16, 512) == "sdpa_efficient"
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        select_backend(cpu, torch.float32, 64, "flash3")
    with pytest.raises(ValueError, match="needs a CUDA tensor, got cpu"):
        select_backend(cpu, torch.bfloat16, 64, "sdpa_flash")
    with pytest.raises(ValueError, match="needs fp16/bf16"):
        select_backend(cuda, torch.float32, 64, "sdpa_flash")


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
@pytest.mark.parametrize("Sk,causal", [(40, True), (24, False), (1, False)],
                         ids=["causal", "rectangular", "one-key"])
def test_cuda_wrappers_shape_check_on_meta(backend, Sk, causal):
    """CI has no GPU: run the CUDA wrappers on meta tensors, which checks the aten op
    signatures, argument order and the shapes we hand back (GQA included)."""
    B, S, H, K, D = 2, 40, 8, 2, 64
    q = torch.empty(B, S, H, D, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(B, Sk, K, D, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=0.125, backend=backend)
    assert out.shape == q.shape and lse.shape == (B, H, S) and lse.dtype == torch.float32
    dq, dk, dv = attention_backward(torch.empty_like(out), q, k, v, out, lse, causal=causal,
                                    softmax_scale=0.125, backend=backend)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


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


# --- choosing among the CUDA kernels, and the FA3/FA4 wrappers, without a GPU ---------------
#
# The stubs below have the signatures of the real internals (flash-attention's
# hopper/flash_attn_interface.py and flash_attn/cute/interface.py, at the releases named) and
# compute with the float64 reference on CPU, so the wrappers' argument plumbing is checked.

def _math_fwd(q, k, v, causal, scale):
    out, lse = kernels._math_forward(q, k, v, causal, scale)
    return out, lse.float()


def _math_bwd_into(dout, q, k, v, out, lse, causal, scale, dq, dk, dv):
    for buf, grad in zip((dq, dk, dv), kernels._math_backward(dout, q, k, v, out, lse, causal,
                                                              scale)):
        buf.copy_(grad)


def _fa3_2025_fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                  seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
                  leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale,
                  v_descale, softmax_scale, causal, window_size=(-1, -1), attention_chunk=0,
                  softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                  pack_gqa=None, sm_margin=0):
    """May-2025 FA3 (db4baba2): every argument up to ``causal`` without a default."""
    assert window_size == (-1, -1) and out is None and cu_seqlens_q is None
    return (*_math_fwd(q, k, v, causal, softmax_scale), None, None)


def _fa3_2025_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q,
                  sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal,
                  window_size=(-1, -1), softcap=0.0, deterministic=False, sm_margin=0):
    assert window_size == (-1, -1) and cu_seqlens_q is None
    _math_bwd_into(dout, q, k, v, out, softmax_lse, causal, softmax_scale, dq, dk, dv)
    return dq, dk, dv, None


@torch.library.custom_op("ulysses_test::fa3_fwd", mutates_args=(), device_types="cpu")
def _fa3_2026_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None,
                  out_: Optional[torch.Tensor] = None,
                  cu_seqlens_q: Optional[torch.Tensor] = None,
                  softmax_scale: Optional[float] = None, causal: bool = False,
                  window_size_left: int = -1, window_size_right: int = -1,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The custom-op FA3 (2026 head): keywords with defaults, ``out_``, left/right windows."""
    assert (window_size_left, window_size_right) == (-1, -1) and softmax_scale is not None
    return (*_math_fwd(q, k, v, causal, softmax_scale), torch.empty(0), torch.empty(0))


@torch.library.custom_op("ulysses_test::fa3_bwd", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _fa3_2026_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, softmax_lse: torch.Tensor,
                  cu_seqlens_q: Optional[torch.Tensor] = None,
                  dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
                  dv: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                  is_causal: bool = False, window_size_left: int = -1,
                  window_size_right: int = -1, deterministic: bool = False) -> torch.Tensor:
    assert softmax_scale is not None and dq is not None
    _math_bwd_into(dout, q, k, v, out, softmax_lse, is_causal, softmax_scale, dq, dk, dv)
    return torch.empty(0)


def _fa3_beta_fwd(q, k, v, softmax_scale, causal, descale_q=None, descale_k=None,
                  descale_v=None):
    """The 2024 beta (bdf733be), which returned (out, q, k, v, out_padded, lse, S_dmask)."""
    raise AssertionError("the 2024 beta is refused before it is called")


def _fa4_fwd(q, k, v, qv=None, cu_seqlens_q=None, softmax_scale=None, causal=False,
             softcap=None, window_size_left=None, window_size_right=None, pack_gqa=None,
             return_lse=False, out=None, lse=None):
    """flash-attn-4 (2026 head): lse only when asked for; four results. Its capability
    check (the gate reads it from the source): ``assert arch // 10 in [8, 9, 10, 11, 12]``."""
    out, lse = _math_fwd(q, k, v, causal, softmax_scale)
    return out, lse if return_lse else None, None, None


def _fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
             window_size_left=None, window_size_right=None, cu_seqlens_q=None,
             deterministic=False, dq=None, dk=None, dv=None, learnable_sink=None):
    """Its capability check: ``assert arch // 10 in [9, 10, 11, 12]``."""
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    _math_bwd_into(dout, q, k, v, out, lse, causal, softmax_scale, *grads)
    return grads


def _fa4_2025_06_fwd(q, k, v, cu_seqlens_q=None, softmax_scale=None, causal=False):
    """June-2025 FA4 (931fb8cb): lse only when an input requires grad, no ``return_lse``."""
    raise AssertionError("refused before it is called")


FA3 = {"2025": SimpleNamespace(_flash_attn_forward=_fa3_2025_fwd,
                               _flash_attn_backward=_fa3_2025_bwd),
       "2026": SimpleNamespace(_flash_attn_forward=_fa3_2026_fwd,
                               _flash_attn_backward=_fa3_2026_bwd),
       "beta": SimpleNamespace(_flash_attn_forward=_fa3_beta_fwd)}
def _fa4_validate_head_dims(head_dim, head_dim_v, compute_capability, alignment):
    """flash-attn-4's own head-dim rules (2026): sm90 8..256; sm100/sm110 <= 128 or 256."""
    if compute_capability == 9:
        assert 8 <= head_dim <= 256 and head_dim % alignment == 0, "not supported on SM90"
    elif compute_capability in [10, 11]:
        assert (head_dim <= 128 or head_dim == 256) and head_dim % alignment == 0, \
            "not supported on SM100/SM110"


FA4 = {"2026": SimpleNamespace(_flash_attn_fwd=_fa4_fwd, _flash_attn_bwd=_fa4_bwd,
                               _validate_head_dims=_fa4_validate_head_dims),
       "2025-06": SimpleNamespace(_flash_attn_fwd=_fa4_2025_06_fwd)}


@pytest.mark.parametrize("backend,module,version", [
    ("fa3", "_fa3", "2025"), ("fa3", "_fa3", "2026"), ("fa4", "_fa4", "2026")])
def test_fa3_fa4_wrappers_pass_what_each_release_takes(monkeypatch, backend, module, version):
    monkeypatch.setattr(cuda_kernels, module, (FA3 if backend == "fa3" else FA4)[version])
    q, k, v, dout = _qkv(2, 24, 4, 2, 16, torch.float32, seed=3)
    q, k, v, dout = (t[:, 4:] for t in (q, k, v, dout))   # strided, as ring pieces are
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.3, backend=backend)
    ref_out, ref_lse = attention_forward(q, k, v, causal=True, softmax_scale=0.3, backend="math")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.3,
                               backend=backend)
    ref = attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.3,
                             backend="math")
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want)


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(cap, cudnn, installed)`` pretends this process sees a CUDA device of compute
    capability ``cap``, runtime cuDNN ``cudnn`` and the packages in ``installed``."""
    def pretend(cap, cudnn=91501, installed=()):
        monkeypatch.setattr(cuda_kernels, "_capability", lambda device: cap)
        monkeypatch.setattr(cuda_kernels, "_cudnn_version", lambda: cudnn)
        monkeypatch.setattr(cuda_kernels, "_fa",
                            SimpleNamespace() if "flash_attn" in installed else None)
        monkeypatch.setattr(cuda_kernels, "_fa3", FA3["2026"] if "fa3" in installed else None)
        monkeypatch.setattr(cuda_kernels, "_fa4", FA4["2026"] if "fa4" in installed else None)
    return pretend


ALL = ("flash_attn", "fa3", "fa4")
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("cap,cudnn,installed,dtype,head_dim,want", [
    ((8, 0), 91501, ALL, BF16, 64, "flash_attn"),      # A100: no FA3/FA4, cuDNN not preferred
    ((8, 0), 91501, (), BF16, 64, "sdpa_flash"),
    ((9, 0), 91501, ALL, BF16, 128, "fa3"),
    ((9, 0), 91501, ("flash_attn", "fa4"), BF16, 128, "sdpa_cudnn"),  # FA4 only by name on H100
    ((9, 0), 91002, ("flash_attn",), FP16, 128, "flash_attn"),   # cuDNN 9.10: not preferred
    ((9, 0), 91002, (), FP16, 128, "sdpa_flash"),
    ((9, 0), 91501, ("flash_attn",), BF16, 256, "flash_attn"),  # cuDNN: head_dim <= 128
    ((9, 0), 91501, ("fa3",), BF16, 256, "fa3"),
    ((9, 0), 91501, ALL, BF16, 512, "sdpa_efficient"),
    ((10, 0), 91501, ALL, BF16, 128, "fa4"),
    ((10, 0), 91501, ("flash_attn", "fa3"), BF16, 128, "sdpa_cudnn"),  # FA3 is Hopper-only
    ((10, 3), 91501, (), FP16, 64, "sdpa_cudnn"),
    ((10, 0), 91501, ("fa4",), BF16, 192, "sdpa_flash"),   # FA4 on sm100: <= 128 or 256
    ((10, 0), 91501, ("fa4",), BF16, 256, "fa4"),
    ((12, 0), 91501, (), BF16, 64, "sdpa_flash"),  # torch prefers cuDNN on sm90/100/103 only
    ((12, 0), 91501, ("fa4",), BF16, 64, "fa4"),
    ((9, 0), 91501, ALL, torch.float32, 64, "sdpa_efficient"),
    ((9, 0), 91501, ALL, torch.float64, 64, "math"),
])
def test_automatic_cuda_choice(gpu, cap, cudnn, installed, dtype, head_dim, want):
    gpu(cap, cudnn, installed)
    assert select_backend(torch.device("cuda", 0), dtype, head_dim) == want
    assert select_backend(torch.device("cpu"), dtype, head_dim) == "cpu_flash"


CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("backend,device,cap,cudnn,installed,dtype,head_dim,reason", [
    ("fa3", CUDA, (9, 0), 91501, (), BF16, 64,
     "flash_attn_interface (FlashAttention-3) is not installed"),
    ("fa3", torch.device("cpu"), (9, 0), 91501, ALL, BF16, 64, "needs a CUDA tensor, got cpu"),
    ("fa3", CUDA, (8, 0), 91501, ALL, BF16, 64,
     "needs a Hopper GPU (compute capability 9.x), got 8.0"),
    ("fa3", CUDA, (9, 0), 91501, ALL, BF16, 320,
     "needs head_dim a multiple of 8 and <= 256, got 320"),
    ("fa4", CUDA, (10, 0), 91501, (), BF16, 64,
     "flash_attn.cute (FlashAttention-4, flash-attn-4) is not installed"),
    ("fa4", CUDA, (8, 0), 91501, ALL, BF16, 64, "this flash-attn-4 release runs forward and "
                                                "backward on compute capability 9.x, 10.x, "
                                                "11.x, 12.x only, got 8.0"),
    ("fa4", CUDA, (10, 0), 91501, ALL, torch.float32, 64, "needs fp16/bf16, got torch.float32"),
    ("fa4", CUDA, (10, 0), 91501, ALL, BF16, 192,
     "does not take head_dim 192 on sm10x: not supported on SM100/SM110"),
    ("sdpa_cudnn", CUDA, (9, 0), 0, (), BF16, 64, "needs cuDNN >= 9.0, this torch reports none"),
    ("sdpa_cudnn", CUDA, (9, 0), 8907, (), BF16, 64,
     "needs cuDNN >= 9.0, this torch reports 8907"),
    ("sdpa_cudnn", CUDA, (7, 5), 91501, (), FP16, 64,
     "needs compute capability 8.0 to 12.1, got 7.5"),
    ("sdpa_cudnn", CUDA, (9, 0), 91501, (), BF16, 100,
     "needs head_dim a multiple of 8 and <= 128, got 100"),
    ("sdpa_cudnn", CUDA, (9, 0), 91501, (), BF16, 256,
     "needs head_dim a multiple of 8 and <= 128, got 256"),
    ("sdpa_cudnn", torch.device("meta"), (9, 0), 91501, (), BF16, 64,
     "needs a CUDA tensor, got meta"),
])
def test_check_supported_names_backend_and_reason(gpu, backend, device, cap, cudnn, installed,
                                                   dtype, head_dim, reason):
    gpu(cap, cudnn, installed)
    check = lambda: select_backend(device, dtype, head_dim, backend)  # noqa: E731
    assert value_error_of(check) == f"attention backend {backend!r} {reason}"


def test_explicit_cuda_backends_pass_their_check(gpu):
    gpu((9, 0), 91501, ALL)
    for backend in ("sdpa_cudnn", "fa3", "fa4", "flash_attn", "sdpa_flash"):
        assert select_backend(CUDA, BF16, 128, backend) == backend


@pytest.mark.parametrize("module,version,reason", [
    ("_fa3", "beta", "needs a FlashAttention-3 build from 2025 or later (this is the 2024 beta)"),
    ("_fa4", "2025-06", "needs a flash-attn-4 whose forward can return lse (October 2025 or "
                        "later)")])
def test_old_fa3_fa4_interfaces_are_refused(gpu, monkeypatch, module, version, reason):
    gpu((9, 0), 91501, ALL)
    monkeypatch.setattr(cuda_kernels, module, (FA3 if module == "_fa3" else FA4)[version])
    backend = module[1:]
    assert value_error_of(lambda: select_backend(CUDA, BF16, 64, backend)) == \
        f"attention backend {backend!r} {reason}"


def test_capability_is_looked_up_once_per_device(monkeypatch):
    """select_backend runs for every attention call; the device query must not."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device: calls.append(device) or (8, 0))
    cuda_kernels._capability.cache_clear()
    try:
        for _ in range(3):
            select_backend(torch.device("cuda", 0), BF16, 64)
            select_backend(torch.device("cuda", 1), BF16, 64)
    finally:
        cuda_kernels._capability.cache_clear()
    assert calls == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_fa_call_refuses_to_drop_an_argument_that_matters():
    """Release differences are bridged only where dropping changes nothing: a release that
    renamed the scale or the causal flag is refused, not run with its defaults."""
    def fwd(q, causal, dropout_p=0.0):
        return q

    def fwd2(q, softmax_scale, is_causal):
        return q

    call = cuda_kernels._fa_call
    assert call(fwd, q=1, causal=True, softcap=0.0, alibi_slopes=None) == 1
    assert value_error_of(lambda: call(fwd, q=1, causal=True, softmax_scale=0.3)).endswith(
        "fwd does not take ['softmax_scale']: this flash-attn release is not supported; use "
        "another attention_backend")
    assert "does not take ['softcap']" in value_error_of(
        lambda: call(fwd, q=1, causal=True, softcap=30.0))
    assert call(fwd2, q=1, softmax_scale=0.3, causal=True, is_causal=True) == 1
    assert "does not take ['causal']" in value_error_of(
        lambda: call(lambda q, softmax_scale: q, q=1, softmax_scale=0.3, causal=True))
