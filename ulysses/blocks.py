"""Causal attention in which some blocks of positions also see themselves whole.

Gemma3 lets the tokens of one image attend to each other in both directions while the rest
of the sequence stays causal: a query in block ``[a, e)`` sees every key before it and every
key of its own block (transformers' ``blockwise_overlay`` OR'ed with the causal mask; on a
sliding layer the window is AND'ed after, and a key after the query is always inside it).

:class:`BlockAttention` wraps the inner attention (the local kernel, documents, or a sliding
window; :func:`ulysses.hybrid.inner_attention`) and adds, per block, the keys the causal mask
hid: queries ``[a, e - 1)`` against keys ``[a + 1, e)``, ``k > q``, one ``anticausal`` piece
of :mod:`ulysses.band` (its square is the block shifted by one key). The two key sets are
disjoint, so the piece's ``(out, lse)`` merges into the inner one by log-sum-exp, and the
backward adds the piece's kernel backward, run with the final ``out`` and ``lse``, to the
inner one's, in float32 for half inputs. A block costs ``(e - a)^2 / 2`` more scores.

Positions are the full sequence's (after the Ulysses exchange). Blocks do not work across
a ring: each ring rank holds other positions, and ``ulysses_attention`` refuses them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ulysses.band import Piece, acc_dtype, merge_into, piece_backward, piece_forward

Blocks = tuple[tuple[tuple[int, int], ...], ...]
"""Per batch row, the ``(first, end)`` positions of each block."""


def check_blocks(blocks, batch: int, seq_len: int, starts=None) -> Blocks:
    """``blocks`` as :data:`Blocks`: one entry per row, each block ``0 <= a < e <= seq_len``,
    in order and apart, and within one document of ``starts`` (per row, each document's
    first position) when given. ``ValueError`` otherwise."""
    rows = tuple(tuple((int(a), int(e)) for a, e in row) for row in blocks)
    if len(rows) != batch:
        raise ValueError(f"blocks must give one entry per batch row ({batch}), got {len(rows)}")
    for b, row in enumerate(rows):
        end = 0
        for a, e in row:
            if not end <= a < e <= seq_len:
                raise ValueError(f"blocks of row {b} must be ordered, apart and within "
                                 f"[0, {seq_len}]; got {list(row)}")
            end = e
        if starts is not None:
            firsts = starts[b]
            for a, e in row:
                if any(a < f < e for f in firsts):
                    raise ValueError(f"block [{a}, {e}) of row {b} crosses a document start "
                                     f"({[f for f in firsts if a < f < e][0]}); a block must "
                                     f"lie within one document")
    return rows


@dataclass(frozen=True, slots=True)
class BlockAttention:
    """``inner`` (causal) with each block of :attr:`blocks` seen whole by its own queries;
    the interface of :class:`ulysses.kernels.LocalAttention`."""

    inner: Any
    blocks: Blocks
    scale: float
    backend: str
    softcap: float = 0.0

    def _pieces(self):
        for b, row in enumerate(self.blocks):
            for a, e in row:
                if e - a > 1:
                    yield b, Piece(a, e - 1, a + 1, e, "anticausal")

    def forward(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(out_BSHD, lse_BHS)``."""
        out, lse = self.inner.forward(q_BSHD, k_BSKD, v_BSKD)
        acc = acc_dtype(q_BSHD.dtype)
        for b, p in self._pieces():
            one = slice(b, b + 1)
            o_p, l_p = piece_forward(q_BSHD[one], k_BSKD[one], v_BSKD[one], p, scale=self.scale,
                                     backend=self.backend, softcap=self.softcap)
            rows = slice(p.q0, p.q1)
            o_acc = out[one, rows].to(acc)
            merge_into(o_acc, lse[one, :, rows], o_p.to(acc), l_p)
            out[one, rows] = o_acc.to(out.dtype)
        return out, lse

    def backward(self, dout_BSHD: Tensor, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                 out_BSHD: Tensor, lse_BHS: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(dq, dk, dv)`` shaped like ``q, k, v``."""
        dq, dk, dv = self.inner.backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS)
        pieces = list(self._pieces())
        if not pieces:
            return dq, dk, dv
        acc = acc_dtype(q_BSHD.dtype)
        dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)
        for b, p in pieces:
            one = slice(b, b + 1)
            dq_p, dk_p, dv_p = piece_backward(dout_BSHD[one], q_BSHD[one], k_BSKD[one],
                                              v_BSKD[one], out_BSHD[one], lse_BHS[one], p,
                                              scale=self.scale, backend=self.backend,
                                              softcap=self.softcap)
            dq[one, p.q0:p.q1] += dq_p
            dk[one, p.k0:p.k1] += dk_p
            dv[one, p.k0:p.k1] += dv_p
        return dq.to(q_BSHD.dtype), dk.to(k_BSKD.dtype), dv.to(v_BSKD.dtype)


__all__ = ["BlockAttention", "Blocks", "check_blocks"]
