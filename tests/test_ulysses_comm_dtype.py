"""``comm_dtype``: what the sequence-parallel exchanges carry, and why float32 is more accurate.

For bf16 inputs, carrying q/k/v/out/dout in float32 is lossless either way, so forward outputs
and dq must be identical under both settings. What float32 changes is the sums that the
exchanges make: the gradients of kv heads replicated to several ranks, the dk/dv of a kv chunk
shared by several q chunks, and the dk/dv partial sums travelling around a ring. Each case
checks that those come out closer to the float64 reference with float32 communication than
with bf16, and that the collectives really carried the requested dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dist_pool
from helpers import count_collectives, get_mesh, make_qkv, reference
from ulysses import gather_sequence, shard_sequence, ulysses_attention
from ulysses.fused_attention import fused_attention

S, D = 64, 8
# name: (world, ulysses, ring, H, K, head_chunk_size)
CASES = {
    "ulysses_mqa_replicated": (4, 4, 1, 8, 1, None),
    "chunked_gqa_shared_kv": (2, 2, 1, 8, 2, 1),
    "chunked_mqa_replicated": (4, 4, 1, 4, 1, 1),
    "ring4": (4, 1, 4, 4, 2, None),
}


class _Traffic:
    """Records the dtypes of the tensors handed to torch.distributed's exchanges."""

    NAMES = ("all_to_all", "all_to_all_single", "batch_isend_irecv")

    def __enter__(self):
        self.dtypes, self._saved = set(), {n: getattr(dist, n) for n in self.NAMES}

        def recording(fn):
            def call(*args, **kwargs):
                for a in args:
                    for t in (a if isinstance(a, (list, tuple)) else [a]):
                        if isinstance(t, torch.Tensor):
                            self.dtypes.add(t.dtype)
                        elif isinstance(t, dist.P2POp):
                            self.dtypes.add(t.tensor.dtype)
                return fn(*args, **kwargs)
            return call

        for n, fn in self._saved.items():
            setattr(dist, n, recording(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)


def _rank_case(name, comm):
    world, U, R, H, K, chunk = CASES[name]
    mesh = get_mesh(world, U, R)
    q, k, v, dout = make_qkv(3, 2, S, H, K, D, torch.bfloat16)
    local = [shard_sequence(t, mesh, dim=1).requires_grad_() for t in (q, k, v)]
    with _Traffic() as traffic:
        out = ulysses_attention(*local, mesh=mesh, causal=True, head_chunk_size=chunk,
                                comm_dtype=comm)
        out.backward(shard_sequence(dout, mesh, dim=1))
    full = [gather_sequence(t, mesh, dim=1) for t in (out.detach(), *(x.grad for x in local))]
    return full, traffic.dtypes


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_communication_is_closer_to_fp64_than_bf16(name):
    world = CASES[name][0]
    q, k, v, dout = make_qkv(3, 2, S, CASES[name][3], CASES[name][4], D, torch.bfloat16)
    want = reference(q, k, v, dout, causal=True)
    runs = {c: dist_pool.run(_rank_case, name, c, world_size=world)
            for c in (None, torch.float32, torch.bfloat16)}
    (fp32, fp32_traffic), (bf16, bf16_traffic) = runs[torch.float32][0], runs[torch.bfloat16][0]
    assert fp32_traffic == {torch.float32}, fp32_traffic
    assert bf16_traffic == {torch.bfloat16}, bf16_traffic
    # Lossless either way: q/k/v/out/dout are bf16 values; only the sums differ.
    for what, a, b in zip(("out", "dq"), fp32, bf16):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{name} {what}")
    for what, a, b, ref in zip(("dk", "dv"), fp32[2:], bf16[2:], want[2:]):
        e32, e16 = _rel(a, ref), _rel(b, ref)
        assert e32 < 0.95 * e16, f"{name} {what}: fp32 comm error {e32:.3e}, bf16 {e16:.3e}"
        assert e32 < 1e-2, f"{name} {what}: {e32:.3e}"
    if name == "ring4":  # without a comm dtype, the ring's sums travel in float32
        for a, b in zip(runs[None][0][0], fp32):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def _rank_fused(comm):
    mesh = get_mesh(2, 2)
    g = torch.Generator().manual_seed(5)
    B, E, H, K = 1, 32, 8, 2
    x = torch.randn(B, S, E, generator=g).bfloat16()
    w = {n: (torch.randn(rows, cols, generator=g) / cols ** 0.5).bfloat16().requires_grad_()
         for n, rows, cols in (("wq", H * D, E), ("wk", K * D, E), ("wv", K * D, E),
                               ("wo", E, H * D))}
    pos = torch.arange(S, dtype=torch.float32)
    freqs = pos[:, None] / 10000 ** (torch.arange(0, D, 2) / D)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (shard_sequence(t(emb)[None].bfloat16(), mesh, dim=1) for t in (torch.cos,
                                                                            torch.sin))
    x_local = shard_sequence(x, mesh, dim=1).requires_grad_()
    with _Traffic() as traffic:
        y = fused_attention(x_local, cos, sin, **w, num_heads=H, num_kv_heads=K, mesh=mesh,
                            head_chunk_size=1, comm_dtype=comm)
        y.float().square().sum().backward()
    return [t.detach().double() for t in (y, x_local.grad, w["wk"].grad)], traffic.dtypes


def test_fused_attention_carries_comm_dtype():
    fp32, t32 = dist_pool.run(_rank_fused, torch.float32, world_size=2)[0]
    bf16, t16 = dist_pool.run(_rank_fused, torch.bfloat16, world_size=2)[0]
    none, _ = dist_pool.run(_rank_fused, None, world_size=2)[0]
    assert t32 == {torch.float32} and t16 == {torch.bfloat16}, (t32, t16)
    torch.testing.assert_close(fp32[0], bf16[0], atol=0, rtol=0)  # forward: lossless
    for a, b in zip(bf16, none):  # bf16 inputs: bf16 communication is the default
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # The kv gradient sums two q chunks per kv chunk: fp32 keeps the sum unrounded.
    assert not torch.equal(fp32[2], bf16[2])


def _rank_bad(bad):
    mesh = get_mesh(2, 2)
    q = torch.zeros(1, 4, 2, 8, requires_grad=True)
    with count_collectives() as counts:
        try:
            ulysses_attention(q, q, q, mesh=mesh, causal=True, comm_dtype=bad)
        except ValueError as e:
            return str(e), dict(counts)
    return None, dict(counts)


@pytest.mark.parametrize("bad", ["fp32", torch.int32, 32])
def test_bad_comm_dtype_is_refused_before_any_collective(bad):
    for message, counts in dist_pool.run(_rank_bad, bad, world_size=2):
        assert message is not None and "comm_dtype" in message, message
        assert counts == {}, counts


def _rank_config_key(comm):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe

    ds = {"sequence_parallel_size": 4, "ulysses": {"head_chunk_size": None}}
    if comm is not None:
        ds["seq_parallel_communication_data_type"] = comm
    config = SequenceParallelConfig.from_ds_config(ds, world_size=4)
    mesh = get_mesh(4, 4)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").bfloat16()
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    tokens = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    batch = prepare_sp_batch({"input_ids": tokens}, mesh)
    with _Traffic() as traffic:
        model(**batch, use_cache=False).backward()  # apply_sp_loss: the forward returns the loss
    grad = model.model.layers[0].self_attn.k_proj.weight.grad.double()
    return traffic.dtypes, grad


def test_config_key_sets_what_the_model_exchanges():
    """``seq_parallel_communication_data_type`` reaches the attention of a bf16 model: its
    all-to-alls carry that dtype, and the gradient sum of the kv head replicated to 4 ranks
    is rounded once instead of three times."""
    runs = {c: dist_pool.run(_rank_config_key, c, world_size=4)[0] for c in (None, "fp32", "bf16")}
    assert runs[None][0] == {torch.bfloat16}
    assert runs["bf16"][0] == {torch.bfloat16}
    assert torch.float32 in runs["fp32"][0] and torch.bfloat16 not in runs["fp32"][0]
    assert torch.equal(runs[None][1], runs["bf16"][1])
    assert not torch.equal(runs["fp32"][1], runs["bf16"][1])
