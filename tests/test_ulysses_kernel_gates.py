"""The CUDA backends' admission, from the rules torch and flash-attention enforce, over a
table of compute capabilities x head dims x dtypes (no GPU needed: the capability, the cuDNN
version and the installed packages are stood in for). Automatic selection returns a backend
that admits the case, or a ValueError; a named backend that does not admit it is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from test_ulysses_kernels import _fa4_validate_head_dims
from ulysses import cuda_kernels, cuda_sdpa
from ulysses.kernels import attention_backward, check_supported, select_backend

CAPS = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0)]
HEAD_DIMS = [64, 80, 96, 100, 128, 192, 224, 256, 288]
DTYPES = [torch.float16, torch.bfloat16]
CUDA = torch.device("cuda")


def _admits(backend: str, cap: tuple[int, int], head_dim: int, dtype: torch.dtype) -> bool:
    """The rules, restated from their sources (torch's sdp_utils.cpp, flash-attention)."""
    aligned = head_dim % 8 == 0
    if backend == "sdpa_efficient":
        return dtype != torch.bfloat16 or cap >= (8, 0)
    if backend == "sdpa_flash":
        backward = not (cap in ((8, 6), (8, 9), (12, 0)) and 192 < head_dim <= 224)
        return (8, 0) <= cap <= (12, 1) and aligned and head_dim <= 256 and backward
    if backend == "flash_attn":
        return cap >= (8, 0) and aligned and head_dim <= 256
    if backend == "sdpa_cudnn":
        return (8, 0) <= cap <= (12, 1) and aligned and head_dim <= 128
    if backend == "fa3":
        return cap[0] == 9 and aligned and head_dim <= 256
    if backend == "fa4":
        limit_ok = {9: head_dim <= 256, 10: head_dim <= 128 or head_dim == 256,
                    11: head_dim <= 128 or head_dim == 256, 12: head_dim <= 128}
        return aligned and limit_ok.get(cap[0], False)
    raise AssertionError(backend)


@pytest.fixture
def gpu(monkeypatch):
    """Stand-ins for the device capability, cuDNN 9.20 and the flash-attn 2/3/4 packages."""
    state = {"cap": (9, 0)}
    monkeypatch.setattr(cuda_kernels, "_capability", lambda device: state["cap"])
    monkeypatch.setattr(cuda_kernels, "_cudnn_version", lambda: 92000)

    def fa3_forward(q, k, v, k_new=None):  # the 2025 signature the gate looks for
        raise AssertionError("not run")

    def fa_backward(dout, q, k, v, deterministic=False):
        raise AssertionError("not run")

    monkeypatch.setattr(cuda_kernels, "_fa", SimpleNamespace(_flash_attn_backward=fa_backward))
    monkeypatch.setattr(cuda_kernels, "_fa3", SimpleNamespace(_flash_attn_forward=fa3_forward,
                                                              _flash_attn_backward=fa_backward))
    monkeypatch.setattr(cuda_kernels, "_fa4", NEWEST_FA4)
    return state


# Stand-ins for flash-attn-4's interface, with the gates of its releases (flash_attn/cute/
# interface.py): the newest (August 2026), and October 2025's.

def _fa4_fwd_newest(q, k, v, return_lse=False, _arch=None):
    arch = _arch
    assert arch // 10 in [8, 9, 10, 11, 12], "Unsupported compute capability."


def _fa4_bwd_newest(q, k, v, out, dout, lse, deterministic=False):
    arch = 0
    assert arch // 10 in [9, 10, 11, 12], "Unsupported compute capability."
    assert arch // 10 in [9, 10, 11], "Learnable sink backward is supported on SM90 and SM100"


def _fa4_fwd_2025(q, k, v, return_lse=False):
    compute_capability = 0
    assert compute_capability in [9, 10], "Unsupported compute capability. Supported: 9.x, 10.x"


def _fa4_bwd_2025(q, k, v, out, dout, lse):
    compute_capability = 0
    assert compute_capability in [9, 10], "Unsupported compute capability. Supported: 9.x, 10.x"


NEWEST_FA4 = SimpleNamespace(_flash_attn_fwd=_fa4_fwd_newest, _flash_attn_bwd=_fa4_bwd_newest,
                             _validate_head_dims=_fa4_validate_head_dims)
FA4_2025 = SimpleNamespace(_flash_attn_fwd=_fa4_fwd_2025, _flash_attn_bwd=_fa4_bwd_2025)


def test_automatic_choice_admits_the_case_or_raises(gpu):
    chosen = {}
    for cap in CAPS:
        gpu["cap"] = cap
        for head_dim in HEAD_DIMS:
            for dtype in DTYPES:
                try:
                    backend = select_backend(CUDA, dtype, head_dim)
                except ValueError as e:
                    assert not _admits("sdpa_efficient", cap, head_dim, dtype), (cap, head_dim)
                    assert "use float16" in str(e)
                    continue
                assert _admits(backend, cap, head_dim, dtype), (backend, cap, head_dim, dtype)
                chosen[cap, head_dim, dtype] = backend
    # Pre-Ampere never gets a flash kernel; a head_dim not a multiple of 8 never does either.
    # The cases: a T4, a V100, an H100 at head_dim 100, an sm86 card at 224.
    assert chosen[(7, 5), 128, torch.float16] == "sdpa_efficient"
    assert chosen[(7, 0), 64, torch.float16] == "sdpa_efficient"
    assert chosen[(9, 0), 100, torch.bfloat16] == "sdpa_efficient"
    assert chosen[(7, 5), 64, torch.float16] == "sdpa_efficient"
    assert chosen[(8, 0), 100, torch.bfloat16] == "sdpa_efficient"
    assert chosen[(8, 6), 224, torch.bfloat16] == "flash_attn"  # the package's backward runs
    assert chosen[(9, 0), 128, torch.bfloat16] == "fa3"
    assert chosen[(10, 0), 256, torch.bfloat16] == "fa4"


@pytest.mark.parametrize("backend", ["sdpa_efficient", "sdpa_flash", "flash_attn",
                                     "sdpa_cudnn", "fa3", "fa4"])
def test_a_named_backend_is_refused_where_it_does_not_run(gpu, backend):
    for cap in CAPS:
        gpu["cap"] = cap
        for head_dim in HEAD_DIMS:
            for dtype in DTYPES:
                if _admits(backend, cap, head_dim, dtype):
                    check_supported(backend, CUDA, dtype, head_dim)
                else:
                    with pytest.raises(ValueError, match=backend):
                        check_supported(backend, CUDA, dtype, head_dim)


def test_the_efficient_backward_reads_lse_padded_with_inf():
    """torch's memory-efficient backward reads lse in blocks of 32 rows, unchecked."""
    lse = torch.randn(2, 3, 45)
    padded = cuda_sdpa.efficient_backward_lse(lse)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous()
    assert torch.equal(padded[..., :45], lse) and torch.isposinf(padded[..., 45:]).all()
    exact = torch.randn(1, 2, 64)
    assert torch.equal(cuda_sdpa.efficient_backward_lse(exact), exact)


def test_a_package_that_fails_to_import_is_named_with_its_error(monkeypatch):
    def collide():
        raise RuntimeError("Tried to register an operator with the same name")

    monkeypatch.setattr(cuda_kernels, "_IMPORT_ERRORS", {})
    assert cuda_kernels._optional("fa3", collide) is None
    monkeypatch.setattr(cuda_kernels, "_fa3", None)
    with pytest.raises(ValueError, match="cannot import flash_attn_interface.*RuntimeError"):
        check_supported("fa3", CUDA, torch.bfloat16, 128)


def test_fa4_gates_are_read_from_the_installed_release(gpu, monkeypatch):
    """An October 2025 flash-attn-4 asserts sm90/sm100 only and has no hd256 kernel: it is
    refused (and automatic choice moves on) where the newest would run."""
    for cap, head_dim in [((11, 0), 128), ((12, 0), 128), ((10, 0), 256)]:
        gpu["cap"] = cap
        check_supported("fa4", CUDA, torch.bfloat16, head_dim)  # the newest runs these
        monkeypatch.setattr(cuda_kernels, "_fa4", FA4_2025)
        with pytest.raises(ValueError, match="fa4"):
            check_supported("fa4", CUDA, torch.bfloat16, head_dim)
        assert select_backend(CUDA, torch.bfloat16, head_dim) != "fa4"
        monkeypatch.setattr(cuda_kernels, "_fa4", NEWEST_FA4)
    monkeypatch.setattr(cuda_kernels, "_fa4", FA4_2025)
    gpu["cap"] = (10, 0)
    check_supported("fa4", CUDA, torch.bfloat16, 128)
    with pytest.raises(ValueError, match=r"runs forward and backward on compute capability "
                                         r"9.x, 10.x only, got 11.0"):
        gpu["cap"] = (11, 0)
        check_supported("fa4", CUDA, torch.bfloat16, 128)
    # A release whose gates cannot be read is not guessed at.
    monkeypatch.setattr(cuda_kernels, "_fa4", SimpleNamespace(
        _flash_attn_fwd=lambda q, k, v, return_lse=False: None, _flash_attn_bwd=len))
    with pytest.raises(ValueError, match="cannot tell which GPUs"):
        check_supported("fa4", CUDA, torch.bfloat16, 128)


def test_deterministic_mode_is_honoured_or_refused(gpu, monkeypatch):
    """torch.use_deterministic_algorithms(True): cuDNN's backward has no deterministic mode
    (refused, never chosen); a package backward without ``deterministic`` is refused; the
    flash-attn packages are passed deterministic=True. warn_only keeps the usual kernels, as
    torch's own do."""
    gpu["cap"] = (9, 0)
    assert select_backend(CUDA, torch.bfloat16, 128) == "fa3"
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        monkeypatch.setattr(cuda_kernels, "_fa3", SimpleNamespace(
            _flash_attn_forward=cuda_kernels._fa3._flash_attn_forward,
            _flash_attn_backward=lambda dout, q, k, v: None))
        assert select_backend(CUDA, torch.bfloat16, 128) == "flash_attn"
        with pytest.raises(ValueError, match="sdpa_cudnn.*no deterministic backward"):
            check_supported("sdpa_cudnn", CUDA, torch.bfloat16, 128)
        with pytest.raises(ValueError, match="fa3.*takes no `deterministic`"):
            check_supported("fa3", CUDA, torch.bfloat16, 128)
        check_supported("sdpa_flash", CUDA, torch.bfloat16, 128)  # torch's FA2: deterministic dq
        seen = {}
        monkeypatch.setattr(cuda_kernels, "_fa", SimpleNamespace(
            _flash_attn_backward=lambda dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
            softmax_scale, causal, deterministic, rng_state: seen.update(
                det=deterministic, lse_contiguous=softmax_lse.is_contiguous())))
        t = torch.zeros(1, 4, 2, 8)
        strided_lse = torch.zeros(1, 4, 2).transpose(1, 2)  # FA2 reads lse as contiguous
        cuda_kernels._flash_attn_backward(t, t, t, t, t, strided_lse, True, 1.0)
        assert seen == {"det": True, "lse_contiguous": True}
        torch.use_deterministic_algorithms(True, warn_only=True)
        check_supported("sdpa_cudnn", CUDA, torch.bfloat16, 128)
        cuda_kernels._flash_attn_backward(t, t, t, t, t, strided_lse, True, 1.0)
        assert seen == {"det": False, "lse_contiguous": True}
    finally:
        torch.use_deterministic_algorithms(previous)


class _Recorder:
    """Stand-ins for the aten attention ops: which ran, and what the backward got."""

    def __init__(self):
        self.calls, self.lse = [], None

    def _scaled_dot_product_flash_attention(self, q, k, v, *a, **kw):
        self.calls.append("flash")
        B, H, S, D = q.shape
        return q.clone(), torch.zeros(B, H, S)

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, *a, **kw):
        self.calls.append("flash_backward")
        return q.clone(), k.clone(), v.clone()

    def _scaled_dot_product_cudnn_attention(self, q, k, v, *a, **kw):
        self.calls.append("cudnn")
        B, H, S, D = q.shape
        return q.clone(), torch.zeros(B, H, S, 1)

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, *a, **kw):
        self.calls.append("cudnn_backward")
        self.lse = lse
        return q.clone(), k.clone(), v.clone()


