"""The calls of CUDA SDPA's attention kernels behind :mod:`ulysses.kernels`' ``(out, lse)``
interface (what each needs of the device: :mod:`ulysses.cuda_kernels`).

- ``sdpa_flash``: aten's flash kernel (FlashAttention-2), which takes H != K as it is;
- ``sdpa_efficient``: the memory-efficient kernel, given the chunk's kv heads repeated H / K
  times (:mod:`ulysses.gqa`);
- ``sdpa_cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its backward, which takes
  H != K as it is.

Shapes: q/out ``[B, S, H, D]``, k/v ``[B, S, K, D]``, lse ``[B, H, S]`` float32.
"""

from __future__ import annotations

import functools
import os
import torch
from ulysses.gqa import expand_kv, reduce_kv


_aten = torch.ops.aten  # the ops' module: tests stand a fake in for it


def flash_forward(q, k, v, causal, scale):
    # aten's flash kernel (FlashAttention-2) takes H != K directly.
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse


def flash_backward(dout, q, k, v, out, lse, causal, scale):
    Sq, Sk = q.shape[1], k.shape[1]
    # Dense (not varlen) inputs: no cumulative lengths. They must be undefined (None), as the
    # forward returns them: a defined empty tensor selects the varlen kernel, which reads a
    # batch of numel - 1 = -1 ("batch size must be positive", seen on an H100).
    # No dropout, so the RNG state is never read.
    rng = torch.empty(2, dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse, None, None, Sq, Sk, 0.0, causal, rng, rng, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def efficient_forward(q, k, v, causal, scale):
    k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
        scale=scale)
    # Some versions pad lse's last dim to a multiple of 32; callers get exactly [B, H, S].
    return out.transpose(1, 2), lse[..., :q.shape[1]].contiguous()


def efficient_backward_lse(lse_BHS: torch.Tensor) -> torch.Tensor:
    """The lse as the memory-efficient backward reads it: rows padded with +inf up to a
    multiple of 32. On sm75 and later that kernel reads lse in blocks of 32 query rows without
    a bounds check (``B2bGemm::accumApplyLSEToSmem``), relying on the forward's +inf padding
    (exp(score - inf) = 0); a trimmed lse would let it read whatever follows, and a -inf
    there turns a key block's dk/dv into NaN."""
    S = lse_BHS.shape[-1]
    padded = -(-S // 32) * 32
    if padded == S:
        return lse_BHS.contiguous()
    return torch.nn.functional.pad(lse_BHS, (0, padded - S), value=float("inf")).contiguous()


def efficient_backward_out(out_BSHD: torch.Tensor) -> torch.Tensor:
    """``out`` as the memory-efficient backward reads it: its kernel takes out's batch and
    head strides but not its row stride, which it computes as ``num_heads * head_dim``
    (``kernel_backward.h``, ``Params::o_strideM()``). A piece sliced from a wider output (a
    head chunk's heads, a ring block's rows of a strided view) would have other rows read for
    it, and the row sums ``delta = rowsum(dout * out)`` behind dq and dk go wrong (seen on an
    H200, torch 2.11: head-chunked dq 43% off). So the rows are made dense."""
    return out_BSHD.contiguous()


def efficient_backward(dout, q, k, v, out, lse, causal, scale):
    num_kv = k.shape[2]
    k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
        efficient_backward_out(out).transpose(1, 2), efficient_backward_lse(lse), seed, seed,
        0.0, [True, True, True, False], causal, scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, reduce_kv(dk, num_kv), reduce_kv(dv, num_kv)


def _cudnn_avoids_a_row(q, k) -> bool:
    """Pieces cuDNN is not given, FA2 is (same (out, lse); sdpa_cudnn's gates admit nothing FA2
    does not): a single key, which cuDNN rejects (sdp_utils.cpp check_cudnn_tensor_shapes),
    and a single query row, which cuDNN 9.19-9.25 corrupts with GQA on Blackwell
    (pytorch/pytorch#193893; torch refuses it from its check_cudnn_sdpa_decode on)."""
    return k.shape[1] == 1 or q.shape[1] == 1


@functools.lru_cache(maxsize=None)
def _cudnn_ragged_env() -> bool:
    """torch's TORCH_CUDNN_SDPA_AVOID_RECOMPILE switch, read as torch reads it (c10
    check_env: exactly "1"), once (torch keeps it in a static)."""
    return os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE") == "1"


def cudnn_backward_lse(lse_BHS: torch.Tensor, *bshd: torch.Tensor) -> torch.Tensor:
    """The lse as cuDNN's backward reads it, ``[B, H, S, 1]``.

    With TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 and q, k, v, out all BSHD-contiguous (and no
    bias), torch runs the ragged graph (MHA.cpp use_ragged_in_dense): its forward allocates
    lse as ``[B, S, H, 1].transpose(1, 2)`` and the backward places each batch row at
    ``b * S * lse.stride(-2)``. A plain ``[B, H, S, 1]`` has stride(-2) 1 there, so every
    batch row after the first would read the wrong rows: the lse is laid out as ``[B, S, H]``
    for that graph. Elsewhere the graph takes the tensor's own strides."""
    if _cudnn_ragged_env() and all(t.is_contiguous() for t in bshd):
        return lse_BHS.transpose(1, 2).contiguous().unsqueeze(-1).transpose(1, 2)
    return lse_BHS.contiguous().unsqueeze(-1)


def cudnn_forward(q, k, v, causal, scale):
    if _cudnn_avoids_a_row(q, k):
        return flash_forward(q, k, v, causal, scale)
    # [B, S, H|K, D] -> [B, H|K, S, D] views: the cuDNN graph takes any strides, and K from k.
    out_BHSD, lse_BHS1, *_ = _aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False,
        scale=scale)
    # out is allocated in q's memory order (MHA.cpp alloc_with_matching_layout), so the
    # transpose back is BSHD-contiguous. lse: [B, H, S, 1] -> [B, H, S] (contiguous: the
    # ragged graph of TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 returns it strided as [B, S, H]).
    B, H, S, _ = out_BHSD.shape
    return out_BHSD.transpose(1, 2), lse_BHS1.reshape(B, H, S).contiguous()


def cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    Sq, Sk = q.shape[1], k.shape[1]
    if _cudnn_avoids_a_row(q, k):
        return flash_backward(dout, q, k, v, out, lse, causal, scale)
    # cuDNN caches the backward graph by q/k/v shapes and strides only (MHA.cpp
    # MHACacheKeyWrapper), and before 9.5.1 wants dout strided like out: both contiguous, so
    # their strides follow from the shapes. Undefined (None) cum_seq_* select the dense path
    # (attention_backward.cu _cudnn_attention_backward). No dropout, so the seed and offset are
    # never read, but must be defined tensors (on sm100 they are cast to int64 regardless).
    out, dout = out.contiguous(), dout.contiguous()
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), cudnn_backward_lse(lse, q, k, v, out), seed, seed, None, None, None,
        Sq, Sk, 0.0, causal, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
