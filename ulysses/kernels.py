"""Local attention kernels that return ``(out, lse)`` and a backward that takes ``lse``.

Every kernel uses the flash-attn layout: ``q_BSHD`` (B batch, S sequence, H query heads,
D head dim), ``k_BSKD``/``v_BSKD`` with K kv heads, ``H % K == 0`` and query head ``i`` reading
kv head ``i // (H // K)``. ``lse_BHS`` is the float32 log-sum-exp of each query row's scaled
scores; ring merging and chunk recomputation rely on it.

Backends (pick one by name, or let :func:`select_backend` choose by device and dtype):

- ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA
  native from torch 2.9, kv heads repeated before);
- ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``flash_attn``, ``fa3``, ``fa4``: the
  CUDA kernels of :mod:`ulysses.cuda_kernels` (SDPA's FlashAttention-2, memory-efficient and
  cuDNN kernels; the flash-attn packages 2, 3 and 4);
- ``math``: an explicit float64 reference (S x S scores in memory; for tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ulysses import cuda_kernels
from ulysses.gqa import expand_kv, reduce_kv
from ulysses.keep import kept_or_computed
from ulysses.sinks import apply_sinks, sinks_grad
from ulysses.softcap import softcap_backward, softcap_forward

Backend = Literal["cpu_flash", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "fa3",
                  "fa4", "math"]
BACKENDS: tuple[str, ...] = ("cpu_flash", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
                             "flash_attn", "fa3", "fa4", "math")

_aten = torch.ops.aten
# CPU flash attention handles H != K natively from torch 2.9 (pytorch/pytorch#157893).
_CPU_FLASH_NATIVE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 9)


# --- what runs where -------------------------------------------------------------------------

def _problem(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``backend`` cannot run on this device, dtype and head dim; None when it can."""
    if backend == "math":
        return None
    if backend == "cpu_flash":
        return None if device.type == "cpu" else f"needs a CPU tensor, got {device.type}"
    return cuda_kernels.problem(backend, device, dtype, head_dim)


def check_supported(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Raise ``ValueError`` if ``backend`` cannot run on this device, dtype and head dim."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    problem = _problem(backend, device, dtype, head_dim)
    if problem:
        raise ValueError(f"attention backend {backend!r} {problem}")


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                   name: str | None = None) -> str:
    """The backend named by ``name`` (checked), or the fastest one for this device and dtype
    (on CUDA fp16/bf16: :func:`ulysses.cuda_kernels.order`).

    Called for every attention call: the device capability and cuDNN version are looked up
    once (cached), the rest is a few comparisons.
    """
    if name is not None:
        check_supported(name, device, dtype, head_dim)
        return name
    if device.type == "cpu":
        return "cpu_flash"
    if device.type != "cuda":
        return "math"
    if dtype not in (torch.float16, torch.bfloat16):
        return "math" if dtype == torch.float64 else "sdpa_efficient"
    for backend in cuda_kernels.order(device) + ("sdpa_efficient",):
        if _problem(backend, device, dtype, head_dim) is None:
            return backend
    raise ValueError(f"no CUDA attention backend runs {dtype} with head_dim {head_dim} on this "
                     f"GPU: {_problem('sdpa_efficient', device, dtype, head_dim)} "
                     f"(sdpa_efficient, the last resort); use float16")


# --- cpu_flash ------------------------------------------------------------------------------

def _cpu_flash_forward(q, k, v, causal, scale):
    if not _CPU_FLASH_NATIVE_GQA:
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    # [B, S, H, D] -> [B, H, S, D] views; the kernel reads strided inputs.
    out_BHSD, lse_BHS = _aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out_BHSD.transpose(1, 2), lse_BHS


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    num_kv = k.shape[2]
    if not _CPU_FLASH_NATIVE_GQA:
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse, 0.0, causal, scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, reduce_kv(dk, num_kv), reduce_kv(dv, num_kv)



# --- math (float64 reference) ----------------------------------------------------------------

def _math_scores(q, k, causal, scale, softcap=0.0):
    """fp64 ``q64_BHSD``, ``k64_BHSD`` (kv expanded), masked scores ``scale * q k^T`` (capped
    to ``softcap * tanh(z / softcap)`` when ``softcap``) and the cap's derivative."""
    q64 = q.double().transpose(1, 2)                                 # [B, H, Sq, D]
    k64 = expand_kv(k.double(), q.shape[2]).transpose(1, 2)         # [B, H, Sk, D]
    scores = q64 @ k64.transpose(-1, -2) * scale                     # [B, H, Sq, Sk]
    slope = None
    if softcap:
        t = torch.tanh(scores / softcap)
        scores, slope = t * softcap, 1 - t * t
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return q64, k64, scores, slope


