""":class:`SequenceParallelDataLoader` feeds every rank of an SP group the same samples (the
sampler is split over the ``"dp"`` axis only) and counts samples, not samples x SP.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import BatchSampler, DataLoader, Dataset, default_collate

from arctic.data.batch import SequenceCut
from arctic.data.same_batch import sp_sampler
from arctic.data.vision import VisionInputs
from ulysses.mesh import check_mesh


class _SPCollate:
    """The user's collate, then this rank's cut: a loader rebuilt around the same
    ``collate_fn`` (accelerate's ``skip_first_batches`` does, to resume) still yields SP
    batches."""

    def __init__(self, collate_fn: Callable | None, cut: SequenceCut, pad_token_id: int):
        self.collate_fn = collate_fn or default_collate
        self.cut, self.pad_token_id = cut, pad_token_id

    def __call__(self, samples: list) -> dict[str, Tensor]:
        return self.cut(self.collate_fn(samples), self.pad_token_id)


class _EpochBatchSampler(BatchSampler):
    """A ``BatchSampler`` whose ``set_epoch`` reaches its ``DistributedSampler`` (the HF
    Trainer reaches a rebuilt loader's epoch through its batch sampler)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class SequenceParallelDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` whose batches are already SP shards.

    Samples are split over the mesh's ``"dp"`` axis only: the ranks of one SP group read the
    same samples and each keeps its piece of the sequence. ``len()`` is the number of batches
    per epoch of one dp rank, and :meth:`set_epoch` reshuffles, as with
    ``DistributedSampler``. The cut is part of ``collate_fn`` (it runs in the workers, and a
    loader rebuilt from this one's ``dataset``, ``batch_sampler`` and ``collate_fn`` yields
    the same batches).

    Args:
        dataset: yields what ``collate_fn`` turns into a batch dict with ``input_ids``.
        mesh: the SP mesh.
        batch_size: samples per batch on each dp rank.
        collate_fn: default ``torch.utils.data.default_collate``.
        shuffle, seed, drop_last: as for ``DistributedSampler``.
        pad_token_id, vision: as for :func:`prepare_sp_batch`.
        num_workers, pin_memory, persistent_workers, prefetch_factor,
        multiprocessing_context, in_order: as for ``DataLoader``.
    """

    def __init__(self, dataset: Dataset, mesh: DeviceMesh, *, batch_size: int = 1,
                 collate_fn: Callable | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad_token_id: int = 0,
                 vision: VisionInputs | None = None, num_workers: int = 0,
                 pin_memory: bool = False,
                 persistent_workers: bool = False, prefetch_factor: int | None = None,
                 multiprocessing_context=None, in_order: bool = True) -> None:
        check_mesh(mesh)
        # in_order is DataLoader's from torch 2.6: given only when it is not the default
        ordering = {} if in_order else {"in_order": False}
        self.mesh = mesh
        sampler = sp_sampler(dataset, mesh, shuffle=shuffle, seed=seed, drop_last=drop_last)
        super().__init__(dataset, batch_sampler=_EpochBatchSampler(sampler, batch_size,
                                                                   drop_last),
                         collate_fn=_SPCollate(collate_fn, SequenceCut.of(mesh, vision),
                                               pad_token_id),
                         num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                         multiprocessing_context=multiprocessing_context, **ordering)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
