"""Ours and DeepSpeed's DistributedAttention on the same inputs must agree.

DeepSpeed's uneven-head path reads the SP rank from its process-wide ``groups.mpu``; those
cases install our :class:`DeepSpeedMPU` there, which also checks the adapter against
DeepSpeed's own use of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_pool
from helpers import TOL, get_mesh, init_deepspeed_comm, make_qkv
from ulysses import DeepSpeedMPU, DistributedAttention, shard_sequence, ulysses_attention


def _local_sdpa(q, k, v, batch_dim_idx=0):
    """What a DeepSpeed user passes as local_attention: SDPA on [b, S, h, d] or [S, b, h, d]."""
    to_bhsd = (lambda t: t.transpose(1, 2)) if batch_dim_idx == 0 else (lambda t: t.permute(1, 2, 0, 3))
    out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=True,
                                         enable_gqa=True)                        # [b, h, S, d]
    return out.transpose(1, 2) if batch_dim_idx == 0 else out.permute(2, 0, 1, 3)


def _run(attn_fn, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attn_fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_parity(world, H, K, batch_dim_idx, rotary, install_mpu):
    from deepspeed.sequence.layer import DistributedAttention as DSDistributedAttention
    from deepspeed.utils import groups

    init_deepspeed_comm()
    mesh = get_mesh(world, world)
    group = mesh["ulysses"].get_group()
    groups.mpu = DeepSpeedMPU(mesh) if install_mpu else None
    B, S, D = 2, 16 * world, 16
    q, k, v, dout = make_qkv(17, B, S, H, K, D, torch.float32)
    rot = None
    if rotary:
        g = torch.Generator().manual_seed(3)
        angles = torch.rand(S, B, 1, D // 2, generator=g).repeat(1, 1, 1, 2)
        rot = (angles.cos(), angles.sin())                                      # [S, b, 1, d]
    local = [shard_sequence(t, mesh, dim=1) for t in (q, k, v, dout)]
    if batch_dim_idx == 1:                                                      # [s, b, H, d]
        local = [t.transpose(0, 1).contiguous() for t in local]
    gather_idx = 1 - batch_dim_idx
    local_attn = lambda q, k, v: _local_sdpa(q, k, v, batch_dim_idx)  # noqa: E731
    ds = DSDistributedAttention(local_attn, group, scatter_idx=2, gather_idx=gather_idx)
    ours = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=gather_idx)
    got_ds = _run(lambda q, k, v: ds(q, k, v, batch_dim_idx, rot), *local)
    got_ours = _run(lambda q, k, v: ours(q, k, v, batch_dim_idx, rot), *local)
    got_fn = None
    if batch_dim_idx == 0 and not rotary:
        got_fn = _run(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True), *local)
    groups.mpu = None
    return got_ds, got_ours, got_fn


@pytest.mark.parametrize("world,H,K,install_mpu", [
    (2, 8, 2, False), (4, 8, 4, False), (4, 16, 8, False), (4, 6, 6, True), (2, 6, 3, True)],
    ids=["w2-gqa", "w4-gqa", "w4-gqa2", "w4-uneven-mha", "w2-uneven-gqa"])
@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["batch-first", "seq-first"])
def test_matches_deepspeed(world, H, K, install_mpu, batch_dim_idx):
    for got_ds, got_ours, got_fn in dist_pool.run(_rank_parity, world, H, K, batch_dim_idx, False,
                                                  install_mpu, world_size=world):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got_ours, got_ds):
            torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")
        if got_fn is not None:
            for name, a, b in zip(("out", "dq", "dk", "dv"), got_fn, got_ds):
                torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


def test_matches_deepspeed_with_rotary():
    for got_ds, got_ours, _ in dist_pool.run(_rank_parity, 2, 8, 2, 0, True, False, world_size=2):
        for a, b in zip(got_ours, got_ds):
            torch.testing.assert_close(a, b, **TOL[torch.float32])


def _rank_peak_memory(H, K):
    """MemTracker peak of one fwd+bwd, inputs allocated outside the tracker on both sides."""
    from deepspeed.sequence.layer import DistributedAttention as DSDistributedAttention
    from ulysses.torch_internals import step_mem_tracker

    init_deepspeed_comm()
    mesh = get_mesh(2, 2)
    q, k, v, dout = (shard_sequence(t, mesh).contiguous()
                     for t in make_qkv(5, 1, 512, H, K, 32, torch.float32))
    ds = DSDistributedAttention(_local_sdpa, mesh["ulysses"].get_group(), 2, 1)
    peaks = {}
    for name, fn in (("ours", lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True)),
                     ("deepspeed", lambda q, k, v: ds(q, k, v, 0))):
        runs = []
        for _ in range(3):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with step_mem_tracker() as mt:
                fn(*leaves).backward(dout)
            runs.append(mt.get_tracker_snapshot("peak")[q.device]["Total"])
        # gloo's worker thread drops its reference to a collective's buffers just after it
        # signals completion, so a buffer can now and then outlive its last use by a moment
        # (either side). That only ever adds memory: the minimum is the deterministic peak.
        peaks[name] = min(runs)
    return peaks


@pytest.mark.parametrize("H,K", [(8, 2), (2, 2)], ids=["gqa", "one-head-per-rank"])
def test_peak_memory_not_above_deepspeed(H, K):
    for peaks in dist_pool.run(_rank_peak_memory, H, K, world_size=2):
        assert peaks["ours"] <= peaks["deepspeed"], peaks


def _rank_deepspeed_initialize(stage):
    """deepspeed.initialize(mpu=DeepSpeedMPU(mesh)) builds its ZeRO groups from our mesh."""
    import deepspeed
    from deepspeed.utils import groups

    init_deepspeed_comm()
    mesh = get_mesh(4, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config, mpu=DeepSpeedMPU(mesh))
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        before = engine(x).sum().item()
        engine.backward(engine(x).sum())
        engine.step()
        after = engine(x).sum().item()
        return engine.seq_dp_world_size, engine.sequence_parallel_size, before, after
    finally:
        groups.mpu = None  # deepspeed.initialize installs it process-wide


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_initialize_with_mpu(stage):
    results = dist_pool.run(_rank_deepspeed_initialize, stage, world_size=4)
    for seq_dp, sp, before, after in results:
        assert (seq_dp, sp) == (4, 2)
        assert after < before  # one Adam step on sum(output) lowers it
    assert len({r[2:] for r in results}) == 1  # every rank holds the same (synced) model