def _math_forward(q, k, v, causal, scale, softcap=0.0):
    _, _, scores, _ = _math_scores(q, k, causal, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)                            # [B, H, Sq]
    v64 = expand_kv(v.double(), q.shape[2]).transpose(1, 2)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ v64).transpose(1, 2)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def _math_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0):
    # P comes from the given lse, not a fresh softmax: the same contract as the fused kernels,
    # so a wrong lse shows up as a wrong gradient.
    q64, k64, scores, slope = _math_scores(q, k, causal, scale, softcap)
    probs = torch.exp(scores - lse.double().unsqueeze(-1))
    v64 = expand_kv(v.double(), q.shape[2]).transpose(1, 2)
    do64 = dout.double().transpose(1, 2)
    dv = probs.transpose(-1, -2) @ do64                              # [B, H, Sk, D]
    dp = do64 @ v64.transpose(-1, -2)                                # [B, H, Sq, Sk]
    delta = (do64 * out.double().transpose(1, 2)).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    if slope is not None:
        ds = ds * slope
    dq = (ds @ k64 * scale).transpose(1, 2)
    dk = (ds.transpose(-1, -2) @ q64 * scale).transpose(1, 2)
    num_kv = k.shape[2]
    return (dq.to(q.dtype), reduce_kv(dk, num_kv).to(k.dtype),
            reduce_kv(dv.transpose(1, 2), num_kv).to(v.dtype))


_FORWARD = {"cpu_flash": _cpu_flash_forward, **cuda_kernels.FORWARD, "math": _math_forward}
_BACKWARD = {"cpu_flash": _cpu_flash_backward, **cuda_kernels.BACKWARD, "math": _math_backward}


def common_head_dim(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """q, k and v at one head dim, and v's own: ``(q, k, v, value_dim)``.

    Multi-head latent attention (DeepSeek-V2/V3, Kimi) gives v a head dim of its own (128
    against q/k's 192). The kernels here take one head dim, so the narrower side is padded
    with zeros: zero columns of v give zero output columns (sliced off by the caller: ``out[...,
    :value_dim]``), and zero columns of q and k add nothing to the scores. Both are exact,
    forward and backward (the pad's gradient is the slice). The softmax scale must come from
    q's own head dim, taken before this call. Unchanged tensors (no copy) when the dims agree.
    """
    D, Dv = q.shape[-1], v.shape[-1]
    if Dv < D:
        v = torch.nn.functional.pad(v, (0, D - Dv))
    elif Dv > D:
        q, k = (torch.nn.functional.pad(t, (0, Dv - D)) for t in (q, k))
    return q, k, v, Dv


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


_SOFTCAP_FORWARD = {"math": _math_forward, **cuda_kernels.SOFTCAP_FORWARD}
_SOFTCAP_BACKWARD = {"math": _math_backward, **cuda_kernels.SOFTCAP_BACKWARD}
"""Backends whose own kernel applies a logit softcap (flash-attn 2 and 3, the reference);
every other backend's softcapped calls run :mod:`ulysses.softcap`'s blockwise kernel."""


_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("attention_observer", default=None)
"""A callable ``(direction, q, k, v, causal, backend)`` that returns a context around each
kernel call (:func:`observe_attention`); None: none."""


@contextlib.contextmanager
def observe_attention(observer):
    """Call ``observer(direction, q, k, v, causal, backend)`` at every kernel call inside the
    block (``direction``: ``"forward"`` or ``"backward"``), the call running inside the
    context it returns: how :mod:`arctic.plan.work` counts attention's work by kernel call,
    whatever the backend computes it with."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def _observed(direction: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str):
    observer = _OBSERVER.get()
    return (contextlib.nullcontext() if observer is None
            else observer(direction, q, k, v, causal, backend))


def attention_forward(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool,
                      softmax_scale: float, backend: str,
                      softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """Run ``backend``'s forward. Returns ``(out_BSHD, lse_BHS)``; ``lse`` is float32.

    ``causal`` needs ``Sq == Sk`` (the backends disagree on how to align a rectangular mask);
    :func:`check_qkv` enforces it. ``softcap``: scores ``z`` become ``softcap * tanh(z /
    softcap)`` inside the softmax (0: none).
    """
    with _observed("forward", q_BSHD, k_BSKD, v_BSKD, causal, backend):
        return _attention_forward(q_BSHD, k_BSKD, v_BSKD, causal=causal,
                                  softmax_scale=softmax_scale, backend=backend, softcap=softcap)


def _attention_forward(q_BSHD, k_BSKD, v_BSKD, *, causal, softmax_scale, backend, softcap):
    if softcap:
        forward = _SOFTCAP_FORWARD.get(backend, softcap_forward)
        return forward(q_BSHD, k_BSKD, v_BSKD, causal, softmax_scale, softcap)
    return _FORWARD[backend](q_BSHD, k_BSKD, v_BSKD, causal, softmax_scale)


def attention_backward(dout_BSHD: Tensor, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                       out_BSHD: Tensor, lse_BHS: Tensor, *, causal: bool, softmax_scale: float,
                       backend: str, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Run ``backend``'s backward from the forward's ``out`` and ``lse``.

    Returns ``(dq_BSHD, dk_BSKD, dv_BSKD)``, shaped like ``q``, ``k``, ``v``.
    """
    with _observed("backward", q_BSHD, k_BSKD, v_BSKD, causal, backend):
        return _attention_backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS,
                                   causal=causal, softmax_scale=softmax_scale, backend=backend,
                                   softcap=softcap)


