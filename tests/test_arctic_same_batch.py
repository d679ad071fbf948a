"""An SP group's ranks hold one batch: prepare_sp_batch refuses, on every rank, batches that
differ across the group, and arctic.sp_sampler deals a loader of one's own over dp only."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh, value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")


def _batch(seed: int, S: int = 12, B: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50, (B, S), generator=g)}


def test_the_fingerprint_tells_apart_what_a_wrong_loader_gives():
    """Another sample, rows swapped, a shift by one, another length, a label more: each
    changes the fingerprint; the same batch built again does not."""
    from arctic.data.same_batch import batch_fingerprint

    base = _batch(0)
    ids = base["input_ids"]
    assert torch.equal(batch_fingerprint(base), batch_fingerprint(_batch(0)))
    variants = {
        "another sample": _batch(1),
        "rows swapped": {"input_ids": ids.flip(0)},
        "shifted by one": {"input_ids": ids.roll(1, dims=1)},
        "one token": {"input_ids": torch.where(torch.arange(12) == 5, ids + 1, ids)},
        "shorter": {"input_ids": ids[:, :-1]},
        "transposed shape": {"input_ids": ids.reshape(12, 2)},
        "with labels": {**base, "labels": ids},
        "float bits": {**base, "pixel_values": torch.ones(3)},
    }
    for name, batch in variants.items():
        assert not torch.equal(batch_fingerprint(batch), batch_fingerprint(base)), name
    a = {**base, "pixel_values": torch.ones(3)}
    b = {**base, "pixel_values": torch.ones(3).nextafter(torch.tensor(2.0))}
    assert not torch.equal(batch_fingerprint(a), batch_fingerprint(b))  # one ulp apart


def _rank_refused(world, ulysses, ring, bad_group):
    """Each rank prepares a batch; the ranks of SP group ``bad_group`` (dp index) get batches
    that differ by rank, the others the same one per group (dp groups differ, as they may)."""
    from arctic.data.batch import prepare_sp_batch

    mesh = get_mesh(world, ulysses, ring)
    dp, sp = mesh.get_local_rank("dp"), mesh.get_local_rank("ulysses") + \
        ulysses * mesh.get_local_rank("ring")
    results = {}
    for case in ("values", "length", "keys"):
        batch = _batch(100 + dp)
        if dp == bad_group and sp == 1:
            batch = {"values": _batch(7), "length": _batch(100 + dp, S=14),
                     "keys": {**batch, "labels": batch["input_ids"]}}[case]
        results[case] = value_error_of(lambda: prepare_sp_batch(batch, mesh))
    results["same again"] = value_error_of(lambda: prepare_sp_batch(_batch(100 + dp), mesh))
    return dp, results


@pytest.mark.parametrize("world,ulysses,ring,bad_group", [
    (2, 2, 1, 0),  # SP=2
    pytest.param(4, 2, 1, 1, marks=pytest.mark.slow),  # dp2 x SP2: the second group only
    pytest.param(4, 1, 2, 0, marks=pytest.mark.slow),  # a ring of 2, dp 2
])
def test_different_batches_are_refused_on_every_rank_of_the_group(world, ulysses, ring,
                                                                 bad_group):
    for dp, results in dist_pool.run(_rank_refused, world, ulysses, ring, bad_group,
                                     world_size=world):
        assert results.pop("same again") == "no error", results
        for case, msg in results.items():
            if dp == bad_group:
                assert "were given different batches" in msg and "sp_sampler" in msg, (case, msg)
                assert "SP ranks [1] differ" in msg, msg
            else:
                assert msg == "no error", (dp, case, msg)


def _rank_loaders(world, ulysses):
    from torch.utils.data import DataLoader, DistributedSampler

    import arctic
    from arctic.data.loader import SequenceParallelDataLoader

    mesh = get_mesh(world, ulysses)
    data = [{"input_ids": torch.arange(8) + 10 * i} for i in range(10)]
    ours = SequenceParallelDataLoader(data, mesh, batch_size=2, seed=3)
    sampler = arctic.sp_sampler(data, mesh, seed=3)
    own = DataLoader(data, batch_size=2, sampler=sampler)
    by_epoch = []
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        sampler.set_epoch(epoch)
        by_epoch.append([(a["input_ids"], b["input_ids"])
                         for a, b in zip(ours, (arctic.prepare_sp_batch(b, mesh) for b in own),
                                         strict=True)])
    # what the user wrote: a DistributedSampler over every rank
    plain = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, seed=3))
    wrong = value_error_of(lambda: arctic.prepare_sp_batch(next(iter(plain)), mesh))
    return by_epoch, wrong


def test_sp_sampler_gives_the_loader_s_batches_and_a_plain_sampler_is_refused():
    """dp2 x SP2: a DataLoader with arctic.sp_sampler, then prepare_sp_batch, yields what
    SequenceParallelDataLoader yields, epoch by epoch (the epochs differ: set_epoch
    reshuffles); the DistributedSampler of the issue's script is refused."""
    for by_epoch, wrong in dist_pool.run(_rank_loaders, 4, 2, world_size=4):
        for batches in by_epoch:
            assert len(batches) == 3
            assert all(torch.equal(a, b) for a, b in batches)
        assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(*by_epoch))
        assert "were given different batches" in wrong, wrong


def _rank_initialize_loader(seed, shuffle):
    import arctic.train.deepspeed
    from arctic.data.loader import SequenceParallelDataLoader
    from helpers import init_deepspeed_comm
    from test_arctic_engine import _config, _model

    init_deepspeed_comm()
    data = [{"input_ids": torch.arange(16) + 100 * i} for i in range(6)]
    _, _, loader, _ = arctic.train.deepspeed.initialize(
        model=_model(), config=_config(0), training_data=data, seed=seed, shuffle=shuffle)
    ref = SequenceParallelDataLoader(data, loader.mesh, seed=seed, shuffle=shuffle)
    default = SequenceParallelDataLoader(data, loader.mesh)
    firsts = [[int(b["input_ids"][0, 0]) // 100 for b in it] for it in (loader, ref, default)]
    refused = value_error_of(lambda: arctic.train.deepspeed.initialize(
        model=_model(), config=_config(0), seed=seed)) if seed else None
    return firsts, refused


def test_initialize_takes_the_loader_s_shuffle_and_seed():
    for (got, ref, default), refused in dist_pool.run(_rank_initialize_loader, 5, True,
                                                       world_size=2):
        assert got == ref and got != default, (got, ref, default)  # the seed is honoured
        assert "seed: the loader's settings" in refused, refused
    for (got, ref, default), _ in dist_pool.run(_rank_initialize_loader, 0, False,
                                                world_size=2):
        assert got == ref == [0, 1, 2, 3, 4, 5], got  # in order: not shuffled

