"""The per-document ring layout (``SequenceParallelDims(..., per_document=True)``).

The layout itself (:func:`ulysses.sharding.ring_runs`): a partition of the row, equal rows
per ring rank, the whole-row zigzag for one document, and even causal work per ring rank on
a long-tailed document mix where the whole-row zigzag is uneven. Then the ring's kernel
calls under it (each visible pair once), the cut and its inverse across ranks, and
``ulysses_attention`` on rings and hybrid meshes with the layout against the float64
reference (``test_ulysses_window_sinks.check_case``, which cuts with ``segments=``).
"""

from __future__ import annotations

import random

import pytest
import torch

import dist_pool
from helpers import get_mesh
from test_ulysses_documents import KIND_MASKS
from test_ulysses_window_sinks import check_case, reference
from ulysses import SequenceParallelDims, gather_sequence, shard_sequence, ulysses_attention
from ulysses.ring import RingAttention, _document_pieces, _segments
from ulysses.sharding import _SeqSplit, ring_runs


def _held(R: int, total: int, documents) -> list[torch.Tensor]:
    """Each ring rank's positions, in row order."""
    return [torch.cat([torch.arange(g, g + n) for g, n in ring_runs(total, R, r, documents)])
            for r in range(R)]


def _causal_work(positions: torch.Tensor, documents, total: int) -> int:
    """Visible (query, key) pairs of these query rows: offset in the document + 1 each."""
    starts = torch.tensor(documents)
    doc = torch.bucketize(positions, starts[1:], right=True)
    return int((positions - starts[doc] + 1).sum())


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ring_runs_partition_the_row_evenly(R):
    rng = random.Random(R)
    for _ in range(20):
        total = 2 * R * rng.randint(1, 40)
        documents = (0,) + tuple(sorted(rng.sample(range(1, total), rng.randint(0, 9))))
        held = _held(R, total, documents)
        assert all(len(h) == total // R for h in held)
        assert torch.equal(torch.cat(held).sort().values, torch.arange(total))
        # each document: chunks r and 2R-1-r, sizes within one of each other
        for a, e in zip(documents, documents[1:] + (total,)):
            counts = [int(((h >= a) & (h < e)).sum()) for h in held]
            assert max(counts) - min(counts) <= 2, (documents, counts)


@pytest.mark.parametrize("R", [2, 4])
def test_one_document_is_the_whole_row_zigzag(R):
    total = 8 * R
    split = _SeqSplit(ring=R, ulysses=1, zigzag=True)
    for r in range(R):
        plain = torch.cat([torch.arange(g, g + n) for g, n in split.runs(total, r)])
        assert torch.equal(_held(R, total, (0,))[r], plain)


def test_causal_work_is_even_where_the_whole_row_zigzag_is_not():
    """A long-tailed mix (one long document, then short ones): the whole-row zigzag leaves
    the rank holding the long document's late chunk with more work; per document, every
    rank does the same to within the leftover rows."""
    R, total = 4, 4096
    documents = (0, 2000, 2100, 2600, 3000, 3900)
    plain = _SeqSplit(ring=R, ulysses=1, zigzag=True)
    whole = [_causal_work(torch.cat([torch.arange(g, g + n) for g, n in plain.runs(total, r)]),
                          documents, total) for r in range(R)]
    per_doc = [_causal_work(h, documents, total) for h in _held(R, total, documents)]
    assert sum(whole) == sum(per_doc)
    assert max(whole) / (sum(whole) / R) > 1.15
    assert max(per_doc) / (sum(per_doc) / R) < 1.01


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None)],
                         ids=["causal", "window5", "full"])
@pytest.mark.parametrize("R", [2, 3])
def test_layout_pieces_cover_each_visible_pair_once(R, causal, window):
    L = 12
    layout = (0, 5, 6, 17) if R == 2 else (0, 5, 6, 17, 30, 31)
    starts = layout + (20,) if R == 2 else layout  # attention documents may cut further
    starts = tuple(sorted(set(starts)))
    doc_of = torch.bucketize(torch.arange(R * L), torch.tensor(starts[1:]), right=True)
    for r in range(R):
        cfg = RingAttention(group=None, rank=r, size=R, causal=causal, scale=1.0,
                            backend="cpu_flash", window=window, starts=(starts,),
                            layout=(layout,))
        pos = [torch.empty(L, dtype=torch.long) for _ in range(R)]
        for o in range(R):
            for g, n, row in _segments(cfg, o, L):
                pos[o][row:row + n] = torch.arange(g, g + n)
        assert torch.equal(pos[r], _held(R, R * L, layout)[r])
        for t in range(R):
            qpos, kpos = pos[r], pos[(r - t) % R]
            want = doc_of[qpos][:, None] == doc_of[kpos][None, :]
            if causal:
                want &= kpos[None, :] <= qpos[:, None]
            if window is not None:
                want &= (qpos[:, None] - kpos[None, :]).abs() < window
            got = torch.zeros(L, L, dtype=torch.int)
            for p in _document_pieces(cfg, t, L, 0):
                got[p.q0:p.q1, p.k0:p.k1] += KIND_MASKS[p.kind](p.q1 - p.q0, p.k1 - p.k0)
            assert torch.equal(got, want.int()), (r, t)


def test_layout_without_documents_is_refused():
    with pytest.raises(ValueError, match="needs the documents"):
        RingAttention(group=None, rank=0, size=2, causal=True, scale=1.0, backend="cpu_flash",
                      layout=((0, 3),))
    with pytest.raises(ValueError, match="zigzag=False"):
        SequenceParallelDims(4, 2, 2, zigzag=False, per_document=True)
    with pytest.raises(ValueError, match="per_document must be True or False"):
        SequenceParallelDims(4, 2, 2, per_document=1)


