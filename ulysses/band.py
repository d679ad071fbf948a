"""Attention under a sliding window (causal, or symmetric), built from the ``(out, lse)``
kernels.

A key at position k is visible to a query at position q when ``k <= q`` and ``q - k < window``:
the query sees itself and the ``window - 1`` keys before it. This is transformers'
``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) on a causal mask, and
flash-attn's ``window_size=(window - 1, 0)``.

The kernels of :mod:`ulysses.kernels` know two masks on a square block: none, and causal
(``k' <= q'``). A band over any rows and keys is cut into pieces of three kinds, each one
kernel call, and the pieces' results are merged by their log-sum-exp:

- ``full``: every (query, key) pair of the piece is visible;
- ``causal``: a square piece, ``k' <= q'``;
- ``anticausal``: a square piece, ``k' >= q'``: the causal kernel on the piece's queries and
  keys reversed along the sequence (reversal turns ``k' >= q'`` into ``k'' <= q''``).

Rows are taken in blocks of ``window - 1``. For a row block ``[a, b)`` the visible keys fall
in three disjoint zones: ``[a - w + 1, b - w + 1)`` bounded below by the window
(anticausal), ``[b - w + 1, a)`` visible to every row (full, empty when the block is
``w - 1`` rows), and ``[a, b)`` bounded above by causality (causal). A zone cut by the edge
of the available keys (the sequence start, a ring block) splits into at most three pieces.
Keys outside every zone are never computed, so a window costs about ``window`` keys per
query however long the sequence.

Without a causal mask the window is symmetric: a key is visible when ``|q - k| < window``
(Gemma3's bidirectional sliding layers). :func:`symmetric_pieces` cuts it the same way, with
an anticausal zone below, a full zone, and a causal zone (offset ``window - 1``) above.

The backward runs each piece's kernel backward with the *final* ``out`` and ``lse`` (the
merged ones), which is exact for a softmax split over disjoint key sets, and sums the
pieces' gradients (in float32 for half-precision inputs).

Positions here are global (in the sequence being attended); a *segment* maps a run of
consecutive global positions to rows of a local tensor, which is how ring blocks in zigzag
order are described.

Shape legend: B batch, S rows of q, L rows of k/v, H / K query / kv heads, D head dim.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ulysses.kernels import attention_backward, attention_forward

KINDS = ("full", "causal", "anticausal")


@dataclass(frozen=True, slots=True)
class Piece:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` (local
    indices), with mask ``kind`` (``causal``/``anticausal`` pieces are square)."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


def check_window(window, causal: bool) -> int | None:
    """``window`` as an int (or None); ``ValueError`` unless it is a positive int. Causal: a
    query sees itself and the ``window - 1`` keys before it; non-causal (symmetric): the keys
    less than ``window`` positions away on either side, ``|q - k| < window``."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or a positive int (causal: keys a query sees, "
                         f"itself included; non-causal: |q - k| < window), got {window!r}")
    return window


def _causal_type(r0, r1, c0, c1, o):
    """Pieces of rows ``[r0, r1)`` x keys ``[c0, c1)`` where ``k <= q + o`` is visible."""
    if r0 >= r1 or c0 >= c1:
        return []
    pieces = []
    full_from = max(r0, c1 - o)                     # these rows see every key
    qs, qe = max(r0, c0 - o), min(r1, full_from)    # these see keys [c0, q + o]
    if qs < qe:
        if qs + o > c0:
            pieces.append((qs, qe, c0, qs + o, "full"))
        pieces.append((qs, qe, qs + o, qe + o, "causal"))
    if full_from < r1:
        pieces.append((full_from, r1, c0, c1, "full"))
    return pieces


def _anticausal_type(r0, r1, c0, c1, o):
    """Pieces of rows ``[r0, r1)`` x keys ``[c0, c1)`` where ``k >= q + o`` is visible."""
    if r0 >= r1 or c0 >= c1:
        return []
    pieces = []
    full_to = min(r1, c0 - o)                       # these rows see every key
    if r0 < full_to:
        pieces.append((r0, full_to, c0, c1, "full"))
    qs, qe = max(r0, full_to), min(r1, c1 - o)      # these see keys [q + o, c1)
    if qs < qe:
        pieces.append((qs, qe, qs + o, qe + o, "anticausal"))
        if qe + o < c1:
            pieces.append((qs, qe, qe + o, c1, "full"))
    return pieces


def _clip(lo, hi, c0, c1):
    return max(lo, c0), min(hi, c1)


