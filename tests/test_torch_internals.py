"""ulysses.torch_internals: every private piece of torch this project reads, on the torch
that runs the suite (CI runs it on the tested torch and on the newest), and nowhere else.

- Each piece behaves as the code using it expects: fake tensors and modes, pytree, the fake
  process group, MemTracker, a module's hook dicts, FSDP2's unit settings (offload, reshard,
  compute dtype), the CUDA allocator setter, torch's context-parallel attention.
- A piece that is missing raises TorchInternalsError naming the torch release.
- No other file of the library, the examples or the benchmarks imports a ``torch._*``
  module, a private name from torch, or reads the private attributes it wraps.
"""

from __future__ import annotations

import ast
import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_pool
import ulysses.torch_internals as ti

REPO = Path(__file__).resolve().parent.parent
PRIVATE_ATTRIBUTES = {"_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                      "_backward_pre_hooks", "_get_fsdp_state", "_fsdp_param_group",
                      "_fsdp_param_groups", "_set_allocator_settings", "_flatten", "_base",
                      "_version"}
"""Private attributes of torch objects that only ulysses/torch_internals.py reads."""


def _private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "torch":
            names = node.module.split(".") + [a.name for a in node.names]
            if any(n.startswith("_") for n in names):
                found.append(f"{node.lineno}: from {node.module} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and
                      any(n.startswith("_") for n in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if (isinstance(value, ast.Name) and value.id == "torch") or \
                    node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{node.lineno}: .{'.'.join(reversed(chain))}")
    return found


def test_no_other_file_reads_torch_internals():
    files = [p for d in ("ulysses", "arctic", "offload", "examples", "benchmarks")
             for p in sorted((REPO / d).rglob("*.py")) if p.name != "torch_internals.py"]
    assert len(files) > 50
    found = {str(p.relative_to(REPO)): uses for p in files if (uses := _private_uses(p))}
    assert not found, f"torch internals read outside ulysses/torch_internals.py: {found}"


def test_the_scan_finds_a_private_use(tmp_path):
    """The scan above can fail: each kind of private use is found."""
    f = tmp_path / "x.py"
    f.write_text("from torch._subclasses.fake_tensor import is_fake\n"
                 "import torch.utils._pytree\n"
                 "from torch.utils.checkpoint import _checkpoint_hook\n"
                 "torch.cuda.memory._set_allocator_settings('x')\n"
                 "m._forward_pre_hooks\n")
    assert len(_private_uses(f)) == 5


def test_fake_tensors_and_modes():
    with ti.FakeTensorMode() as mode:
        x = torch.empty(3, 4)
        assert ti.is_fake(x) and ti.detect_fake_mode((x,)) is mode
        with ti.unset_fake_temporarily():
            assert not ti.is_fake(torch.zeros(2))
        with ti.disable_current_modes():
            assert not ti.is_fake(torch.zeros(2))
    assert not ti.is_fake(torch.zeros(2))


def test_pytree_round_trip():
    tree = ((torch.ones(1), 2), {"a": torch.zeros(2), "b": None})
    leaves, spec = ti.tree_flatten(tree)
    back = ti.tree_unflatten(leaves, spec)
    assert back[0][1] == 2 and back[1]["b"] is None and torch.equal(back[1]["a"], tree[1]["a"])


def test_fake_process_group_in_its_own_process():
    code = ("import torch, torch.distributed as dist\n"
            "from ulysses.torch_internals import fake_store\n"
            "dist.init_process_group('fake', store=fake_store(), rank=0, world_size=8)\n"
            "t = torch.ones(4)\n"
            "dist.all_reduce(t)\n"
            "print(dist.get_world_size(), dist.get_backend())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["8", "fake"]


def test_mem_tracker_counts_an_allocation():
    MemTracker, total_key, ref_type, get_untyped_storages = ti.mem_tracker()
    assert hasattr(ref_type, "ACT") and callable(get_untyped_storages)
    mt = MemTracker()
    with mt:
        x = torch.empty(1 << 20, dtype=torch.uint8)
    peak = max(mt.get_tracker_snapshot("peak")[torch.device("cpu")][total_key] for _ in [0])
    assert peak >= x.numel()


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_step_mem_tracker_keeps_memtrackers_step_peak_and_no_module_peaks(fake):
    """The same peak snapshot as MemTracker's, byte for byte, over a step through many
    modules, on real tensors and on fake ones (the planner's); the per-module peaks MemTracker
    keeps (a walk over every module it has seen, at each allocation) are not kept. A fake
    tensor's ``.device`` reaches the tracker as an op (most of the ops a step on fake tensors
    dispatches): it is answered without MemTracker's tracking of results, since it has none."""
    MemTracker = ti.mem_tracker()[0]
    dispatched, tracked = [], []

    class Ours(ti.step_mem_tracker_class()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _tracked_dispatch(self, func, types, args, kwargs):
            tracked.append(func)
            return super()._tracked_dispatch(func, types, args, kwargs)

    snaps = []
    with ti.FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                for _ in range(6)))
        x = torch.randn(16, 32)
        for tracker in (MemTracker(), Ours()):
            tracker.track_external(model, x)
            with tracker:
                model(x).square().sum().backward()
            model.zero_grad(set_to_none=True)
            snaps.append((tracker.get_tracker_snapshot("peak"), tracker))
    (full, torch_tracker), (step, ours) = snaps
    assert step == full and full[x.device]["Total"] > 0
    device = torch.ops.prim.device.default
    assert device not in tracked and len(tracked) == len(dispatched) - dispatched.count(device)
    assert dispatched.count(device) > (len(dispatched) // 2 if fake else -1)
    # MemTracker raises a module's peak inside it; ours only notes it at the module's ends
    dev = x.device
    inside = [t.local_peak[dev] > o.local_peak.get(dev, 0) for t, o in
              zip(torch_tracker.memory_tracking.values(), ours.memory_tracking.values())]
    assert len(inside) == len(list(model.modules())) and any(inside)


def test_forward_hooks_swap():
    m = nn.Linear(2, 2)
    m.register_forward_pre_hook(lambda mod, args: None)
    m.register_forward_hook(lambda mod, args, out: None)
    pre, post = ti.forward_hooks(m)
    assert len(pre) == 1 and len(post) == 1
    ti.set_forward_hooks(m, {}, {})
    assert ti.forward_hooks(m) == ({}, {})
    ti.set_forward_hooks(m, pre, post)
    assert ti.forward_hooks(m)[0] is pre


def test_tensor_and_mesh_internals():
    x = torch.arange(6.0)
    view = x[2:]
    assert ti.view_base(view) is x and ti.view_base(x) is x
    before = ti.tensor_version(x)
    x.add_(1)
    assert ti.tensor_version(x) == before + 1
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(getattr(DeviceMesh, "_flatten", None))  # flatten_mesh's target


def test_cuda_allocator_setter_exists():
    assert callable(ti.cuda_allocator_setter())


def test_context_parallel_internals():
    attention, unshard = ti.context_parallel_internals()
    assert callable(unshard) and isinstance(attention.custom_ops, dict)
    assert callable(attention._templated_ring_attention)


def _rank_fsdp_units():
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                offload_policy=CPUOffloadPolicy(pin_memory=False), reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    assert OffloadPolicy is not None
    return ti.fsdp_unit_settings(model[0]), ti.fsdp_unit_settings(model)


def test_fsdp_unit_settings():
    layer, root = dist_pool.run(_rank_fsdp_units, world_size=1)[0]
    assert layer == {"offload_policy": "CPUOffloadPolicy", "reshard_after_forward": False,
                     "param_dtype": "torch.bfloat16"}
    assert root["offload_policy"] == "OffloadPolicy" and root["param_dtype"] == "torch.float32"


def test_a_missing_piece_names_the_torch_release():
    class Unit:
        def _get_fsdp_state(self):
            return object()  # neither _fsdp_param_groups nor _fsdp_param_group

    with pytest.raises(ti.TorchInternalsError, match=re.escape(f"torch {torch.__version__}: ")):
        ti.fsdp_param_groups(Unit())
