"""The CUDA attention backends behind :mod:`ulysses.kernels`' ``(out, lse)`` interface, and
what each needs of the device.

- ``sdpa_flash`` / ``sdpa_efficient``: CUDA SDPA's flash (FlashAttention-2) and
  memory-efficient kernels (their calls: :mod:`ulysses.cuda_sdpa`);
- ``sdpa_cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its backward (cuDNN >= 9,
  sm80-sm121, head_dim a multiple of 8 up to 128). It takes H != K as it is (the cuDNN graph
  reads K from k's shape), so GQA costs nothing extra;
- ``flash_attn``: the ``flash_attn`` package (FlashAttention-2), when it is importable;
- ``fa3``: FlashAttention-3 (``flash_attn_interface``, the ``hopper/`` build), sm90;
- ``fa4``: FlashAttention-4 (``flash_attn.cute``, PyPI ``flash-attn-4``), sm90-sm120.

The flash kernels and cuDNN take GQA natively; ``sdpa_efficient`` repeats the kv heads of the
chunk it is given, H / K times its k and v (:mod:`ulysses.gqa`).

``torch.nn.attention.activate_flash_attention_impl("FA3")`` (or ``"FA4"``) is another way to
reach the same kernels: it re-registers aten's flash-attention ops process-wide, so
``sdpa_flash`` then runs FA3/FA4 (and raises where they do not apply). ``fa3``/``fa4`` here
choose per call and change nothing global.
"""

from __future__ import annotations

import functools
import inspect
import re
import torch
from ulysses.cuda_sdpa import (cudnn_backward, cudnn_forward, efficient_backward,
                               efficient_forward, flash_backward, flash_forward)


_IMPORT_ERRORS: dict[str, str] = {}
"""Why an installed kernel package could not be imported, by backend (shown when it is named)."""


def _optional(backend: str, load):
    """The module ``load()`` imports, or None. Not only ImportError: FA3 builds from July to
    August 2025 register op names that collide with FA2 2.7 and later, which raises a
    RuntimeError at import; any failure means the package is not usable here."""
    try:
        return load()
    except ImportError:
        return None
    except Exception as e:  # pragma: no cover - a broken or colliding install
        _IMPORT_ERRORS[backend] = f"{type(e).__name__}: {e}"
        return None


def _load_fa():  # pragma: no cover - not installed on CPU CI
    from flash_attn import flash_attn_interface
    return flash_attn_interface


def _load_fa3():  # pragma: no cover - FlashAttention-3, built from flash-attention's hopper/
    import flash_attn_interface
    return flash_attn_interface


def _load_fa4():  # pragma: no cover - FlashAttention-4, PyPI flash-attn-4
    from flash_attn.cute import interface
    return interface


_fa = _optional("flash_attn", _load_fa)


_fa3 = _optional("fa3", _load_fa3)


_fa4 = _optional("fa4", _load_fa4)


def flash_attn_available() -> bool:
    return _fa is not None


