"""``ulysses.seq_chunk`` through the recipe (arctic.recipe.apply_sp_recipe): a HF model with
sequence-chunked attention trains to the loss and gradients of the unchunked one, its chunk
buffers are a block's, and the config refuses what the loop does not support."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 96, 256


def _rank_train(seq_chunk, fuse, ring):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from arctic.plan import buffer_pools

    sp = SequenceParallelConfig(sequence_parallel_size=2, ring_degree=ring, head_chunk_size=1,
                                seq_chunk=seq_chunk,
                                fuse_projections=fuse, tiled_mlp=2, tiled_layer=True,
                                activation_checkpointing=True, offload_activations=True)
    mesh = sp.dims(dist.get_world_size()).build_mesh("cpu")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    apply_sp_recipe(model, config=sp, mesh=mesh, averaged_over_sp=True)
    model.activation_offload.min_bytes = 0
    largest = [0]
    for pool in buffer_pools(model):
        pool.on_allocate = lambda buf: largest.__setitem__(0, max(largest[0], buf.numel()))
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
    loss = model(**prepare_sp_batch({"input_ids": ids}, mesh))
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, largest[0]


@pytest.mark.parametrize("fuse,ring", [(False, 1), (True, 1), (True, 2)],
                         ids=["unfused", "fused", "fused-ring2"])
def test_seq_chunked_model_matches_unchunked(fuse, ring):
    """Ulysses 2 (or a ring of 2), one head per chunk, 4 blocks of the 48 rows per rank: the
    same loss and gradients (to float32 rounding: the blocks change the order of the softmax
    sums), and the largest chunk buffer is a quarter of the unchunked one's."""
    base = dist_pool.run(_rank_train, None, fuse, ring, world_size=2)
    chunked = dist_pool.run(_rank_train, 4, fuse, ring, world_size=2)
    for (l0, g0, big0), (l1, g1, big1) in zip(base, chunked):
        assert abs(l1 - l0) <= 1e-6 * abs(l0)
        for n, g in g0.items():
            torch.testing.assert_close(g1[n], g, atol=2e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
        assert big1 * 4 == big0, (big0, big1)


def test_config_refuses_seq_chunk_it_cannot_run():
    from arctic.config import SequenceParallelConfig

    assert "needs ulysses.head_chunk_size" in value_error_of(
        lambda: SequenceParallelConfig(seq_chunk=2))
    assert "ulysses.seq_chunk must be null" in value_error_of(
        lambda: SequenceParallelConfig(head_chunk_size=1, seq_chunk=0))
