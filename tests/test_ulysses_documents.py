"""Packed documents on the ring, on hybrid Ulysses x Ring meshes and in sequence chunks.

The geometry test checks that every ring step's kernel calls cover each visible
(query, key) pair exactly once, for documents that cross ring blocks and zigzag halves. The
multi-rank cases run ``ulysses_attention`` with ``segments`` against the float64 reference
with an explicit document mask (``test_ulysses_window_sinks.reference``), and check that the
result without the documents differs.
"""

from __future__ import annotations

import pytest
import torch

from test_ulysses_window_sinks import check_case, reference
from ulysses.ring import RingAttention, _document_pieces, _segments, _work

KIND_MASKS = {"full": lambda n, w: torch.ones(n, w, dtype=torch.int),
              "causal": lambda n, w: torch.ones(n, w, dtype=torch.int).tril(),
              "anticausal": lambda n, w: torch.ones(n, w, dtype=torch.int).triu()}


def _positions(cfg: RingAttention, owner: int, L: int) -> torch.Tensor:
    """The ring-global position of each of ``owner``'s rows."""
    pos = torch.empty(L, dtype=torch.long)
    for g, n, row in _segments(cfg, owner, L):
        pos[row:row + n] = torch.arange(g, g + n)
    return pos


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (True, 1), (False, None)],
                         ids=["causal", "window5", "window1", "full"])
@pytest.mark.parametrize("R", [2, 3])
def test_document_pieces_cover_each_visible_pair_once(R, causal, window, zigzag):
    L = 12
    starts = (0, 5, 6, 17, 30, 31) if R == 3 else (0, 5, 6, 17)
    doc_of = torch.bucketize(torch.arange(R * L), torch.tensor(starts[1:]), right=True)
    steps_without_calls = 0
    for r in range(R):
        cfg = RingAttention(group=None, rank=r, size=R, causal=causal, scale=1.0,
                            backend="cpu_flash", zigzag=zigzag, window=window,
                            starts=(starts,))
        qpos = _positions(cfg, r, L)
        for t in range(R):
            kpos = _positions(cfg, (r - t) % R, L)
            want = doc_of[qpos][:, None] == doc_of[kpos][None, :]
            if causal:
                want &= kpos[None, :] <= qpos[:, None]
            if window is not None:
                want &= qpos[:, None] - kpos[None, :] < window
            got = torch.zeros(L, L, dtype=torch.int)
            pieces = _document_pieces(cfg, t, L, 0)
            for p in pieces:
                assert p.kind == "full" or p.q1 - p.q0 == p.k1 - p.k0, p
                got[p.q0:p.q1, p.k0:p.k1] += KIND_MASKS[p.kind](p.q1 - p.q0, p.k1 - p.k0)
            assert torch.equal(got, want.int()), (r, t)
            steps_without_calls += not pieces
    if window == 1:  # the diagonal only: every step but the first is skipped
        assert steps_without_calls == R * (R - 1)


def test_rows_without_a_shared_document_are_skipped():
    """Two rows of the batch, each with its own documents: a row whose documents do not meet
    the block in hand gets no call at that step."""
    R, L = 2, 8  # zigzag chunks of 4: rank 0 holds positions 0-3 and 12-15
    cfg = RingAttention(group=None, rank=0, size=R, causal=True, scale=1.0, backend="cpu_flash",
                        starts=((0, 4, 12), (0,)))
    rows = [(w[0].start, len(w[1])) for w in _work(cfg, 1, L)]
    # row 0: documents [0, 4), [4, 12), [12, 16): rank 1's keys (4-7, 8-11) meet none of
    # rank 0's queries' documents; row 1: one document, so rank 1's keys 4-11 are seen by
    # the second chunk (12-15).
    assert rows == [(1, 1)]


# (world, ulysses, ring, zigzag, heads, kv heads, head chunk, window, sinks, documents)
CASES = {
    "r2_zigzag": (2, 1, 2, True, 2, 1, None, None, False, ((0, 20, 45, 97), (0, 64, 70))),
    "u2r2_zigzag_chunked_window_sinks": (4, 2, 2, True, 4, 2, 1, 21, True,
                                         ((0, 20, 45, 97), (0, 33, 100))),
    "r2_contiguous_window_sinks": (2, 1, 2, False, 2, 2, None, 40, True,
                                   ((0, 50, 97), (0, 30))),
    "r4_zigzag_sinks": (4, 1, 4, True, 2, 1, None, None, True, ((0, 9, 60, 61), (0, 100))),
    "u2r2_contiguous": (4, 2, 2, False, 4, 4, None, None, False, ((0, 70), (0, 16, 17))),
    "u2_seq_chunk_window_sinks": (2, 2, 1, True, 4, 2, 1, 21, True, ((0, 20, 45, 97), (0, 64))),
    "u4_seq_chunk": (4, 4, 1, True, 8, 2, 2, None, False, ((0, 9, 60, 61), (0, 100))),
    "u2r2_zigzag_seq_chunk_sinks": (4, 2, 2, True, 4, 2, 1, None, True,
                                    ((0, 20, 45, 97), (0, 33, 100))),
}
SEQ_CHUNK = {"u2_seq_chunk_window_sinks": 3, "u4_seq_chunk": 4, "u2r2_zigzag_seq_chunk_sinks": 2}
"""Cases run by the sequence-chunked loop (:mod:`ulysses.seq_chunk`), blocks per piece:
documents cross the blocks (pieces of 64, 32 and 32 rows)."""
SLOW = {"r4_zigzag_sinks", "u2r2_contiguous", "u4_seq_chunk"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_documents_across_ranks(name):
    window = CASES[name][7]
    (q, k, v, dout, sinks), want = check_case(name, CASES[name], seed=3,
                                              seq_chunk=SEQ_CHUNK.get(name))
    one_document = reference(q, k, v, dout, window=window, sinks=sinks)
    assert (one_document[0] - want[0]).abs().max() > 1e-2