_NO_CUDA = (0, 0)
"""The capability of a torch without CUDA: nothing runs, and the planner traces CUDA steps on
fake tensors there with the flash kernels' shapes, so the capability gates stay open."""


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device, looked up once per device; ``(0, 0)`` when this
    torch has no CUDA (no CUDA kernel runs then, whatever is selected)."""
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _cudnn_version() -> int:
    """The runtime cuDNN version as torch reports it (9.15.1 -> 91501); 0 without cuDNN."""
    return torch.backends.cudnn.version() or 0


def _head_dim_problem(head_dim: int, limit: int, also: int | None = None) -> str | None:
    if head_dim % 8 == 0 and (head_dim <= limit or head_dim == also):
        return None
    extra = "" if also is None else f" (or {also})"
    return f"needs head_dim a multiple of 8 and <= {limit}{extra}, got {head_dim}"


def _cuda_problem(backend: str, cap: tuple[int, int], head_dim: int) -> str | None:
    """Why a CUDA fp16/bf16 ``backend`` cannot run on a device of compute capability ``cap``."""
    arch = f"{cap[0]}.{cap[1]}"
    if backend == "sdpa_flash":
        # torch's own gates (sdp_utils.cpp): check_flash_attention_hardware_support admits
        # sm80 to sm121; the kernel needs head_dim % 8 == 0 and <= 256; and the backward
        # (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120) refuses
        # 192 < head_dim <= 224 on sm86, sm89 and sm120. Training always runs the backward.
        if cap != _NO_CUDA and not (8, 0) <= cap <= (12, 1):
            return f"needs compute capability 8.0 to 12.1, got {arch}"
        if cap in ((8, 6), (8, 9), (12, 0)) and 192 < head_dim <= 224:
            return (f"cannot run the backward for 192 < head_dim <= 224 on sm{cap[0]}"
                    f"{cap[1]}, got {head_dim}")
        return _head_dim_problem(head_dim, 256)
    if backend == "flash_attn":
        # FlashAttention-2 runs on Ampere and later, head_dim % 8 == 0 (2.7+) and <= 256.
        if _NO_CUDA < cap < (8, 0):
            return f"needs compute capability 8.0 or later (Ampere), got {arch}"
        return _head_dim_problem(head_dim, 256)
    if backend == "sdpa_cudnn":
        # torch's own gates (sdp_utils.cpp can_use_cudnn_attention, check_cudnn_tensor_shapes);
        # head_dim 256 needs cuDNN > 9.22 and a cudnn-frontend build that Python cannot see.
        if _cudnn_version() < 90000:
            return f"needs cuDNN >= 9.0, this torch reports {_cudnn_version() or 'none'}"
        if not (8, 0) <= cap <= (12, 1):
            return f"needs compute capability 8.0 to 12.1, got {arch}"
        return _head_dim_problem(head_dim, 128)
    if backend == "fa3":
        if "k_new" not in _params(_fa3._flash_attn_forward):
            return "needs a FlashAttention-3 build from 2025 or later (this is the 2024 beta)"
        if cap[0] != 9:
            return f"needs a Hopper GPU (compute capability 9.x), got {arch}"
        return _head_dim_problem(head_dim, 256)
    return _fa4_problem(cap, head_dim)


_ARCH_GATE = re.compile(r"assert\s+(?:arch\s*//\s*10|compute_capability)\s+in\s+\[([\d,\s]+)\]")
"""flash-attn-4's own capability check, first in its ``_flash_attn_fwd`` and ``_flash_attn_bwd``:
``assert compute_capability in [9, 10]`` (October 2025), ``assert arch // 10 in [9, 10, 11]``
(February 2026), ``[9, 10, 11, 12]`` (sm120, March 2026), ``[8, 9, 10, 11, 12]`` (forward)."""


@functools.lru_cache(maxsize=None)
def _declared_majors(fn) -> frozenset[int] | None:
    """The compute-capability majors a flash-attn-4 entry point admits, read from its own
    first capability assert; None when its source cannot be read or has none."""
    try:
        source = inspect.getsource(getattr(fn, "_init_fn", fn))
    except (OSError, TypeError):
        return None
    found = _ARCH_GATE.search(source)
    return None if found is None else frozenset(int(x) for x in found.group(1).split(","))


def _fa4_problem(cap: tuple[int, int], head_dim: int) -> str | None:
    """flash-attn-4's gates, read from the installed release rather than assumed from the
    newest: lse from the forward (``return_lse``), the capabilities its forward and backward
    assert, and the head dims its ``_validate_head_dims`` admits (sm90, sm100/sm110; from
    March 2026, head_dim 256 on sm100/sm110 from late April 2026). Releases without that
    validator, and sm12x which it does not cover, keep head_dim <= 128."""
    if "return_lse" not in _params(_fa4._flash_attn_fwd):
        return "needs a flash-attn-4 whose forward can return lse (October 2025 or later)"
    majors = [_declared_majors(_fa4._flash_attn_fwd), _declared_majors(_fa4._flash_attn_bwd)]
    if None in majors:
        return ("cannot tell which GPUs this flash-attn-4 release runs on (no capability check "
                "found in its _flash_attn_fwd/_flash_attn_bwd source); name another backend")
    runs = sorted(majors[0] & majors[1])
    if cap[0] not in runs:
        return (f"this flash-attn-4 release runs forward and backward on compute capability "
                f"{', '.join(f'{m}.x' for m in runs)} only, got {cap[0]}.{cap[1]}")
    validate = getattr(_fa4, "_validate_head_dims", None)
    if validate is None or cap[0] not in (9, 10, 11) or head_dim % 8:
        return _head_dim_problem(head_dim, 128)
    try:  # (head_dim, head_dim_v, major, alignment: 16 bytes of fp16/bf16)
        validate(head_dim, head_dim, cap[0], 8)
    except AssertionError as e:
        return f"does not take head_dim {head_dim} on sm{cap[0]}x: {str(e).splitlines()[0]}"
    return None


def deterministic() -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)`` asks for deterministic kernels.
    With ``warn_only=True`` torch's own attention backwards run their usual (atomic) kernels
    and warn (attention_backward.cu), and so do the packages' here."""
    return (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled())