def _attention_backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, *, causal,
                        softmax_scale, backend, softcap):
    if softcap:
        backward = _SOFTCAP_BACKWARD.get(backend, softcap_backward)
        return backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, causal,
                        softmax_scale, softcap)
    return _BACKWARD[backend](dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, causal,
                              softmax_scale)


@dataclass(frozen=True, slots=True)
class LocalAttention:
    """Single-rank attention as an object with ``forward``/``backward``: the inner step of
    Ulysses. :class:`ulysses.ring.RingAttention` has the same two methods, so the Ulysses
    exchange (plain or head-chunked) wraps either one.
    """

    causal: bool
    scale: float
    backend: str
    kv_len: int | None = None
    """Attend to the first ``kv_len`` keys only (a padded tail); ``None``: all keys."""
    softcap: float = 0.0
    """Logit softcapping inside the softmax (:func:`attention_forward`); 0: none."""

    def forward(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(out_BSHD, lse_BHS)``."""
        n = self.kv_len
        if n is not None:
            k_BSKD, v_BSKD = k_BSKD[:, :n], v_BSKD[:, :n]
        return attention_forward(q_BSHD, k_BSKD, v_BSKD, causal=self.causal,
                                 softmax_scale=self.scale, backend=self.backend,
                                 softcap=self.softcap)

    def backward(self, dout_BSHD: Tensor, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                 out_BSHD: Tensor, lse_BHS: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(dq, dk, dv)`` shaped like ``q, k, v``; keys past ``kv_len`` get zero."""
        n, S = self.kv_len, k_BSKD.shape[1]
        if n is not None:
            k_BSKD, v_BSKD = k_BSKD[:, :n], v_BSKD[:, :n]
        dq, dk, dv = attention_backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS,
                                        causal=self.causal, softmax_scale=self.scale,
                                        backend=self.backend, softcap=self.softcap)
        if n is not None and n < S:
            # [B, n, K, D] -> [B, S, K, D]: unattended keys have zero gradient.
            dk, dv = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, S - n)) for t in (dk, dv))
        return dq, dk, dv


class _AttentionFn(torch.autograd.Function):
    """Autograd around any inner attention (``LocalAttention``, ``RingAttention``, ...), with
    optional attention sinks (:mod:`ulysses.sinks`) folded into its ``(out, lse)``."""

    @staticmethod
    def forward(ctx, q, k, v, attn, sinks):
        def compute():
            out, lse = attn.forward(q, k, v)
            return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)

        # In a checkpointed layer's recompute with kept attention: the forward's result.
        out, lse = kept_or_computed(("attention", tuple(q.shape), tuple(k.shape), q.dtype),
                                    compute)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.attn = attn
        ctx.mark_non_differentiable(lse)
        # lse has no gradient; without this autograd would hand backward a zero-filled
        # [B, H, S] fp32 tensor for it, allocated at the peak of the backward pass.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.attn.backward(dout, q, k, v, out, lse)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            dsinks = sinks_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq, dk, dv, None, dsinks


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn,
                       sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``attn.forward`` with autograd (through ``attn.backward``); lse is not differentiable.
    ``sinks`` (``[H]``, one per query head of ``q``) are applied to the result and get a
    gradient."""
    return _AttentionFn.apply(q, k, v, attn, sinks)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False) -> None:
    """Raise ``ValueError`` unless q, k, v are [B, S, H|K, D] tensors that fit together (v's
    head dim may differ: multi-head latent attention, see :func:`common_head_dim`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, sequence and heads, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and "
                         f"head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]})")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs equal q and kv lengths, got {q.shape[1]} and "
                         f"{k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