@pytest.mark.parametrize("Sq, Sk", [(1, 1), (1, 7)])
def test_cudnn_never_gets_a_single_query_or_key_row(monkeypatch, Sq, Sk):
    """pytorch#193893: cuDNN 9.19-9.25 corrupts one-row (decode-shaped) GQA pieces on
    Blackwell; a window of 2 or tiny ring blocks make such pieces. FA2 takes them."""
    aten = _Recorder()
    monkeypatch.setattr(cuda_sdpa, "_aten", aten)
    q, k = torch.randn(1, Sq, 4, 8), torch.randn(1, Sk, 2, 8)
    out, lse = cuda_sdpa.cudnn_forward(q, k, k, False, 1.0)
    cuda_sdpa.cudnn_backward(out, q, k, k, out, lse, False, 1.0)
    assert aten.calls == ["flash", "flash_backward"]
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    cuda_sdpa.cudnn_backward(q, q, k, k, q, torch.zeros(1, 4, 3), False, 1.0)
    assert aten.calls[-1] == "cudnn_backward"  # more than one row each: cuDNN's


def _read_like_efficient(out_BHSD: torch.Tensor) -> torch.Tensor:
    """out as the memory-efficient backward reads it (kernel_backward.h): batch and head
    through the tensor's strides, row m at ``m * num_heads * head_dim`` (``o_strideM()``)."""
    B, H, S, D = out_BHSD.shape
    flat = torch.as_strided(out_BHSD, (out_BHSD.untyped_storage().nbytes() // 4,), (1,), 0)
    st = out_BHSD.stride()
    got = torch.empty(B, H, S, D)
    for b in range(B):
        for h in range(H):
            for m in range(S):
                at = out_BHSD.storage_offset() + b * st[0] + h * st[1] + m * H * D
                got[b, h, m] = flat[at:at + D]
    return got


def test_efficient_backward_gets_out_with_the_row_stride_it_assumes(monkeypatch):
    """A head chunk's out is a slice of the wider output: its rows are H_total * D apart, and
    the kernel would read rows of other heads for it (on an H200: dq 43% wrong)."""
    seen = {}

    def backward(dout, q, k, v, bias, out, lse, *a, **kw):
        seen["read"], seen["out"] = _read_like_efficient(out), out.clone()
        return q.clone(), k.clone(), v.clone(), None

    monkeypatch.setattr(cuda_sdpa, "_aten", SimpleNamespace(
        _scaled_dot_product_efficient_attention_backward=backward))
    B, S, H, D = 2, 5, 6, 4
    wide = torch.randn(B, S, H, D)
    for out in (wide[:, :, 2:3], wide[:, :, 1:4], wide[:, 1:4], wide):
        h = out.shape[2]
        q, kv = torch.randn(B, out.shape[1], h, D), torch.randn(B, 3, 1, D)
        cuda_sdpa.efficient_backward(out, q, kv, kv, out, torch.zeros(B, h, out.shape[1]),
                                     False, 1.0)
        assert torch.equal(seen["read"], seen["out"])
        assert torch.equal(seen["out"], out.transpose(1, 2))


def _read_like_cudnn(lse_BHS1: torch.Tensor, ragged: bool) -> torch.Tensor:
    """Each (b, h, s) as cuDNN's backward reads it (MHA.cpp): through the tensor's strides, or
    in the ragged graph from a batch offset of ``b * S * stride(-2)``."""
    B, H, S, _ = lse_BHS1.shape
    flat = torch.as_strided(lse_BHS1, (lse_BHS1.untyped_storage().nbytes() // 4,), (1,), 0)
    st = lse_BHS1.stride()
    got = torch.empty(B, H, S)
    for b in range(B):
        base = b * S * st[2] if ragged else b * st[0]
        for h in range(H):
            for s in range(S):
                got[b, h, s] = flat[lse_BHS1.storage_offset() + base + h * st[1] + s * st[2]]
    return got


@pytest.mark.parametrize("ragged", [False, True], ids=["dense", "avoid-recompile"])
def test_cudnn_backward_lse_layout_follows_the_graph(monkeypatch, ragged):
    """TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 makes torch's cuDNN backward place batch rows by
    lse.stride(-2); a [B, H, S] lse would give every row after the first the wrong values."""
    monkeypatch.setattr(cuda_sdpa, "_cudnn_ragged_env", lambda: ragged)
    aten = _Recorder()
    monkeypatch.setattr(cuda_sdpa, "_aten", aten)
    B, S, H, D = 3, 5, 4, 8
    q, lse = torch.randn(B, S, H, D), torch.randn(B, H, S)
    kv = q[:, :, :2].contiguous()
    cuda_sdpa.cudnn_backward(q, q, kv, kv, q, lse, True, 1.0)
    assert torch.equal(_read_like_cudnn(aten.lse, ragged), lse)
    # torch takes the ragged graph only for BSHD-contiguous q, k, v: a strided piece is dense.
    cuda_sdpa.cudnn_backward(q, q[:, :2], q[:, :2], q[:, :2], q[:, :2], lse[..., :2],
                                      True, 1.0)
    assert aten.lse.is_contiguous()


def test_a_fetched_host_block_is_tied_to_the_copy_stream(monkeypatch):
    """host_blocks.fetch: the device block is written on the side stream; if the caller
    drops it (an exception) before get(), the allocator must not reuse its memory while the
    copy still runs, so the block is marked used by that stream (record_stream)."""
    from ulysses import host_blocks

    class Stream:
        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record_event(self):
            return SimpleNamespace(query=lambda: True, synchronize=lambda: None)

    side, marked = Stream(), []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: marked.append((self, stream)))
    blocks = host_blocks.HostBlocks(torch.empty(0))
    blocks._cuda, blocks._side = True, side
    host = torch.randn(4, 3)
    fetched = blocks.fetch(host)
    assert [(t is fetched._dev, s is side) for t, s in marked] == [(True, True)]
    assert torch.equal(fetched.get(), host)


@pytest.mark.parametrize("backend,op", [
    ("sdpa_efficient", "_scaled_dot_product_efficient_attention_backward"),
    ("sdpa_cudnn", "_scaled_dot_product_cudnn_attention_backward"),
    ("sdpa_flash", "_scaled_dot_product_flash_attention_backward")])
def test_cuda_kernels_get_16_byte_aligned_tensors(monkeypatch, backend, op):
    """A document piece of a one-head, one-row lse is a contiguous view 37 x 4 bytes into its
    storage; handed on as it is, it stopped an H200 with "misaligned address" in the
    memory-efficient backward. Every tensor reaching an aten kernel starts on a 16-byte
    boundary, with the piece's values."""
    seen = {}

    def kernel(*args, **kw):
        seen["ptrs"] = [a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor)]
        seen["lse"] = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 3
                           and a.dtype == torch.float32)
        grads = tuple(t.clone() for t in args[1:4])
        return grads + (None,) if backend == "sdpa_efficient" else grads

    monkeypatch.setattr(cuda_sdpa, "_aten", SimpleNamespace(**{op: kernel}))
    full_lse = torch.randn(1, 1, 128)
    lse = full_lse[:, :, 37:69]
    assert lse.is_contiguous() and lse.data_ptr() % 16 == 4
    q, dout, out = (torch.randn(1, 32, 1, 8, dtype=torch.float16) for _ in range(3))
    k = v = torch.randn(1, 32, 1, 8, dtype=torch.float16)
    attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=1.0,
                       backend=backend)
    assert seen["ptrs"] and all(p == 0 for p in seen["ptrs"]), seen["ptrs"]
    assert torch.equal(seen["lse"].reshape(-1)[:32], lse.reshape(-1))