_BACKWARDS = {"flash_attn": lambda: _fa._flash_attn_backward,
              "fa3": lambda: _fa3._flash_attn_backward, "fa4": lambda: _fa4._flash_attn_bwd}


def _determinism_problem(backend: str) -> str | None:
    """Deterministic mode: torch's flash and memory-efficient backwards honour it themselves
    (attention_backward.cu: FA2's deterministic dq, one key split); its cuDNN backward does
    not (it only warns under warn_only); the flash-attn packages do when their backward takes
    ``deterministic``, which is then passed."""
    if backend == "sdpa_cudnn":
        return ("has no deterministic backward (torch runs cuDNN's usual one under "
                "torch.use_deterministic_algorithms(True)); use sdpa_flash or sdpa_efficient")
    if backend in _BACKWARDS and "deterministic" not in _params(_BACKWARDS[backend]()):
        return ("cannot run deterministically: this release's backward takes no "
                "`deterministic` argument (torch.use_deterministic_algorithms(True) is on)")
    return None


def problem(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the CUDA ``backend`` cannot run on this device, dtype and head dim (and, under
    ``torch.use_deterministic_algorithms(True)``, deterministically); None if it can."""
    missing = {"flash_attn": _fa, "fa3": _fa3, "fa4": _fa4}
    if backend in missing and missing[backend] is None:
        package = {"flash_attn": "flash_attn", "fa3": "flash_attn_interface (FlashAttention-3)",
                   "fa4": "flash_attn.cute (FlashAttention-4, flash-attn-4)"}[backend]
        if backend in _IMPORT_ERRORS:
            return f"cannot import {package}: {_IMPORT_ERRORS[backend]}"
        return f"{package} is not installed"
    if device.type != "cuda":
        return f"needs a CUDA tensor, got {device.type}"
    if deterministic() and (why := _determinism_problem(backend)):
        return why
    if backend == "sdpa_efficient":
        # sdp_utils.cpp check_mem_efficient_hardware_support: bf16 from sm80 only
        cap = _capability(device)
        if dtype == torch.bfloat16 and _NO_CUDA < cap < (8, 0):
            return f"needs compute capability 8.0 or later for bf16, got {cap[0]}.{cap[1]}"
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {dtype}"
    return _cuda_problem(backend, _capability(device), head_dim)


def order(device: torch.device) -> tuple[str, ...]:
    """CUDA fp16/bf16 backends for this device, fastest first.

    H100, causal bf16 forward + backward: SDPA's flash kernel (FlashAttention-2) runs at about
    320 TFLOP/s, cuDNN at about 540, FA3 at 560-600 (published); FA4 is FA3's successor for
    Blackwell (sm100). cuDNN comes in only where torch itself prefers it
    (sdp_utils.cpp check_prefer_cudnn_attention: sm90, sm100, sm103 with cuDNN > 9.15.0);
    older cuDNN read out of bounds for sequence lengths not divisible by 128
    (pytorch/pytorch#169849).
    """
    cap = _capability(device)
    cudnn = ("sdpa_cudnn",) if cap in ((9, 0), (10, 0), (10, 3)) and _cudnn_version() > 91500 \
        else ()
    first = ("fa4",) if cap[0] >= 10 else ("fa3",) if cap[0] == 9 else ()
    return first + cudnn + ("flash_attn", "sdpa_flash")


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset[str]:
    """Parameter names of a flash-attn internal. FA3 wraps its own in torch.library.custom_op
    (late 2025 on), whose call signature is (*args, **kwargs); the function is ``_init_fn``."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


# Keywords whose value is what a release without them does anyway: dropped when not taken.
_NEUTRAL = {"dropout_p": 0.0, "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
            "return_softmax": False, "deterministic": False, "sm_margin": 0}


_ALIASES = (("causal", "is_causal"),)
"""Names of one argument across releases: one of each group must be taken."""


def _fa_call(fn, **arguments):
    """Call a flash-attn internal whose signature differs across releases.

    Where it takes ``window_size`` (FA2 <= 2.6, FA3 before late 2025) the left and right sizes
    are passed as that tuple. A keyword it does not take is dropped only when its value
    changes nothing (None, or a neutral value in :data:`_NEUTRAL`) or another name of it
    (:data:`_ALIASES`) is taken; any other is a ``ValueError`` naming the release's gap, so a
    renamed argument (the scale, say) can never be dropped silently."""
    params = _params(fn)
    if "window_size" in params and "window_size_left" in arguments:
        arguments["window_size"] = (arguments.pop("window_size_left"),
                                    arguments.pop("window_size_right"))
    aliased = {name for group in _ALIASES if any(n in params for n in group) for name in group}
    lost = sorted(k for k, v in arguments.items() if k not in params and v is not None and
                  k not in aliased and not (k in _NEUTRAL and _NEUTRAL[k] == v))
    if lost:
        raise ValueError(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', fn)} does "
                         f"not take {lost}: this flash-attn release is not supported; use "
                         f"another attention_backend")
    return fn(**{k: v for k, v in arguments.items() if k in params})


def _flash_attn_forward(q, k, v, causal, scale, softcap=0.0):  # pragma: no cover - CUDA + FA2
    res = _fa_call(_fa._flash_attn_forward, q=q.contiguous(), k=k.contiguous(),
                   v=v.contiguous(), dropout_p=0.0, softmax_scale=scale, causal=causal,
                   window_size_left=-1, window_size_right=-1, softcap=softcap, alibi_slopes=None,
                   return_softmax=False)
    # >= 2.7 returns (out, lse, S_dmask, rng_state); <= 2.6 returns (out, q, k, v, out_padded,
    # lse, S_dmask, rng_state).
    out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa_call(_fa._flash_attn_backward, dout=dout.contiguous(), q=q.contiguous(),
             k=k.contiguous(), v=v.contiguous(), out=out.contiguous(), softmax_lse=lse.contiguous(),
             dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
             window_size_left=-1, window_size_right=-1, softcap=softcap, alibi_slopes=None,
             deterministic=deterministic(), rng_state=None)
    return dq, dk, dv


def _fa3_forward(q, k, v, causal, scale, softcap=0.0):  # pragma: no cover - sm90 + FA3
    # hopper/flash_attn_interface.py _flash_attn_forward: releases before late 2025 take every
    # argument positionally with no default, and the newest names the output ``out_``.
    none = dict.fromkeys(("k_new", "v_new", "qv", "out", "out_", "cu_seqlens_q", "cu_seqlens_k",
                          "cu_seqlens_k_new", "seqused_q", "seqused_k", "max_seqlen_q",
                          "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos",
                          "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale"))
    res = _fa_call(_fa3._flash_attn_forward, q=q, k=k, v=v, **none, softmax_scale=scale,
                   causal=causal, window_size_left=-1, window_size_right=-1, softcap=softcap)
    return res[0], res[1]  # (out, softmax_lse [B, H, S] fp32, *accumulators)


def _fa3_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0):  # pragma: no cover
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    none = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q",
                          "max_seqlen_k"))
    # ``causal`` became ``is_causal`` in late 2025; dq, dk, dv are written in place.
    _fa_call(_fa3._flash_attn_backward, dout=dout, q=q, k=k, v=v, out=out,
             softmax_lse=lse.contiguous(), **none, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
             causal=causal, is_causal=causal, window_size_left=-1, window_size_right=-1,
             softcap=softcap, deterministic=deterministic(), sm_margin=0)
    return dq, dk, dv


