"""SequenceParallelDims, build_mesh and the DeepSpeed mpu adapter."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import dist_pool
from ulysses import DeepSpeedMPU, SequenceParallelDims, all_to_all, flat_mesh


@pytest.mark.parametrize("world,u,r,dp", [(8, 8, 1, 1), (8, 4, 1, 2), (8, 2, 2, 2), (1, 1, 1, 1)])
def test_degrees(world, u, r, dp):
    dims = SequenceParallelDims(world, u, r)
    assert (dims.dp, dims.sp) == (dp, u * r)
    assert SequenceParallelDims(world_size=world, ulysses_degree=u, ring_degree=r) == dims


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=6, ulysses_degree=4), "must divide world_size (6)"),
    (dict(world_size=8, ulysses_degree=2, ring_degree=3), "ring_degree (3) = 6"),
    (dict(world_size=8, ulysses_degree=0), "ulysses_degree must be a positive int"),
    (dict(world_size=8, ulysses_degree=2.0), "positive int"),
])
def test_bad_degrees(kwargs, needle):
    with pytest.raises(ValueError, match=None) as info:
        SequenceParallelDims(**kwargs)
    assert needle in str(info.value)


def _rank_mpu(world, u, r):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = SequenceParallelDims(world, u, r).build_mesh("cpu")
        mpu = DeepSpeedMPU(mesh)  # reads the flattened axes (flat_mesh), not mesh["sp"]
        flat = {k: dist.get_process_group_ranks(flat_mesh(mesh, k).get_group())
                for k in ("sp", "dp_sp")}
    try:
        flat_mesh(mesh, "ring")
    except ValueError as e:
        refused = str(e)
    ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
    return dict(
        names=mesh.mesh_dim_names, shape=tuple(mesh.shape),
        sp=(mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
            ranks(mpu.get_sequence_parallel_group())),
        # No data-parallel accessors: ZeRO-3 would partition over them (see DeepSpeedMPU).
        has_dp=any(hasattr(mpu, f"get_data_parallel_{x}") for x in
                   ("group", "world_size", "rank", "group_ranks")),
        dp=(mesh["dp"].size(), mesh["dp"].get_local_rank(), ranks(mesh["dp"].get_group())),
        sdp=(mpu.get_sequence_data_parallel_world_size(), mpu.get_sequence_data_parallel_rank(),
             ranks(mpu.get_sequence_data_parallel_group())),
        mp=mpu.get_model_parallel_world_size(),
        ulysses=ranks(mesh["ulysses"].get_group()),
        flat=flat, refused=refused,
        warned=[str(w.message) for w in caught if "flatten" in str(w.message)],
    )


def test_mpu_dp2_ulysses2():
    res = dist_pool.run(_rank_mpu, 4, 2, 1, world_size=4)
    for rank, r in enumerate(res):
        assert r["names"] == ("dp", "ring", "ulysses") and r["shape"] == (2, 1, 2)
        base = rank // 2 * 2
        assert r["sp"] == (2, rank % 2, [base, base + 1])
        assert r["ulysses"] == [base, base + 1]
        assert r["dp"] == (2, rank // 2, [rank % 2, rank % 2 + 2]) and not r["has_dp"]
        assert r["sdp"] == (4, rank, [0, 1, 2, 3])
        assert r["mp"] == 2
        assert r["flat"] == {"sp": [base, base + 1], "dp_sp": [0, 1, 2, 3]}
        assert "no flattened axis 'ring'" in r["refused"] and not r["warned"], r


def test_mpu_ring2_ulysses2():
    res = dist_pool.run(_rank_mpu, 4, 2, 2, world_size=4)
    for rank, r in enumerate(res):
        assert r["shape"] == (1, 2, 2)
        assert r["sp"] == (4, rank, [0, 1, 2, 3])
        assert r["ulysses"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["dp"][:3] == (1, 0, [rank])


def _rank_two_meshes():
    """Two SP configurations in one process, used interleaved: no shared global state."""
    a = SequenceParallelDims(4, 4).build_mesh("cpu")
    b = SequenceParallelDims(4, 2).build_mesh("cpu")
    x = torch.arange(4 * 4, dtype=torch.float32).view(1, 4, 4, 1) + 100 * dist.get_rank()
    ya = all_to_all(x, a["ulysses"].get_group(), scatter_dim=2, gather_dim=1)
    yb = all_to_all(x, b["ulysses"].get_group(), scatter_dim=2, gather_dim=1)
    mpus = DeepSpeedMPU(a), DeepSpeedMPU(b)
    return tuple(ya.shape), tuple(yb.shape), [m.get_sequence_parallel_world_size() for m in mpus]


def test_two_configurations_in_one_process():
    for ya, yb, sizes in dist_pool.run(_rank_two_meshes, world_size=4):
        assert ya == (1, 16, 1, 1) and yb == (1, 8, 2, 1) and sizes == [4, 2]


def _rank_world_mismatch():
    try:
        SequenceParallelDims(8, 4).build_mesh("cpu")
    except ValueError as e:
        dist.barrier()
        return str(e)
    return None


def test_build_mesh_world_mismatch_raises_on_every_rank():
    for msg in dist_pool.run(_rank_world_mismatch, world_size=2):
        assert msg is not None and "world_size (8)" in msg and "(2)" in msg


@pytest.mark.parametrize("u,r,zigzag,divisor", [(4, 1, True, 4), (2, 2, True, 8),
                                                (2, 2, False, 4), (1, 4, True, 8)])
def test_seq_len_divisor_is_the_layouts_padding_rule(u, r, zigzag, divisor):
    dims = SequenceParallelDims(world_size=8, ulysses_degree=u, ring_degree=r, zigzag=zigzag)
    assert dims.seq_len_divisor == divisor
    assert dims.zigzag_ring == (zigzag and r > 1)


def test_zigzag_must_be_a_bool():
    with pytest.raises(ValueError, match="zigzag must be True or False"):
        SequenceParallelDims(world_size=4, ulysses_degree=2, ring_degree=2, zigzag="no")


def _rank_layout_travels_with_the_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from ulysses import mesh_dims, padded_len, shard_sequence, ulysses_attention

    zig = SequenceParallelDims(4, 2, 2).build_mesh("cpu")
    flat = SequenceParallelDims(4, 2, 2, zigzag=False).build_mesh("cpu")
    x = torch.arange(16.0)[None]
    got = {"zig": shard_sequence(x, zig)[0].tolist(), "flat": shard_sequence(x, flat)[0].tolist(),
           "padded": (padded_len(9, zig), padded_len(9, flat)),
           "dims": (mesh_dims(zig).zigzag, mesh_dims(flat).zigzag)}
    # A mesh with the right axis names but no description is refused, before any collective.
    bare = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ring", "ulysses"))
    q = torch.zeros(1, 4, 4, 8)
    try:
        ulysses_attention(q, q, q, mesh=bare, causal=True)
    except ValueError as e:
        got["bare"] = str(e)
    return got


def test_the_sequence_layout_travels_with_the_mesh():
    results = dist_pool.run(_rank_layout_travels_with_the_mesh, world_size=4)
    # Zigzag: ring rank 0 holds chunks 0 and 3 of 4 (split over its two Ulysses ranks), ring
    # rank 1 chunks 1 and 2. Contiguous: sp rank i holds block i.
    zig = [list(range(0, 4)), list(range(12, 16)), list(range(4, 8)), list(range(8, 12))]
    for i, r in enumerate(results):
        assert r["zig"] == [float(p) for p in zig[i]]
        assert r["flat"] == [float(p) for p in range(4 * i, 4 * i + 4)]
        assert r["padded"] == (16, 12)
        assert r["dims"] == (True, False)
        assert "SequenceParallelDims" in r["bare"]


_EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from ulysses import SequenceParallelDims

def after_the_mesh():  # registered first, so it runs after the mesh's handler
    with open(sys.argv[1], "w") as f:
        f.write(str(dist.is_initialized()))

atexit.register(after_the_mesh)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0,
                        world_size=1)
if sys.argv[2] == "mesh":
    SequenceParallelDims(1, 1).build_mesh("cpu")
"""


def test_a_gloo_group_the_mesh_runs_on_is_destroyed_at_exit(tmp_path):
    """A script that builds the mesh and returns without destroy_process_group() (HF's Trainer,
    DeepSpeed's documented loops) has its gloo group destroyed by an atexit handler, before
    interpreter teardown, where gloo's worker threads can abort a finished run. Without the
    mesh, the group is still up at exit: the check sees the difference."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    seen = {}
    for mode in ("mesh", "none"):
        out = tmp_path / mode
        subprocess.run([sys.executable, str(script), str(out), mode], check=True, timeout=120)
        seen[mode] = out.read_text()
    assert seen == {"mesh": "False", "none": "True"}
