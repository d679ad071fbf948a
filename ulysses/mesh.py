"""Sequence-parallel degrees, the device mesh, and a DeepSpeed ``mpu`` view of it.

The mesh has three axes, outermost first: ``("dp", "ring", "ulysses")``. Ulysses is the
innermost axis, so a Ulysses group is made of adjacent ranks (one node, NVLink) and its
all-to-alls stay inside the node; ring hops and data parallelism go across.

There are no module globals: a mesh and its groups are values that are passed around, so two
sequence-parallel configurations can live in one process.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ulysses.torch_internals import flatten_mesh

MESH_AXES = ("dp", "ring", "ulysses")


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(slots=True)
class SequenceParallelDims:
    """How ``world_size`` ranks split into data, ring and Ulysses parallelism.

    ``dp = world_size // (ulysses_degree * ring_degree)``. Every sequence-parallel (SP) group
    has ``ring_degree * ulysses_degree`` ranks, and those ranks also shard parameters.
    """

    world_size: int
    """Total number of ranks."""
    ulysses_degree: int
    """Ranks in one Ulysses (all-to-all) group."""
    ring_degree: int = 1
    """Ranks in one ring (KV-passing) group; 1 means pure Ulysses."""
    zigzag: bool = True
    """The sequence layout over the ring (ring_degree > 1): True cuts the sequence into 2R
    chunks and gives ring rank r chunks r and 2R-1-r, which balances causal work; False gives
    it block r. The mesh carries it (:func:`mesh_dims`), so the data side
    (``shard_sequence``) and the attention side read the same value. No effect without a
    ring."""
    per_document: bool = False
    """With a zigzag ring: cut each packed *document* into 2R chunks, ring rank r taking chunks
    r and 2R-1-r of every document (:func:`ulysses.sharding.ring_runs`), so that every
    document's causal work is spread evenly over the ring, not only the row's. The cut then
    depends on the documents, which ``shard_sequence``, ``gather_sequence`` and the attention
    take as ``segments=``. A row that is one document is cut as by ``zigzag``. No effect
    without a ring."""
    kernel_self_check: bool = True
    """Check each attention kernel against the float64 reference the first time this process
    runs it with a combination of device, dtype and mask features (:mod:`ulysses.self_check`),
    in every attention on this mesh. The mesh carries it, so two configurations in one
    process each keep their own."""

    def __post_init__(self) -> None:
        _check_degree("world_size", self.world_size)
        _check_degree("ulysses_degree", self.ulysses_degree)
        _check_degree("ring_degree", self.ring_degree)
        if not isinstance(self.zigzag, bool):
            raise ValueError(f"zigzag must be True or False, got {self.zigzag!r}")
        if not isinstance(self.per_document, bool):
            raise ValueError(f"per_document must be True or False, got {self.per_document!r}")
        if not isinstance(self.kernel_self_check, bool):
            raise ValueError(f"kernel_self_check must be True or False, got "
                             f"{self.kernel_self_check!r}")
        if self.per_document and not self.zigzag:
            raise ValueError("per_document=True is a zigzag layout of each document; it cannot "
                             "be combined with zigzag=False")
        sp = self.ulysses_degree * self.ring_degree
        if self.world_size % sp != 0:
            raise ValueError(
                f"ulysses_degree ({self.ulysses_degree}) * ring_degree ({self.ring_degree}) = {sp} "
                f"must divide world_size ({self.world_size}); choose degrees whose product divides "
                f"{self.world_size}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.ulysses_degree * self.ring_degree)

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks that share one sequence."""
        return self.ulysses_degree * self.ring_degree

    @property
    def zigzag_ring(self) -> bool:
        """Whether sequences are laid out in zigzag order (a zigzag layout with a ring)."""
        return self.zigzag and self.ring_degree > 1

    @property
    def per_document_ring(self) -> bool:
        """Whether rows with packed documents are cut document by document (a per-document
        layout with a ring)."""
        return self.per_document and self.ring_degree > 1

    @property
    def seq_len_divisor(self) -> int:
        """Full sequence lengths that split evenly over the sp ranks are the multiples of this:
        ``ring * ulysses``, twice that for the zigzag layout (two chunks per ring rank)."""
        return 2 * self.sp if self.zigzag_ring else self.sp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the ``("dp", "ring", "ulysses")`` DeviceMesh; every rank must call it.

        Raises ``ValueError`` if the default process group is missing or its size is not
        ``world_size``.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call "
                             "dist.init_process_group() before build_mesh()")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"SequenceParallelDims.world_size ({self.world_size}) does not match "
                             f"the process group's world size ({dist.get_world_size()})")
        mesh = init_device_mesh(device_type, (self.dp, self.ring_degree, self.ulysses_degree),
                                mesh_dim_names=MESH_AXES)
        end_gloo_group_at_exit()
        # "sp" (ring x ulysses) is what a loss all-reduce and DeepSpeed's SP group use;
        # "dp_sp" (every axis) is what ZeRO/FSDP shard over.
        # Kept on the mesh and read with flat_mesh(): slicing a flattened axis off the root
        # mesh warns of its deprecation from torch 2.11 on.
        mesh._sp_flat = {"sp": flatten_mesh(mesh["ring", "ulysses"], "sp"),
                         "dp_sp": flatten_mesh(mesh["dp", "ring", "ulysses"], "dp_sp")}
        # The description travels with the mesh: everything that cuts or attends a sequence
        # reads the layout from here, so the two sides cannot be given different ones.
        mesh._sp_dims = SequenceParallelDims(self.world_size, self.ulysses_degree,
                                             self.ring_degree, self.zigzag, self.per_document,
                                             self.kernel_self_check)
        return mesh


