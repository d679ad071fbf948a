"""The CUDA backends' admission, from the rules torch and flash-attention enforce, over a
table of compute capabilities x head dims x dtypes (no GPU needed: the capability, the cuDNN
version and the installed packages are stood in for). Automatic selection returns a backend
that admits the case, or a ValueError; a named backend that does not admit it is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulysses import cuda_kernels
from ulysses.kernels import check_supported, select_backend

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

    def fa4_forward(q, k, v, return_lse=False):
        raise AssertionError("not run")

    monkeypatch.setattr(cuda_kernels, "_fa", SimpleNamespace())
    monkeypatch.setattr(cuda_kernels, "_fa3", SimpleNamespace(_flash_attn_forward=fa3_forward))
    monkeypatch.setattr(cuda_kernels, "_fa4", SimpleNamespace(_flash_attn_fwd=fa4_forward))
    return state


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
    padded = cuda_kernels.efficient_backward_lse(lse)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous()
    assert torch.equal(padded[..., :45], lse) and torch.isposinf(padded[..., 45:]).all()
    exact = torch.randn(1, 2, 64)
    assert torch.equal(cuda_kernels.efficient_backward_lse(exact), exact)


def test_a_package_that_fails_to_import_is_named_with_its_error(monkeypatch):
    def collide():
        raise RuntimeError("Tried to register an operator with the same name")

    monkeypatch.setattr(cuda_kernels, "_IMPORT_ERRORS", {})
    assert cuda_kernels._optional("fa3", collide) is None
    monkeypatch.setattr(cuda_kernels, "_fa3", None)
    with pytest.raises(ValueError, match="cannot import flash_attn_interface.*RuntimeError"):
        check_supported("fa3", CUDA, torch.bfloat16, 128)