def band_pieces(q_segments, k_segments, window: int | None) -> list[Piece]:
    """The kernel calls that make causal (windowed, when ``window`` is set) attention of the
    queries in ``q_segments`` to the keys in ``k_segments``.

    Args:
        q_segments, k_segments: ``(first global position, length, first local row)`` runs.
        window: keys a query sees (itself included), or ``None`` for plain causal.

    Returns:
        Pieces in local rows, covering every visible pair exactly once. Full pieces that
        share rows (or keys) and touch are merged, so a ring step over a zigzag chunk pair
        stays one call where plain causal needs one. Rows that see no key get no piece.
    """
    out = []
    for qg, qn, ql in q_segments:
        T = qn if window is None else max(1, window - 1)
        for a in range(qg, qg + qn, T):
            b = min(a + T, qg + qn)
            for kg, kn, kl in k_segments:
                c0, c1 = kg, kg + kn
                found = _causal_type(a, b, *_clip(a, b, c0, c1), 0)
                if window is None:
                    found += [(a, b, lo, hi, "full") for lo, hi in [_clip(c0, a, c0, c1)]
                              if lo < hi]
                else:
                    lo, hi = _clip(b - window + 1, a, c0, c1)
                    if lo < hi:
                        found.append((a, b, lo, hi, "full"))
                    if window > 1:  # window 1: the causal zone alone is the diagonal
                        found += _anticausal_type(a, b, *_clip(a - window + 1, b - window + 1,
                                                              c0, c1), 1 - window)
                out += [Piece(q - qg + ql, r - qg + ql, k - kg + kl, e - kg + kl, kind)
                        for q, r, k, e, kind in found]
    return _coalesce(out)


def symmetric_pieces(q_segments, k_segments, window: int) -> list[Piece]:
    """The kernel calls of non-causal attention under a symmetric window (``|q - k| <
    window``), runs as in :func:`band_pieces`. Rows go in blocks ``[a, b)`` of ``window - 1``;
    their keys fall in three disjoint zones: ``[a - w + 1, b - w + 1)`` bounded below
    (anticausal type, ``k >= q - w + 1``), ``[b - w + 1, a + w)`` seen by every row (full),
    and ``[a + w, b + w - 1)`` bounded above (causal type, ``k <= q + w - 1``)."""
    out = []
    w = window
    for qg, qn, ql in q_segments:
        T = max(1, w - 1)
        for a in range(qg, qg + qn, T):
            b = min(a + T, qg + qn)
            for kg, kn, kl in k_segments:
                c0, c1 = kg, kg + kn
                found = _anticausal_type(a, b, *_clip(a - w + 1, b - w + 1, c0, c1), 1 - w)
                lo, hi = _clip(b - w + 1, a + w, c0, c1)
                if lo < hi:
                    found.append((a, b, lo, hi, "full"))
                found += _causal_type(a, b, *_clip(a + w, b + w - 1, c0, c1), w - 1)
                out += [Piece(q - qg + ql, r - qg + ql, k - kg + kl, e - kg + kl, kind)
                        for q, r, k, e, kind in found]
    return _coalesce(out)


def mask_pieces(q_segments, k_segments, *, causal: bool, window: int | None) -> list[Piece]:
    """The kernel calls between queries and keys (runs as in :func:`band_pieces`) under
    any mask this module knows: causal (:func:`band_pieces`, windowed or not), a symmetric
    window (:func:`symmetric_pieces`), or none (every pair of runs, full)."""
    if causal:
        return band_pieces(q_segments, k_segments, window)
    if window is not None:
        return symmetric_pieces(q_segments, k_segments, window)
    return [Piece(ql, ql + qn, kl, kl + kn, "full")
            for _, qn, ql in q_segments for _, kn, kl in k_segments]


def runs_within(runs, a: int, e: int):
    """The parts of ``runs`` (``(first global position, length, first row)``) in ``[a, e)``."""
    found = []
    for g, n, row in runs:
        lo, hi = max(g, a), min(g + n, e)
        if lo < hi:
            found.append((lo, hi - lo, row + lo - g))
    return found


def document_pieces(q_segments, k_segments, starts, total: int, *, causal: bool,
                    window: int | None) -> tuple[Piece, ...]:
    """The kernel calls between queries and keys (runs as in :func:`band_pieces`) of one
    batch row of packed documents (``starts``: each document's first global position, 0
    first; the last ends at ``total``): per document, its queries against its keys under the
    mask (:func:`mask_pieces`). Documents that do not meet in these runs give no call.

    Each document finds its runs by bisection (runs sorted by position), so a row of D
    documents over a per-document layout's 2D runs costs O(D log D), not O(D^2); and the
    result is cached, since every layer (and its backward) asks for the same block pairs."""
    return _document_pieces(tuple(map(tuple, q_segments)), tuple(map(tuple, k_segments)),
                            tuple(starts), total, causal, window)