def _fa4_forward(q, k, v, causal, scale):  # pragma: no cover - needs sm90+ + flash-attn-4
    # flash_attn/cute/interface.py _flash_attn_fwd: lse only when asked for (or grad is on);
    # returns (out, lse), or (out, lse, p, row_max) in 2026 releases. Contiguous inputs keep
    # the JIT-compiled kernels' cache keys few.
    res = _fa_call(_fa4._flash_attn_fwd, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                   softmax_scale=scale, causal=causal, return_lse=True)
    return res[0], res[1]


def _fa4_backward(dout, q, k, v, out, lse, causal, scale):  # pragma: no cover
    res = _fa_call(_fa4._flash_attn_bwd, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                   out=out.contiguous(), dout=dout.contiguous(), lse=lse.contiguous(),
                   softmax_scale=scale, causal=causal, deterministic=deterministic())
    return res[0], res[1], res[2]  # (dq, dk, dv[, dsink])


ALIGNMENT = 16
"""Bytes to which every tensor handed to a CUDA kernel is aligned: the widest vector load
(128 bits) the kernels issue (cuDNN and the TMA copies of FA3/FA4 require it)."""


def aligned(t):
    """``t`` itself when its data pointer is on a :data:`ALIGNMENT` boundary, else a dense copy.

    A view can start off the boundary when slicing drops a multiple of fewer than 16 bytes: a
    document piece's rows of a one-head, one-row lse (``lse[:, :, 37:69]`` is contiguous, so
    ``.contiguous()`` keeps it, 148 bytes in). On an H200 (torch 2.11) the memory-efficient
    backward given such an lse, every other tensor of the call aligned, stopped the device with
    "misaligned address"; the copy costs one piece's lse rows, and only when it is off."""
    if not isinstance(t, torch.Tensor) or t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _aligned_call(kernel):
    @functools.wraps(kernel)
    def call(*tensors_then_options):
        return kernel(*(aligned(a) for a in tensors_then_options))
    return call


def _aligning(kernels: dict) -> dict:
    return {name: _aligned_call(kernel) for name, kernel in kernels.items()}


FORWARD = _aligning({"sdpa_flash": flash_forward, "sdpa_efficient": efficient_forward,
                     "sdpa_cudnn": cudnn_forward, "flash_attn": _flash_attn_forward,
                     "fa3": _fa3_forward, "fa4": _fa4_forward})


SOFTCAP_FORWARD = _aligning({"flash_attn": _flash_attn_forward, "fa3": _fa3_forward})


SOFTCAP_BACKWARD = _aligning({"flash_attn": _flash_attn_backward, "fa3": _fa3_backward})
"""The CUDA backends whose kernels take ``softcap`` (FA2 from 2.6, FA3)."""


BACKWARD = _aligning({"sdpa_flash": flash_backward,
                      "sdpa_efficient": efficient_backward,
                      "sdpa_cudnn": cudnn_backward, "flash_attn": _flash_attn_backward,
                      "fa3": _fa3_backward, "fa4": _fa4_backward})
