"""The files DeepSpeed's shared-memory all-reduce leaves in ``/dev/shm``.

On a CPU-only machine DeepSpeed builds its ``deepspeed_shm_comm`` op when its communication
starts (``deepspeed.init_distributed``). Every rank then creates a 69 MB file in ``/dev/shm``
(``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``), maps every other
rank's, and never unlinks its own: each job leaves ranks x 69 MB of RAM-backed files behind.
On this repository's 24 GiB machine a day of CPU runs had filled ``/dev/shm`` to 22 GiB, with
no memory left to run anything. A later job on the same port also opens the stale files. Once
every rank has mapped every buffer, the names are no longer needed: each rank unlinks its
own, and the memory goes when the last process that maps it exits.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


def shm_buffer_name(rank: int) -> str:
    """The name DeepSpeed's op gives ``rank``'s buffer (``shm_interface.cpp``: an unset
    ``MASTER_ADDR`` or ``MASTER_PORT`` reads as empty)."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_deepspeed_shm() -> bool:
    """Unlink this rank's ``/dev/shm`` buffer of DeepSpeed's shared-memory all-reduce, if its
    communication built one. Every rank must call it: a barrier first makes sure every rank
    has mapped every buffer (DeepSpeed maps them all while it starts). Returns whether a file
    was removed."""
    import deepspeed.comm.comm as ds_comm

    if getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return False
    dist.barrier()
    try:
        (SHM_DIR / shm_buffer_name(dist.get_rank())).unlink()
    except FileNotFoundError:
        return False
    return True


__all__ = ["SHM_DIR", "release_deepspeed_shm", "shm_buffer_name"]