_END_AT_EXIT: list[bool] = []


def end_gloo_group_at_exit() -> None:
    """Destroy a gloo process group still up at interpreter exit (registered once per process).

    A gloo group left to the interpreter's teardown can end a finished run with ``terminate
    called without an active exception`` (exit status 1): its worker threads still hold work
    whose tensors are freed after the interpreter is gone. ``torchrun --nproc-per-node 5`` of
    a script that all-gathers once and returns did so in 8 of 20 runs here (torch 2.13), and
    in none of 20 with ``destroy_process_group()`` at its end. HF's Trainer and DeepSpeed's
    documented loops do not call it, so the mesh does, at exit, for gloo only: NCCL's teardown
    is collective and stays the script's own."""
    if _END_AT_EXIT:
        return
    _END_AT_EXIT.append(True)
    atexit.register(_end_gloo_group)


def _end_gloo_group() -> None:
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def check_mesh(mesh: DeviceMesh) -> None:
    """Raise ``ValueError`` unless ``mesh`` was built by :meth:`SequenceParallelDims.build_mesh`."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh from SequenceParallelDims.build_mesh(), "
                         f"got {type(mesh).__name__}")
    if mesh.mesh_dim_names != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES}, got {mesh.mesh_dim_names}; build it with "
                         f"SequenceParallelDims.build_mesh()")
    if not isinstance(getattr(mesh, "_sp_dims", None), SequenceParallelDims):
        raise ValueError("mesh carries no SequenceParallelDims (its sequence layout); build it "
                         "with SequenceParallelDims.build_mesh()")


def mesh_dims(mesh: DeviceMesh) -> SequenceParallelDims:
    """The :class:`SequenceParallelDims` ``mesh`` was built from: its degrees and its sequence
    layout (``zigzag``, ``seq_len_divisor``). ``ValueError`` for any other mesh."""
    check_mesh(mesh)
    return mesh._sp_dims


def flat_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The one-axis mesh over the flattened ``"sp"`` (ring x ulysses) or ``"dp_sp"`` (every
    axis) ranks of a mesh from :meth:`SequenceParallelDims.build_mesh`."""
    check_mesh(mesh)
    flat = getattr(mesh, "_sp_flat", {})
    if name not in flat:
        raise ValueError(f"the mesh has no flattened axis {name!r}; it has {sorted(flat)}")
    return flat[name]


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """Size of one mesh axis. Cheaper than ``mesh[axis].size()``, which builds a sub-mesh."""
    return mesh.size(MESH_AXES.index(axis))


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """This rank's process group along ``axis``."""
    return mesh.get_group(axis)


def axis_rank(mesh: DeviceMesh, axis: str) -> int:
    """This rank's index along ``axis``."""
    return mesh.get_local_rank(axis)


class DeepSpeedMPU:
    """DeepSpeed's ``mpu`` interface, answered from a mesh instead of module globals.

    Pass an instance as ``deepspeed.initialize(..., mpu=...)``. It mirrors
    ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (which DeepSpeed recognises by
    its ``initialize_sequence_parallel`` attribute) and, like that module, aliases "model
    parallel" to the SP group:

    - sequence parallel: the ring x ulysses ranks that share one sequence;
    - sequence data parallel: every rank, i.e. the ZeRO sharding and gradient-reduction group.

    It deliberately has no ``get_data_parallel_group``: ZeRO-3 partitions parameters over
    ``mpu.get_data_parallel_group()`` when that exists (``zero/parameter_offload.py``), and
    the dp axis alone would leave SP ranks unreduced, silently. Without it DeepSpeed falls back
    to the world group, which is the dp x sp group here. Data-parallel coordinates come from
    the mesh's ``"dp"`` axis.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        check_mesh(mesh)
        self.mesh = mesh
        self._sp = flat_mesh(mesh, "sp")
        self._dp_sp = flat_mesh(mesh, "dp_sp")

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """Groups already exist (they come from the mesh); only check the size agrees."""
        if sequence_parallel_size != self._sp.size():
            raise ValueError(f"sequence_parallel_size ({sequence_parallel_size}) does not match the "
                             f"mesh's ring x ulysses size ({self._sp.size()})")

    def get_sequence_parallel_group(self):
        return self._sp.get_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self._sp.size()

    def get_sequence_parallel_rank(self) -> int:
        return self._sp.get_local_rank()

    def get_sequence_data_parallel_group(self):
        return self._dp_sp.get_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._dp_sp.size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self._dp_sp.get_local_rank()

    # parallel_state_sp aliases model parallel to sequence parallel; DeepSpeed's checkpoint
    # naming and grad-norm code read these names.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank
