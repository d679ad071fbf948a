"""A check of each attention kernel at its first use in a process, against the float64 reference.

Kernel bugs are version-specific (a cuDNN release that corrupts GQA decode rows on one GPU
family, a flash-attn build whose backward reads past a buffer) and silent: the run goes on
with wrong gradients. So the first time a combination of (backend, device, dtype, head_dim,
mask features) runs in a process, :func:`verify` runs the same inner attention on a tiny
problem on that device, forward and backward, and compares it with the ``math`` backend on
float64 copies of the same inputs. The problem is chosen to reach the kernels' edge cases:
two batch rows, an odd length (45, not a multiple of 32 or 128), GQA (4 query heads on 2 kv
heads), and the sliding window, sinks and logit softcap when the call asks for them. A
mismatch is a ``ValueError`` naming the backend, the versions of torch, cuDNN and the
flash-attn packages, and what to do; the verdict is cached for the process (a failed one
raises again on every call), so the cost is paid once: a few milliseconds of kernels.

It runs before any collective of the call that asks, on each rank alone. It draws its inputs
from its own generator (the global RNG streams are untouched, so a run with the check gives
the same result as one without), uses no autograd (the kernels' own backward, as
:class:`ulysses.kernels._AttentionFn` calls it), runs outside the caller's dispatch modes (a
FLOP counter or memory tracker does not see it), and is skipped where nothing real runs: on
fake or meta tensors (the planner's traces), under ``torch.compile`` tracing and during CUDA
graph capture.

A mesh built with ``kernel_self_check=False`` (``ulysses.kernel_self_check: false`` in the
config) skips it for the attention on that mesh; ``local_attention`` and ``ring_attention`` take
``self_check=False``.
"""

from __future__ import annotations

import importlib.metadata
import time

import torch
from torch import Tensor

from ulysses.band import WindowAttention
from ulysses.kernels import LocalAttention, default_scale, observe_attention
from ulysses.sinks import apply_sinks, sinks_grad
from ulysses.torch_internals import disable_current_modes
from ulysses.trace_shortcuts import is_traced

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2,
             torch.bfloat16: 3e-2}
"""Largest error allowed, relative to the reference's largest magnitude (per tensor)."""

CHECK_LEN, CHECK_BATCH, CHECK_HEADS, CHECK_KV_HEADS = 45, 2, 4, 2
CHECK_WINDOW = 16
"""The window of a windowed check: shorter than the length, so the band's three kinds of
pieces all run (:mod:`ulysses.band`)."""

_verdicts: dict[tuple, str | None] = {}
"""(backend, device, dtype, head_dim, causal, windowed, sinks, softcap) -> None (passed) or the
message: what the installed kernels did on this device, a fact of the process that no
configuration changes (whether a call checks at all is the caller's: its mesh's
``kernel_self_check``)."""


def versions() -> str:
    """torch, cuDNN and the flash-attn packages installed, for an error message."""
    parts = [f"torch {torch.__version__}"]
    if torch.backends.cudnn.is_available():
        parts.append(f"cuDNN {torch.backends.cudnn.version()}")
    for dist_name in ("flash-attn", "flash-attn-3", "flash-attn-4", "flash_attn_3"):
        try:
            parts.append(f"{dist_name} {importlib.metadata.version(dist_name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def _inputs(device: torch.device, dtype: torch.dtype, head_dim: int, seq_len: int, batch: int,
            heads: int, kv_heads: int, sinks: bool) -> dict[str, Tensor | None]:
    """q, k, v, dout (and sinks) from a private generator: the global RNGs are not touched."""
    g = torch.Generator().manual_seed(1234)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu").to(
            device=device, dtype=dtype)

    q_shape, kv_shape = (batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim)
    return dict(q=rand(*q_shape), k=rand(*kv_shape), v=rand(*kv_shape), dout=rand(*q_shape),
                sinks=rand(heads).float() if sinks else None)


def _run(attn, t: dict[str, Tensor | None]) -> dict[str, Tensor]:
    """Forward and backward of ``attn`` (with sinks) as autograd would run them."""
    out, lse = attn.forward(t["q"], t["k"], t["v"])
    if t["sinks"] is not None:
        out, lse = apply_sinks(out, lse, t["sinks"])
    dq, dk, dv = attn.backward(t["dout"], t["q"], t["k"], t["v"], out, lse)
    result = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if t["sinks"] is not None:
        result["dsinks"] = sinks_grad(t["dout"], out, lse, t["sinks"])
    return result


def _attention(backend: str, head_dim: int, causal: bool, window: int | None, softcap: float):
    scale = default_scale(head_dim, None)
    if window is not None:
        return WindowAttention(window=window, scale=scale, backend=backend, softcap=softcap,
                               causal=causal)
    return LocalAttention(causal=causal, scale=scale, backend=backend, softcap=softcap)


def compare_with_reference(backend: str, device: torch.device, dtype: torch.dtype,
                           head_dim: int, *, seq_len: int = CHECK_LEN, batch: int = CHECK_BATCH,
                           heads: int = CHECK_HEADS, kv_heads: int = CHECK_KV_HEADS,
                           causal: bool = True, window: int | None = None,
                           sinks: bool = False, softcap: float = 0.0) -> dict:
    """Run ``backend`` once, forward and backward, and measure it against ``math`` in float64.

    Returns ``{"backend", "ok", "errors": {name: error}, "tolerance", "seconds"}``; each error
    is the largest absolute difference over the reference's largest magnitude, for ``out``,
    ``lse``, ``dq``, ``dk``, ``dv`` (and ``dsinks``). A kernel that raises propagates.
    """
    t = _inputs(device, dtype, head_dim, seq_len, batch, heads, kv_heads, sinks)
    start = time.perf_counter()
    with torch.no_grad():
        got = _run(_attention(backend, head_dim, causal, window, softcap), t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        wide = {k: None if v is None else v.double() for k, v in t.items()}
        ref = _run(_attention("math", head_dim, causal, window, softcap), wide)
    errors = {}
    for name, r in ref.items():
        g = got[name].double()
        if g.shape != r.shape:
            errors[name] = float("inf")
            continue
        errors[name] = float(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).nan_to_num(
            nan=float("inf")))
    tolerance = TOLERANCE[dtype]
    return dict(backend=backend, ok=all(e <= tolerance for e in errors.values()), errors=errors,
                tolerance=tolerance, seconds=seconds)


def _skipped(x: Tensor) -> bool:
    """Nothing real runs here: a fake or meta tensor, a compile trace, a CUDA graph capture."""
    if x.device.type == "meta" or is_traced(x) or torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def verify(backend: str, like: Tensor, *, causal: bool, window: int | None = None,
           sinks: bool = False, head_dim: int | None = None, softcap: float = 0.0) -> None:
    """Check ``backend`` on ``like``'s device and dtype, with ``head_dim`` (default: ``like``'s
    last dim), the first time this process runs it with these mask features (``causal``, a
    ``window``, ``sinks``); ``ValueError`` if it disagrees with the float64 reference or fails
    to run. ``math`` is the reference and is not checked."""
    if backend == "math":
        return
    head_dim = like.shape[-1] if head_dim is None else head_dim
    key = (backend, str(like.device), like.dtype, head_dim, causal, window is not None, sinks,
           softcap)
    if key not in _verdicts:  # once per combination; every later call is this lookup
        if _skipped(like):
            return
        # Out of sight of the caller's dispatch modes (FLOP counters, memory trackers) and
        # of an attention observer (arctic.plan.work): the check is not the model's work.
        with disable_current_modes(), observe_attention(None):
            _verdicts[key] = _verdict(backend, like.device, like.dtype, head_dim, causal,
                                      None if window is None else CHECK_WINDOW, sinks, softcap)
    if _verdicts[key] is not None:
        raise ValueError(_verdicts[key])


def verify_call(backend: str, like: Tensor, *, causal: bool, window: int | None, sinks: bool,
                ring: bool, head_dim: int | None = None, softcap: float = 0.0) -> None:
    """:func:`verify` for every mask a call runs its kernel with: a causal ring (``ring``)
    also runs unmasked blocks off the diagonal."""
    verify(backend, like, causal=causal, window=window, sinks=sinks, head_dim=head_dim,
           softcap=softcap)
    if ring and causal:
        verify(backend, like, causal=False, sinks=sinks, head_dim=head_dim, softcap=softcap)


def _verdict(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
             causal: bool, window: int | None, sinks: bool, softcap: float) -> str | None:
    case = (f"{dtype}, head_dim {head_dim}, {'causal' if causal else 'not causal'}"
            f"{', window' if window else ''}{', sinks' if sinks else ''}"
            f"{f', softcap {softcap:g}' if softcap else ''}, on {device}")
    fix = (f"Choose another kernel (attention_backend=..., ulysses.attention_backend in the "
           f"config; ulysses.BACKENDS lists them) or a release of the kernel's package that "
           f"passes; turning this check off (ulysses.kernel_self_check: false) would train "
           f"on the wrong results. Versions: {versions()}.")
    try:
        result = compare_with_reference(backend, device, dtype, head_dim, causal=causal,
                                         window=window, sinks=sinks, softcap=softcap)
    except Exception as e:  # a kernel that cannot run this case is as wrong as a bad result
        return (f"attention backend {backend!r} failed its first-use check ({case}): "
                f"{type(e).__name__}: {e}. {fix}")
    if result["ok"]:
        return None
    bad = ", ".join(f"{name} {err:.3g}" for name, err in result["errors"].items()
                    if not err <= result["tolerance"])
    return (f"attention backend {backend!r} disagrees with the float64 reference at its "
            f"first-use check ({case}, length {CHECK_LEN}, {CHECK_HEADS} query heads on "
            f"{CHECK_KV_HEADS} kv heads): largest relative errors {bad} (tolerance "
            f"{result['tolerance']:g}). {fix}")


def forget() -> None:
    """Drop the cached verdicts (tests; a process that changed its kernels' packages)."""
    _verdicts.clear()
