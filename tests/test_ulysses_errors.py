"""Bad input raises ValueError (or NotImplementedError) on every rank before any collective.

Each case runs on all 4 ranks. Afterwards the ranks run a real ulysses_attention call: if any
rank had entered a collective for a bad case, the exchanges would be out of step and this
call would fail or hang (the pool's timeout turns a hang into a failure).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dist_pool
from helpers import get_mesh
from ulysses import (DistributedAttention, SequenceParallelDims, gather_sequence, shard_sequence,
                     ulysses_attention)


def _t(*shape):
    return torch.randn(*shape)


def _cases(mesh, hybrid, ring4):
    """``mesh``: U=4; ``hybrid``: U=2 x R=2; ``ring4``: U=1 x R=4 (all zigzag)."""
    group = mesh["ulysses"].get_group()
    sdpa = lambda q, k, v: q  # noqa: E731 - never reached: validation fails first
    attn = lambda q, k, v, **kw: ulysses_attention(q, k, v, mesh=mesh, **kw)  # noqa: E731
    return {
        "seq_not_divisible": lambda: shard_sequence(_t(2, 30, 4, 8), mesh),
        "heads_fewer_than_degree": lambda: attn(_t(1, 8, 3, 8), _t(1, 8, 3, 8), _t(1, 8, 3, 8),
                                                causal=True),
        "kv_not_replicable": lambda: attn(_t(1, 8, 12, 8), _t(1, 8, 3, 8), _t(1, 8, 3, 8),
                                          causal=True),
        "q_not_multiple_of_kv": lambda: attn(_t(1, 8, 8, 8), _t(1, 8, 3, 8), _t(1, 8, 3, 8),
                                             causal=True),
        "q_k_lengths_differ": lambda: attn(_t(1, 8, 4, 8), _t(1, 6, 4, 8), _t(1, 6, 4, 8),
                                           causal=False),
        "unpadded_len_too_big": lambda: attn(_t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8),
                                             causal=False, unpadded_len=33),
        "backend_unknown": lambda: attn(_t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8),
                                        causal=True, backend="flash9"),
        "backend_wrong_device": lambda: attn(_t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8),
                                             causal=True, backend="sdpa_flash"),
        "dtype_mismatch": lambda: attn(_t(1, 8, 4, 8), _t(1, 8, 4, 8).double(),
                                       _t(1, 8, 4, 8).double(), causal=True),
        "not_a_mesh": lambda: ulysses_attention(_t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8),
                                                mesh=group, causal=True),
        "gather_unpadded_too_long": lambda: gather_sequence(_t(1, 8, 4), mesh, unpadded_len=40),
        "dims_not_dividing": lambda: SequenceParallelDims(4, 3),
        "da_batch_dim": lambda: DistributedAttention(sdpa, group)(
            _t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8), 2),
        "da_num_kv_heads": lambda: DistributedAttention(sdpa, group, num_kv_heads=2)(
            _t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8), 0),
        "da_too_few_heads": lambda: DistributedAttention(sdpa, group)(
            _t(8, 1, 2, 8), _t(8, 1, 2, 8), _t(8, 1, 2, 8), 1),
        "da_scatter_idx": lambda: DistributedAttention(sdpa, group, scatter_idx=1),
        "chunk_not_divisor": lambda: attn(_t(1, 8, 8, 8), _t(1, 8, 8, 8), _t(1, 8, 8, 8),
                                          causal=True, head_chunk_size=3),
        "chunk_uneven_heads": lambda: attn(_t(1, 8, 6, 8), _t(1, 8, 6, 8), _t(1, 8, 6, 8),
                                           causal=True, head_chunk_size=2),
        "chunk_bad_type": lambda: attn(_t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8),
                                       causal=True, head_chunk_size="big"),
        "shard_bad_dim": lambda: shard_sequence(_t(32), mesh, dim=1),
        "zigzag_seq_not_divisible": lambda: shard_sequence(_t(2, 12, 4, 8), hybrid),
        "zigzag_odd_rows": lambda: ulysses_attention(_t(1, 3, 4, 8), _t(1, 3, 4, 8),
                                                     _t(1, 3, 4, 8), mesh=ring4, causal=True),
        "hybrid_unpadded_len": lambda: ulysses_attention(
            _t(1, 8, 4, 8), _t(1, 8, 4, 8), _t(1, 8, 4, 8), mesh=hybrid, causal=False,
            unpadded_len=33),
        "gather_zigzag_bad_len": lambda: gather_sequence(_t(1, 3, 4), hybrid),
    }


def _rank_errors():
    mesh, hybrid, ring4 = get_mesh(4, 4), get_mesh(4, 2, 2), get_mesh(4, 1, 4)
    raised = {}
    for name, thunk in _cases(mesh, hybrid, ring4).items():
        try:
            thunk()
            raised[name] = ("no error", "")
        except (ValueError, NotImplementedError) as e:
            raised[name] = (type(e).__name__, str(e))
    # Still in step: a real exchange works on every rank.
    q = torch.randn(1, 8, 4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = ulysses_attention(q, q, q, mesh=mesh, causal=True)
    ulysses_attention(q, q, q, mesh=hybrid, causal=True)  # and a hybrid ring exchange
    dist.barrier()
    return raised, tuple(out.shape)


EXPECTED = {
    "seq_not_divisible": ("ValueError", ["30", "4", "pad=True"]),
    "heads_fewer_than_degree": ("ValueError", ["(3)", "ulysses_degree (4)"]),
    "kv_not_replicable": ("ValueError", ["num_kv_heads (3)", "ulysses_degree (4)", "[1, 2, 3, 6"]),
    "q_not_multiple_of_kv": ("ValueError", ["(8)", "(3)"]),
    "q_k_lengths_differ": ("ValueError", ["8", "6"]),
    "unpadded_len_too_big": ("ValueError", ["33", "32"]),
    "backend_unknown": ("ValueError", ["flash9"]),
    "backend_wrong_device": ("ValueError", ["sdpa_flash", "CUDA"]),
    "dtype_mismatch": ("ValueError", ["float32", "float64"]),
    "not_a_mesh": ("ValueError", ["DeviceMesh"]),
    "gather_unpadded_too_long": ("ValueError", ["40", "32"]),
    "dims_not_dividing": ("ValueError", ["(3)", "world_size (4)"]),
    "da_batch_dim": ("ValueError", ["batch_dim_idx", "2"]),
    "da_num_kv_heads": ("ValueError", ["num_kv_heads (2)", "(4)"]),
    "da_too_few_heads": ("ValueError", ["(2)", "ulysses_degree (4)"]),
    "da_scatter_idx": ("ValueError", ["scatter_idx", "1"]),
    "chunk_not_divisor": ("ValueError", ["head_chunk_size=3", "[2, 2, 2, 2]", "valid values: [1, 2]"]),
    "chunk_uneven_heads": ("ValueError", ["[2, 2, 1, 1]", "valid values: [1]"]),
    "chunk_bad_type": ("ValueError", ["'big'"]),
    "shard_bad_dim": ("ValueError", ["dim 1", "1-D"]),
    "zigzag_seq_not_divisible": ("ValueError", ["12", "2 * ring * ulysses = 8", "pad=True"]),
    "zigzag_odd_rows": ("ValueError", ["zigzag", "got 3", "pad=True"]),
    "hybrid_unpadded_len": ("ValueError", ["33", "32"]),
    "gather_zigzag_bad_len": ("ValueError", ["3", "12", "8"]),
}


def test_bad_input_raises_on_every_rank_without_hanging():
    results = dist_pool.run(_rank_errors, world_size=4, timeout=60)
    for rank, (raised, out_shape) in enumerate(results):
        assert out_shape == (1, 8, 4, 8)
        assert set(raised) == set(EXPECTED)
        for name, (kind, needles) in EXPECTED.items():
            got_kind, msg = raised[name]
            assert got_kind == kind, f"rank {rank} {name}: {got_kind} {msg}"
            for needle in needles:
                assert needle in msg, f"rank {rank} {name}: {needle!r} not in {msg!r}"