@functools.lru_cache(maxsize=256)  # a few batches' block pairs; a large one is 100 KB
def _document_pieces(q_segments, k_segments, starts, total, causal, window):
    qs_sorted, ks_sorted = sorted(q_segments), sorted(k_segments)
    q_firsts, k_firsts = [g for g, _, _ in qs_sorted], [g for g, _, _ in ks_sorted]
    pieces = []
    for a, e in zip(starts, starts[1:] + (total,)):
        qs = _overlapping(qs_sorted, q_firsts, a, e)
        ks = _overlapping(ks_sorted, k_firsts, a, e) if qs else []
        if qs and ks:
            pieces += mask_pieces(qs, ks, causal=causal, window=window)
    return tuple(pieces)


def _overlapping(runs, firsts: list[int], a: int, e: int):
    """:func:`runs_within` for disjoint ``runs`` sorted by position (``firsts``: their first
    positions): the runs that can meet ``[a, e)`` are found by bisection."""
    found = []
    for g, n, row in runs[max(bisect.bisect_right(firsts, a) - 1, 0):]:
        if g >= e:
            break
        lo, hi = max(g, a), min(g + n, e)
        if lo < hi:
            found.append((lo, hi - lo, row + lo - g))
    return found


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge touching full pieces that share their key range or their row range."""
    merged: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.kind != "full", p.k0, p.k1, p.q0)):
        last = merged[-1] if merged else None
        if last is not None and p.kind == last.kind == "full":
            if (last.k0, last.k1) == (p.k0, p.k1) and last.q1 == p.q0:
                merged[-1] = Piece(last.q0, p.q1, p.k0, p.k1, "full")
                continue
        merged.append(p)
    again: list[Piece] = []
    for p in sorted(merged, key=lambda p: (p.kind != "full", p.q0, p.q1, p.k0)):
        last = again[-1] if again else None
        if last is not None and p.kind == last.kind == "full":
            if (last.q0, last.q1) == (p.q0, p.q1) and last.k1 == p.k0:
                again[-1] = Piece(p.q0, p.q1, last.k0, p.k1, "full")
                continue
        again.append(p)
    return sorted(again, key=lambda p: (p.q0, p.k0))


# --- running one piece ----------------------------------------------------------------------

def _flip(*ts: Tensor) -> tuple[Tensor, ...]:
    """Reverse ``[B, S, ...]`` tensors along the sequence (dim 1)."""
    return tuple(t.flip(1) for t in ts)


def piece_forward(q: Tensor, k: Tensor, v: Tensor, p: Piece, *, scale: float,
                  backend: str, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(out [B, q1-q0, H, D], lse [B, H, q1-q0])`` of one piece."""
    qp, kp, vp = q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1]
    if p.kind == "anticausal":
        out, lse = attention_forward(*_flip(qp, kp, vp), causal=True, softmax_scale=scale,
                                     backend=backend, softcap=softcap)
        return out.flip(1), lse.flip(-1)
    return attention_forward(qp, kp, vp, causal=p.kind == "causal", softmax_scale=scale,
                             backend=backend, softcap=softcap)


