"""Attention within documents (packed sequences): one attention per document.

A row of the batch may hold several documents back to back; ``position_ids`` restart at
each. No query may see a key of another document, which a single kernel call over the row
cannot express, so :class:`SegmentedAttention` attends each (row, document) on its own (one
kernel call, or the calls of a sliding window, :mod:`ulysses.band`) and writes its slice of
``out``/``lse`` (and, in backward, of dq/dk/dv). It has the interface of
:class:`ulysses.kernels.LocalAttention`, so plain and head-chunked Ulysses wrap it alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses.band import WindowAttention
from ulysses.kernels import LocalAttention


@dataclass(frozen=True, slots=True)
class SegmentedAttention:
    """Attention within documents only (packed sequences): row b of the batch holds documents
    ``[starts[b][i], starts[b][i+1])``, and no query sees a key of another document. One
    attention per document; the same interface as :class:`LocalAttention`."""

    causal: bool
    scale: float
    backend: str
    starts: tuple[tuple[int, ...], ...]
    """Per batch row, the first position of each document (beginning with 0)."""
    window: int | None = None
    """Sliding window within each document (:mod:`ulysses.band`; symmetric when not causal);
    None: none."""
    softcap: float = 0.0
    """Logit softcapping inside the softmax; 0: none."""

    def _inner(self) -> LocalAttention | WindowAttention:
        """What attends one document."""
        if self.window is not None:
            return WindowAttention(window=self.window, scale=self.scale, backend=self.backend,
                                   softcap=self.softcap, causal=self.causal)
        return LocalAttention(causal=self.causal, scale=self.scale, backend=self.backend,
                              softcap=self.softcap)

    def _segments(self, seq_len: int):
        for b, row in enumerate(self.starts):
            ends = row[1:] + (seq_len,)
            for a, e in zip(row, ends):
                yield b, a, e

    def forward(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor) -> tuple[Tensor, Tensor]:
        B, S, H, _ = q_BSHD.shape
        out = torch.empty_like(q_BSHD)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q_BSHD.device)
        inner = self._inner()
        for b, a, e in self._segments(S):
            o, l = inner.forward(q_BSHD[b:b + 1, a:e], k_BSKD[b:b + 1, a:e],
                                 v_BSKD[b:b + 1, a:e])
            out[b:b + 1, a:e], lse[b:b + 1, :, a:e] = o, l
        return out, lse

    def backward(self, dout_BSHD: Tensor, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                 out_BSHD: Tensor, lse_BHS: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = (torch.empty_like(t) for t in (q_BSHD, k_BSKD, v_BSKD))
        inner = self._inner()
        for b, a, e in self._segments(q_BSHD.shape[1]):
            rows = (slice(b, b + 1), slice(a, e))
            g = inner.backward(dout_BSHD[rows], q_BSHD[rows], k_BSKD[rows], v_BSKD[rows],
                               out_BSHD[rows], lse_BHS[b:b + 1, :, a:e].contiguous())
            dq[rows], dk[rows], dv[rows] = g
        return dq, dk, dv


def check_segments(starts, batch: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Validate document starts (``ValueError``) and return them as tuples."""
    starts = tuple(tuple(int(i) for i in row) for row in starts)
    if len(starts) != batch:
        raise ValueError(f"segments must have one row per batch row ({batch}), got {len(starts)}")
    for row in starts:
        if not row or row[0] != 0 or any(b <= a for a, b in zip(row, row[1:])) or \
                row[-1] >= seq_len:
            raise ValueError(f"each segments row must start at 0 and increase strictly below the "
                             f"sequence length {seq_len}, got {list(row)}")
    return starts
