"""arctic.data: label shifting before sharding, padding, zigzag, and sample accounting."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh, value_error_of


def _rank_prepare(ulysses, ring, S, packed):
    from arctic.data.batch import prepare_sp_batch
    from ulysses import gather_sequence

    mesh = get_mesh(ulysses * ring, ulysses, ring)
    ids = torch.arange(100, 100 + S)[None].repeat(2, 1)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, S, dtype=torch.long)}
    batch["attention_mask"][1, S - 3:] = 0  # row 1 is right-padded by 3
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(S - 5)])[None].repeat(2, 1)
    local = prepare_sp_batch(batch, mesh)
    return {k: gather_sequence(v, mesh, dim=1) for k, v in local.items()}, \
        {k: tuple(v.shape) for k, v in local.items()}


@pytest.mark.parametrize("ulysses,ring,packed", [(2, 1, False), (2, 2, False), (1, 4, True)])
def test_prepare_shifts_before_sharding_and_pads(ulysses, ring, packed):
    S = 21
    sp = ulysses * ring
    n = -(-S // (2 * sp if ring > 1 else sp)) * (2 * sp if ring > 1 else sp)
    for full, shapes in dist_pool.run(_rank_prepare, ulysses, ring, S, packed, world_size=sp):
        assert all(s == (2, n // sp) for s in shapes.values())
        ids, pos, lab = full["input_ids"], full["position_ids"], full["shift_labels"]
        assert ids[:, :S].tolist() == [list(range(100, 100 + S))] * 2 and (ids[:, S:] == 0).all()
        want = torch.arange(101, 101 + S)[None].repeat(2, 1)
        want[:, -1] = -100                   # the last token predicts nothing
        want[1, S - 4:] = -100               # right padding (labels of masked tokens)
        if packed:
            want[:, 4] = -100                # end of the first document
            assert pos[0, :S].tolist() == list(range(5)) + list(range(S - 5))
        else:
            assert pos[0, :S].tolist() == list(range(S))
        assert lab[:, :S].tolist() == want.tolist() and (lab[:, S:] == -100).all()
        # The padding is a document of its own (positions restart at its first token), so
        # no real token sees it without a causal mask either: row 0 from S, row 1 from its
        # attention_mask's first 0.
        assert pos[0, S:].tolist() == list(range(n - S))
        assert pos[1, S - 3:].tolist() == list(range(n - S + 3))


def _rank_bad_batches():
    from arctic.data.batch import prepare_sp_batch

    mesh, ids = get_mesh(1, 1), torch.zeros(1, 4, dtype=torch.long)
    cases = {"input_ids": {"labels": ids},
             "left or inner padding": {"input_ids": ids,
                                       "attention_mask": torch.tensor([[0, 1, 1, 1]])},
             "labels shape": {"input_ids": ids, "labels": torch.zeros(1, 5, dtype=torch.long)},
             # a key the cut does not read is refused, not dropped (Gemma3's image tokens)
             "['token_type_ids'] are not read": {"input_ids": ids, "token_type_ids": ids},
             # TRL's padding-free seq_idx must number the documents the positions give
             "seq_idx changes where no document starts": {
                 "input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1]]),
                 "seq_idx": torch.tensor([[0, 0, 0, 1]], dtype=torch.int32)}}
    got = {}
    for needle, batch in cases.items():
        try:
            prepare_sp_batch(batch, mesh)
            got[needle] = "no error"
        except ValueError as e:
            got[needle] = str(e)
    trl = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1]]),
           "seq_idx": torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)}
    got["accepted"] = sorted(prepare_sp_batch(trl, mesh))
    return got


def test_prepare_rejects_bad_batches():
    (got,) = dist_pool.run(_rank_bad_batches, world_size=1)
    # seq_idx that numbers the documents is checked and dropped (only token mixers outside
    # attention read it, and those are refused)
    assert "seq_idx" not in got.pop("accepted")
    for needle, msg in got.items():
        assert needle in msg, msg


def _rank_loader(world, ulysses):
    from arctic.data.loader import SequenceParallelDataLoader
    from arctic.data.batch import prepare_sp_batch

    mesh = get_mesh(world, ulysses)
    data = [{"input_ids": torch.full((8,), i)} for i in range(10)]
    loader = SequenceParallelDataLoader(data, mesh, batch_size=2, seed=3)
    loader.set_epoch(1)
    seen = [int(v) for b in loader for v in b["input_ids"][:, 0]]
    # The cut is the collate function's, and it pickles (loader workers may be spawned).
    import pickle

    samples = [{"input_ids": torch.arange(8) + 10 * i} for i in range(2)]
    copy = pickle.loads(pickle.dumps(loader.collate_fn))
    direct = prepare_sp_batch({"input_ids": torch.stack([s["input_ids"] for s in samples])},
                              mesh)
    cut_alike = all(torch.equal(copy(samples)[k], direct[k]) for k in direct)
    return mesh["dp"].get_local_rank(), len(loader), seen, cut_alike


def test_loader_gives_an_sp_group_the_same_samples_and_counts_samples():
    """4 ranks as dp=2 x sp=2: SP peers read the same samples; the dp replicas split the 10
    samples (5 each, 3 batches of 2 with the last one short); len() counts batches of samples,
    not samples x sp."""
    results = dist_pool.run(_rank_loader, 4, 2, world_size=4)
    by_dp = {}
    for dp, length, seen, cut_alike in results:
        assert length == 3 and cut_alike
        by_dp.setdefault(dp, []).append(seen)
    assert all(a == b for a, b in by_dp.values())  # both SP ranks of a dp replica agree
    assert sorted(by_dp[0][0] + by_dp[1][0]) == list(range(10))


def _rank_given_shift_labels():
    from arctic.data.batch import prepare_sp_batch
    from ulysses import gather_sequence

    mesh = get_mesh(2, 2)
    S = 12
    ids = torch.arange(100, 100 + S)[None]
    positions = torch.cat([torch.arange(5), torch.arange(S - 5)])[None]  # two documents
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, S - 2:] = 0
    shift = torch.full((1, S), -100)
    shift[0, :-1] = ids[0, 1:]  # every next token, across the documents too

    def full(batch):
        local = prepare_sp_batch(batch, mesh)
        return gather_sequence(local["shift_labels"], mesh, dim=1)[0, :S].tolist()

    from_labels = full({"input_ids": ids, "position_ids": positions, "attention_mask": mask})
    given = full({"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                  "shift_labels": shift})
    both = value_error_of(lambda: prepare_sp_batch(
        {"input_ids": ids, "labels": ids, "shift_labels": shift}, mesh))
    return from_labels, given, both


def test_shift_labels_in_the_batch_are_taken_as_given():
    """HF's pre-shifted shift_labels in the batch: each token keeps its own target (here the
    one across the document boundary too, which labels would drop), -100 under the
    attention mask's padding; labels and shift_labels together are refused."""
    for from_labels, given, both in dist_pool.run(_rank_given_shift_labels, world_size=2):
        nxt = list(range(101, 112))
        assert from_labels == nxt[:4] + [-100] + nxt[5:9] + [-100, -100, -100]
        assert given == nxt[:10] + [-100, -100]
        assert "labels and shift_labels: give one" in both