# --- across ranks ---------------------------------------------------------------------------

def _cut_and_back(world, U, R):
    """shard / gather round trips with documents, padded and not, on a per-document mesh;
    and the refusals of segments= elsewhere."""
    mesh = get_mesh(world, U, R, "per_document")
    x = torch.arange(2 * 50 * 3, dtype=torch.float32).reshape(2, 50, 3)
    docs = ((0, 7, 31), (0, 44))
    piece = shard_sequence(x, mesh, dim=1, pad=True, pad_value=-1, segments=docs)
    back = gather_sequence(piece, mesh, dim=1, unpadded_len=50, segments=docs)
    whole = shard_sequence(x, mesh, dim=1, pad=True, pad_value=-1)
    errors = []
    for call in (lambda: shard_sequence(x, get_mesh(world, U, R), pad=True, segments=docs),
                 lambda: shard_sequence(x, mesh, dim=2, pad=True, segments=docs),
                 lambda: shard_sequence(x, mesh, pad=True, segments=((0, 60), (0,)))):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return torch.equal(back, x), piece, whole, errors


@pytest.mark.parametrize("world,U,R", [(2, 1, 2), (4, 2, 2)], ids=["r2", "u2r2"])
def test_cut_by_documents_round_trips(world, U, R):
    results = dist_pool.run(_cut_and_back, world, U, R, world_size=world)
    assert all(ok for ok, *_ in results)
    # the cut follows the documents: some rank's piece differs from the whole-row zigzag's
    assert any(not torch.equal(p, w) for _, p, w, _ in results)
    for *_, errors in results:
        assert len(errors) == 3
        assert "per_document=True" in errors[0]
        assert "dim 1" in errors[1]
        assert "start at 0 and increase" in errors[2]


# (world, ulysses, ring, layout, heads, kv heads, head chunk, window, sinks, documents)
CASES = {
    "r2": (2, 1, 2, "per_document", 2, 1, None, None, False, ((0, 20, 45, 97), (0, 64, 70))),
    "u2r2_chunked_window_sinks": (4, 2, 2, "per_document", 4, 2, 1, 21, True,
                                  ((0, 3, 45, 101), (0, 33, 100))),
    "r4_full_documents": (4, 1, 4, "per_document", 2, 1, None, None, False,
                          ((0, 9, 60, 61), (0, 100))),
    "u2r2_seq_chunk_sinks": (4, 2, 2, "per_document", 4, 2, 1, None, True,
                             ((0, 20, 45, 97), (0, 33, 100))),
}
SEQ_CHUNK = {"u2r2_seq_chunk_sinks": 2}
SLOW = {"r4_full_documents"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_documents_in_their_layout(name):
    window = CASES[name][7]
    causal = name != "r4_full_documents"
    (q, k, v, dout, sinks), want = check_case(name, CASES[name], seed=5, causal=causal,
                                              seq_chunk=SEQ_CHUNK.get(name))
    one_document = reference(q, k, v, dout, window=window, sinks=sinks, causal=causal)
    assert (one_document[0] - want[0]).abs().max() > 1e-2


def _layout_segments_case():
    """Attention documents that cut the layout's further (Llama4's chunks of each document):
    the ring reads the rows' positions from ``layout_segments``."""
    mesh = get_mesh(2, 1, 2, "per_document")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 8, generator=g) for _ in range(3))
    docs, chunks = ((0, 13),), ((0, 8, 13, 21, 29, 37, 45, 53, 61),)
    local = [shard_sequence(t, mesh, segments=docs) for t in (q, k, v)]
    out = ulysses_attention(*local, mesh=mesh, causal=True, segments=chunks,
                            layout_segments=docs)
    wrong = ulysses_attention(*local, mesh=mesh, causal=True, segments=chunks)
    return (gather_sequence(out, mesh, segments=docs),
            gather_sequence(wrong, mesh, segments=docs), (q, k, v))


def test_layout_segments_apart_from_the_attention_documents():
    (out, wrong, (q, k, v)), _ = dist_pool.run(_layout_segments_case, world_size=2)
    want = reference(q, k, v, torch.zeros_like(q), starts=((0, 8, 13, 21, 29, 37, 45, 53, 61),))
    torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=1e-5)
    assert (wrong.double() - want[0]).abs().max() > 1e-2


def test_document_pieces_find_runs_by_bisection_and_agree_with_a_scan():
    """``band.document_pieces`` finds each document's runs by bisection (a per-document
    layout holds two runs per document): the same pieces as scanning every run for every
    document, on layouts of many documents; and a repeated call is served from the cache."""
    from ulysses.band import document_pieces, mask_pieces, runs_within
    from ulysses.sharding import rows_of

    rng = random.Random(7)
    for _ in range(5):
        R, total = rng.choice([2, 4]), 2 * 4 * rng.randint(50, 200)
        starts = (0,) + tuple(sorted(rng.sample(range(1, total), rng.randint(1, 60))))
        L = total // R
        q = rows_of(ring_runs(total, R, 1, starts), 0, L)
        k = rows_of(ring_runs(total, R, 0, starts), 0, L)
        for causal, window in ((True, None), (True, 7), (False, None)):
            scan = []
            for a, e in zip(starts, starts[1:] + (total,)):
                qs, ks = runs_within(q, a, e), runs_within(k, a, e)
                if qs and ks:
                    scan += mask_pieces(qs, ks, causal=causal, window=window)
            got = document_pieces(q, k, starts, total, causal=causal, window=window)
            assert list(got) == scan
            assert document_pieces(q, k, starts, total, causal=causal, window=window) is got
