"""Non-causal attention with a symmetric window (``|q - k| < window``), packed documents,
sinks and padding, on one rank and across ranks, against a float64 reference that builds the
mask explicitly (nothing of ``ulysses.band`` is used). Each case also checks that the result
without its window (or documents) differs, so a path that dropped them fails here.
"""

from __future__ import annotations

import pytest
import torch

from test_ulysses_documents import KIND_MASKS
from test_ulysses_window_sinks import check_case, one_rank_case
from test_ulysses_window_sinks import reference as masked_reference
from ulysses.band import document_pieces, mask_pieces


def reference(q, k, v, dout, **mask):
    """float64 ``(out, dq, dk, dv, dsinks)`` of non-causal attention under the given mask."""
    return masked_reference(q, k, v, dout, causal=False, **mask)


# --- the geometry ---------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 2, 5, 16, 100])
def test_symmetric_pieces_cover_each_visible_pair_once(window):
    """A local square, every zigzag and contiguous ring step of R = 3, and documents across
    them: each pair with ``|q - k| < window`` (in one document) computed once, no other."""
    R, c = 3, 5
    cases = [([(0, S, 0)], [(0, S, 0)]) for S in (1, 7, 33)]
    for r in range(R):
        for o in range(R):
            cases.append(([(r * c, c, 0), ((2 * R - 1 - r) * c, c, c)],
                          [(o * c, c, 0), ((2 * R - 1 - o) * c, c, c)]))
            cases.append(([(r * 2 * c, 2 * c, 0)], [(o * 2 * c, 2 * c, 0)]))
    starts = (0, 4, 5, 13, 22)
    for qs, ks in cases:
        Lq, Lk = sum(n for _, n, _ in qs), sum(n for _, n, _ in ks)
        for docs in (None, starts):
            want = torch.zeros(Lq, Lk, dtype=torch.int)
            for qg, qn, ql in qs:
                for kg, kn, kl in ks:
                    qi, ki = torch.arange(qg, qg + qn)[:, None], torch.arange(kg, kg + kn)[None]
                    vis = (qi - ki).abs() < window
                    if docs is not None:
                        edges = torch.tensor(docs[1:])
                        vis &= torch.bucketize(qi, edges, right=True) == \
                            torch.bucketize(ki, edges, right=True)
                    want[ql:ql + qn, kl:kl + kn] = vis.int()
            pieces = (mask_pieces(qs, ks, causal=False, window=window) if docs is None else
                      document_pieces(qs, ks, docs, 64, causal=False, window=window))
            got = torch.zeros(Lq, Lk, dtype=torch.int)
            for p in pieces:
                assert p.kind == "full" or p.q1 - p.q0 == p.k1 - p.k0, p
                got[p.q0:p.q1, p.k0:p.k1] += KIND_MASKS[p.kind](p.q1 - p.q0, p.k1 - p.k0)
            assert torch.equal(got, want), (qs, ks, docs)


# --- one rank -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("S,window,kv_len", [(61, 1, None), (64, 2, None), (61, 7, None),
                                             (64, 16, 50), (50, 200, None), (45, 9, 40)])
def test_symmetric_window_one_rank(S, window, kv_len, dtype):
    one_rank_case(S, window, dtype, seed=2, causal=False, kv_len=kv_len)


# --- across ranks ---------------------------------------------------------------------------

# (world, ulysses, ring, zigzag, heads, kv heads, head chunk, window, sinks, documents)
CASES = {
    "u2_window": (2, 2, 1, True, 4, 2, None, 16, False, None),
    "u4_chunked_window_sinks": (4, 4, 1, True, 8, 2, 1, 37, True, None),
    "u2r2_zigzag_chunked_window_sinks": (4, 2, 2, True, 4, 2, 1, 21, True, None),
    "r2_contiguous_documents_window": (2, 1, 2, False, 2, 2, None, 12, False,
                                       ((0, 50, 97), (0, 30))),
    "u2_documents_sinks": (2, 2, 1, True, 4, 4, 2, None, True, ((0, 50, 97), (0, 30))),
    "r2_zigzag_documents": (2, 1, 2, True, 2, 1, None, None, False,
                            ((0, 20, 45, 97), (0, 64, 70))),
    "u2_padded_window": (2, 2, 1, True, 4, 2, 1, 11, False, None),
    "r2_zigzag_padded_window": (2, 1, 2, True, 2, 1, None, 30, False, None),
    "u2_seq_chunk_documents_window": (2, 2, 1, True, 4, 2, 1, 9, True,
                                      ((0, 20, 45, 97), (0, 64))),
    "u2r2_seq_chunk_window": (4, 2, 2, True, 4, 2, 1, 25, False, None),
    "u2r2_seq_chunk_padded_window": (4, 2, 2, True, 4, 2, 1, 13, True, None),
}
SEQ_CHUNK = {"u2_seq_chunk_documents_window": 3, "u2r2_seq_chunk_window": 2,
             "u2r2_seq_chunk_padded_window": 3}
PADDED = {"u2_padded_window", "r2_zigzag_padded_window", "u2r2_seq_chunk_padded_window"}
"""Cases of 121 tokens, padded by shard_sequence and masked through unpadded_len."""
SLOW = {"u4_chunked_window_sinks", "r2_zigzag_documents", "u2r2_seq_chunk_window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_non_causal_across_ranks(name):
    pad = name in PADDED
    (q, k, v, dout, sinks), want = check_case(name, CASES[name], seed=4,
                                              length=121 if pad else 128, causal=False,
                                              pad=pad, seq_chunk=SEQ_CHUNK.get(name))
    plain = reference(q, k, v, dout, sinks=sinks)
    assert (plain[0] - want[0]).abs().max() > 1e-2
