"""The SP group's ranks must hold one batch; a loader of one's own must deal over dp only.

Every rank of a sequence-parallel group keeps its own piece of the *same* sequences. A
``DataLoader`` with a plain ``DistributedSampler`` deals samples over every rank instead, so
the SP ranks of one group would each cut a piece of a different batch, and train on pieces
that belong to no sequence, silently. :func:`sp_sampler` is the sampler that deals over the
mesh's ``"dp"`` axis only; :func:`check_same_batch` (run by :func:`arctic.prepare_sp_batch`
on every batch) all-gathers a fingerprint of each rank's full batch over the SP group and
refuses, on every rank, a batch that differs.

The fingerprint is integer arithmetic modulo a prime below 2**31 (no overflow, no rounding):
one value per tensor, over its shape and its elements weighted by their position, so that
another sample, another order or another length changes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset, DistributedSampler

from ulysses.mesh import axis_rank, axis_size, check_mesh, flat_mesh
from ulysses.trace_shortcuts import is_traced

_P = 2_147_483_647  # 2**31 - 1: every product of two residues fits in int64
_K = 1_000_003


def sp_sampler(dataset: Dataset, mesh: DeviceMesh, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = False) -> DistributedSampler:
    """A ``DistributedSampler`` over the mesh's ``"dp"`` axis: the ranks of one SP group draw
    the same samples, each dp group its own. ``shuffle``, ``seed``, ``drop_last`` and
    ``set_epoch`` are ``DistributedSampler``'s. Use it as a ``DataLoader``'s ``sampler``,
    then :func:`arctic.prepare_sp_batch` on each batch
    (:class:`arctic.data.SequenceParallelDataLoader` does both)."""
    check_mesh(mesh)
    return DistributedSampler(dataset, num_replicas=axis_size(mesh, "dp"),
                              rank=axis_rank(mesh, "dp"), shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def _as_integers(x: Tensor) -> Tensor:
    if x.dtype == torch.bool:
        return x.to(torch.int64)
    if x.is_floating_point() or x.is_complex():  # its bits, as integers of the same width
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = x.contiguous().view(width[x.element_size()])
    return x.to(torch.int64)


def _fingerprint_of(x: Tensor) -> Tensor:
    flat = torch.remainder(_as_integers(x).reshape(-1), _P)
    weight = torch.remainder(torch.arange(1, flat.numel() + 1, device=flat.device,
                                          dtype=torch.int64) * _K, _P)
    value = torch.remainder(flat * weight, _P).sum()
    shape = sum((i + 1) * 7919 * d for i, d in enumerate(x.shape))
    return torch.remainder(value + shape, _P)


def batch_fingerprint(batch: dict[str, Any]) -> Tensor:
    """``int64 [len(batch)]``: one value per entry, in key order (tensors by their values and
    shape, other values by their ``repr``'s characters)."""
    values = []
    for key in sorted(batch):
        value = batch[key]
        if not torch.is_tensor(value):
            value = torch.tensor([ord(c) for c in f"{key}={value!r}"], dtype=torch.int64)
        values.append(_fingerprint_of(value.detach().cpu()))
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.int64)


def check_same_batch(batch: dict[str, Any], mesh: DeviceMesh) -> None:
    """``ValueError`` on every rank of the SP group unless all of them hold this batch (same
    keys, shapes and values). One all-gather of a few integers per batch; nothing when the
    group is one rank or the batch is the planner's trace (fake tensors have no values)."""
    check_mesh(mesh)
    sp = axis_size(mesh, "ring") * axis_size(mesh, "ulysses")
    if sp == 1 or any(torch.is_tensor(v) and is_traced(v) for v in batch.values()):
        return
    keys = torch.tensor([len(batch), *(hash_key(k) for k in sorted(batch))], dtype=torch.int64)
    mine = torch.cat([keys, batch_fingerprint(batch)])
    group = flat_mesh(mesh, "sp").get_group()
    device = torch.device(mesh.device_type, torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    # lengths first: ranks whose batches have other keys send fingerprints of other lengths
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(sp)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=device), group=group)
    if len({int(s) for s in sizes}) == 1:
        gathered = [torch.zeros_like(mine, device=device) for _ in range(sp)]
        dist.all_gather(gathered, mine.to(device), group=group)
        differ = [r for r, g in enumerate(gathered) if not torch.equal(g.cpu(), gathered[0].cpu())]
    else:
        differ = [r for r, s in enumerate(sizes) if int(s) != int(sizes[0])]
    if differ:
        raise ValueError(
            f"the {sp} ranks of this sequence-parallel group were given different batches "
            f"(SP ranks {differ} differ from SP rank 0): each must hold the same full batch "
            f"and keeps its own piece of it. A DataLoader with a plain DistributedSampler deals "
            f"over every rank; deal over the mesh's data-parallel axis only: "
            f"DataLoader(dataset, sampler=arctic.sp_sampler(dataset, mesh), ...), or "
            f"arctic.data.SequenceParallelDataLoader(dataset, mesh, ...)")


def hash_key(key: str) -> int:
    """A key's name as an integer that every process computes alike (``hash`` of a str is
    salted per process)."""
    value = 0
    for c in key:
        value = (value * 131 + ord(c)) % _P
    return value