def piece_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   p: Piece, *, scale: float, backend: str,
                   softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one piece's rows and keys, from the final ``out`` and ``lse``."""
    rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
    args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])
    lse_p = lse[:, :, rows]
    if p.kind == "anticausal":
        grads = attention_backward(*_flip(*args), lse_p.flip(-1), causal=True,
                                   softmax_scale=scale, backend=backend, softcap=softcap)
        return _flip(*grads)
    return attention_backward(*args, lse_p.contiguous(), causal=p.kind == "causal",
                              softmax_scale=scale, backend=backend, softcap=softcap)


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold a block's ``(out_b [B,l,h,D], lse_b [B,h,l])`` into the running ``(out, lse)``
    (views of the accumulators) in place: the softmax over the union of both key sets. A
    running ``lse`` of -inf (nothing seen yet) takes the block as it is."""
    new = torch.logaddexp(lse, lse_b)
    # [B, h, l] -> [B, l, h, 1]: per-row weights broadcast over D.
    w_old = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)
    w_blk = torch.exp(lse_b - new).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(out_b, w_blk)
    lse.copy_(new)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums over pieces (and ring blocks) run in float32 for half inputs: each rounding to 8
    mantissa bits would add its own error (ring-flash-attention #42)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --- windowed attention on one rank ---------------------------------------------------------

def _row_blocks(S: int, window: int):
    T = max(1, window - 1)
    for a in range(0, S, T):
        yield a, min(a + T, S)


def _keys(S: int, kv_len: int | None):
    """The key run of a local window: all S rows, or the first ``kv_len`` (padding after)."""
    return [(0, S if kv_len is None else min(S, kv_len), 0)]


def window_forward(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: float,
                   backend: str, softcap: float = 0.0, causal: bool = True,
                   kv_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Sliding-window attention of ``q_BSHD`` to ``k_BSKD``/``v_BSKD`` (same positions):
    causal, or symmetric (``|q - k| < window``) with ``causal=False``, where keys from
    ``kv_len`` on are padding. Returns ``(out_BSHD, lse_BHS)``; lse is float32.

    Row block by row block, so the float32 accumulator is one block (``window - 1`` rows).
    """
    B, S, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    keys = _keys(S, kv_len)
    for a, b in _row_blocks(S, window):
        o_acc = torch.zeros(B, b - a, H, D, dtype=acc_dtype(q.dtype), device=q.device)
        l_acc = torch.full((B, H, b - a), float("-inf"), dtype=torch.float32, device=q.device)
        for p in mask_pieces([(a, b - a, a)], keys, causal=causal, window=window):
            o_p, l_p = piece_forward(q, k, v, p, scale=scale, backend=backend, softcap=softcap)
            r = slice(p.q0 - a, p.q1 - a)
            merge_into(o_acc[:, r], l_acc[:, :, r], o_p, l_p)
            del o_p, l_p
        out[:, a:b], lse[:, :, a:b] = o_acc, l_acc
    return out, lse


def window_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                    window: int, scale: float, backend: str, softcap: float = 0.0,
                    causal: bool = True,
                    kv_len: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`window_forward` from its ``out`` and ``lse``: ``(dq, dk, dv)``
    shaped like ``q, k, v``."""
    S = q.shape[1]
    acc = acc_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    keys = _keys(S, kv_len)
    for a, b in _row_blocks(S, window):
        dq_acc = torch.zeros(q[:, a:b].shape, dtype=acc, device=q.device)
        for p in mask_pieces([(a, b - a, a)], keys, causal=causal, window=window):
            dq_p, dk_p, dv_p = piece_backward(dout, q, k, v, out, lse, p, scale=scale,
                                              backend=backend, softcap=softcap)
            dq_acc[:, p.q0 - a:p.q1 - a] += dq_p
            dk[:, p.k0:p.k1] += dk_p
            dv[:, p.k0:p.k1] += dv_p
            del dq_p, dk_p, dv_p
        dq[:, a:b] = dq_acc
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@dataclass(frozen=True, slots=True)
class WindowAttention:
    """Sliding-window attention on one rank, causal or symmetric (``causal=False``: ``|q - k|
    < window``), with the interface of :class:`ulysses.kernels.LocalAttention` (the inner
    step of Ulysses, plain or head-chunked). A window that covers the whole sequence is plain
    causal (or full) attention."""

    window: int
    scale: float
    backend: str
    softcap: float = 0.0
    """Logit softcapping inside the softmax; 0: none."""
    causal: bool = True
    kv_len: int | None = None
    """Non-causal only: keys from this position on are padding, never attended."""

    def _whole(self, S: int) -> bool:
        return self.window >= S and self.kv_len is None

    def forward(self, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(out_BSHD, lse_BHS)``."""
        if self._whole(q_BSHD.shape[1]):
            return attention_forward(q_BSHD, k_BSKD, v_BSKD, causal=self.causal,
                                     softmax_scale=self.scale, backend=self.backend,
                                     softcap=self.softcap)
        return window_forward(q_BSHD, k_BSKD, v_BSKD, window=self.window, scale=self.scale,
                              backend=self.backend, softcap=self.softcap, causal=self.causal,
                              kv_len=self.kv_len)

    def backward(self, dout_BSHD: Tensor, q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                 out_BSHD: Tensor, lse_BHS: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(dq, dk, dv)`` shaped like ``q, k, v``."""
        if self._whole(q_BSHD.shape[1]):
            return attention_backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS,
                                      causal=self.causal, softmax_scale=self.scale,
                                      backend=self.backend, softcap=self.softcap)
        return window_backward(dout_BSHD, q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS,
                               window=self.window, scale=self.scale, backend=self.backend,
                               softcap=self.softcap, causal=self.causal, kv_len=self.kv_len)
