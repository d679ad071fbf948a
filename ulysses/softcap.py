"""Attention logit softcapping inside the softmax, as a blockwise ``(out, lse)`` kernel.

Gemma2 (``attn_logit_softcapping``, 50 by default) replaces each scaled score
``z = scale * q . k`` by ``cap * tanh(z / cap)`` before the mask and the softmax. SDPA's and
cuDNN's kernels have no such step; flash-attn 2 and 3 take ``softcap`` and are used where they
run (:mod:`ulysses.cuda_kernels`). Everywhere else this kernel runs: plain torch on any device,
float32 arithmetic, query blocks of :data:`Q_BLOCK` rows against key blocks of :data:`K_BLOCK`
with an online softmax, so its temporaries are ``[B, H, Q_BLOCK, K_BLOCK]`` whatever the
length. Causal blocks wholly above the diagonal are skipped.

The backward recomputes each block's probabilities from the forward's ``lse`` (the contract of
every kernel here) and takes the cap's derivative, ``1 - tanh(z / cap) ** 2``, into the
scores' gradient. GQA: query head ``i`` reads kv head ``i // (H // K)``; dk/dv are summed over
each kv head's query heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ulysses import trace_shortcuts

Q_BLOCK, K_BLOCK = 128, 1024


def check_softcap(softcap) -> float:
    """``softcap`` as a float (None or 0: no cap); ``ValueError`` unless it is a positive finite
    number."""
    if softcap is None or softcap == 0:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or \
            not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None, 0 or a positive finite number (scores z become "
                         f"softcap * tanh(z / softcap)), got {softcap!r}")
    return float(softcap)


def _grouped(q: Tensor, num_kv: int) -> Tensor:
    """``[B, S, H, D]`` -> float32 ``[B, K, G, S, D]`` (G query heads per kv head)."""
    B, S, H, D = q.shape
    return q.float().view(B, S, num_kv, H // num_kv, D).permute(0, 2, 3, 1, 4)


def _kv(t: Tensor) -> Tensor:
    """``[B, L, K, D]`` -> float32 ``[B, K, 1, L, D]``."""
    return t.float().permute(0, 2, 1, 3).unsqueeze(2)


def _scores(qb: Tensor, kb: Tensor, scale: float, cap: float, causal: bool, q0: int,
            k0: int) -> tuple[Tensor, Tensor]:
    """Capped, masked scores of a block and ``tanh(z / cap)`` (for the backward)."""
    t = torch.tanh((qb @ kb.transpose(-1, -2)) * (scale / cap))
    s = t * cap
    if causal:
        rows = torch.arange(q0, q0 + qb.shape[-2], device=qb.device)[:, None]
        cols = torch.arange(k0, k0 + kb.shape[-2], device=qb.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s, t


def _kept(blocks: list[tuple[int, int]], sigs: list, x: Tensor) -> list[tuple[int, int]]:
    """The blocks a loop runs: all; in a memory trace (:func:`ulysses.trace_shortcuts.skip`
    of ``x``) a block whose signature (what it allocates) repeats the two before it is left
    out unless it is the last, as it allocates and frees what they did."""
    return [blk for i, blk in enumerate(blocks) if trace_shortcuts.kept(
        i, len(blocks), i >= 2 and sigs[i] == sigs[i - 1] == sigs[i - 2], x)]


def _cut(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _keys_of(q1: int, L: int, causal: bool) -> int:
    return min(L, q1) if causal else L


def _query_blocks(S: int, L: int, causal: bool, x: Tensor) -> list[tuple[int, int]]:
    """Query blocks a loop runs. Nothing of a key block outlives it, so what a query block
    allocates at most is fixed by its rows and its widest key block."""
    blocks = _cut(S, Q_BLOCK)
    return _kept(blocks, [(b - a, min(K_BLOCK, _keys_of(b, L, causal))) for a, b in blocks], x)


def _key_blocks(q1: int, L: int, causal: bool, x: Tensor) -> list[tuple[int, int]]:
    blocks = _cut(_keys_of(q1, L, causal), K_BLOCK)
    return _kept(blocks, [b - a for a, b in blocks], x)


def softcap_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                    cap: float) -> tuple[Tensor, Tensor]:
    """``(out_BSHD, lse_BHS)`` of softcapped attention; lse is float32."""
    B, S, H, D = q.shape
    L, K = k.shape[1], k.shape[2]
    qg, kg, vg = _grouped(q, K), _kv(k), _kv(v)
    out = torch.empty(B, K, H // K, S, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, K, H // K, S, dtype=torch.float32, device=q.device)
    for q0, q1 in _query_blocks(S, L, causal, q):
        qb = qg[..., q0:q1, :]
        m = torch.full(qb.shape[:-1], float("-inf"), device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for k0, k1 in _key_blocks(q1, L, causal, q):
            s, _ = _scores(qb, kg[..., k0:k1, :], scale, cap, causal, q0, k0)
            new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            p = torch.exp(s - safe[..., None])
            keep = torch.exp(m - safe)
            total = total * keep + p.sum(-1)
            acc = acc * keep[..., None] + p @ vg[..., k0:k1, :]
            m = new
            del s, new, safe, p, keep  # nothing of a block outlives it
        out[..., q0:q1, :] = acc / total[..., None]
        lse[..., q0:q1] = m + torch.log(total)
        del qb, m, total, acc
    return (out.permute(0, 3, 1, 2, 4).reshape(B, S, H, D).to(q.dtype),
            lse.reshape(B, H, S))


def softcap_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     causal: bool, scale: float, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`softcap_forward` from its ``out`` and ``lse``."""
    B, S, H, D = q.shape
    L, K = k.shape[1], k.shape[2]
    qg, kg, vg, dog = _grouped(q, K), _kv(k), _kv(v), _grouped(dout, K)
    lse_g = lse.float().view(B, K, H // K, S)
    delta = (dog * _grouped(out, K)).sum(-1)                          # [B, K, G, S]
    dq = torch.zeros_like(qg)
    dk = torch.zeros(B, K, L, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for q0, q1 in _query_blocks(S, L, causal, q):
        qb, dob = qg[..., q0:q1, :], dog[..., q0:q1, :]
        for k0, k1 in _key_blocks(q1, L, causal, q):
            kb, vb = kg[..., k0:k1, :], vg[..., k0:k1, :]
            s, t = _scores(qb, kb, scale, cap, causal, q0, k0)
            p = torch.exp(s - lse_g[..., q0:q1, None])
            dv[:, :, k0:k1] += (p.transpose(-1, -2) @ dob).sum(2)
            ds = p * (dob @ vb.transpose(-1, -2) - delta[..., q0:q1, None])
            dz = ds * (1 - t * t) * scale                             # d/dz of cap*tanh(z/cap)
            dq[..., q0:q1, :] += dz @ kb
            dk[:, :, k0:k1] += (dz.transpose(-1, -2) @ qb).sum(2)
            del kb, vb, s, t, p, ds, dz  # nothing of a block outlives it
        del qb, dob
    dq = dq.permute(0, 3, 1, 2, 4).reshape(B, S, H, D).to(q.dtype)
    return dq, dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)
