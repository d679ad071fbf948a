"""``recompute_attention=False``: checkpointed layers keep their attention results and the
recompute in backward runs no attention kernel, with gradients bit-identical to the full
recompute (plain Ulysses, head-chunked, fused, hybrid ring, with and without offload); the
kept results go to the host with the layer inputs; what cannot keep them is refused.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import value_error_of

pytest.importorskip("transformers", reason="the layer tests use HF models ([hf])")

LAYERS, SEQ, HIDDEN = 2, 512, 128
# 512 tokens: on 4 ranks a layer input (and the kept out) is 128 x 128 fp32 = 64 KiB, the
# smallest saved tensor offload moves (DEFAULT_MIN_OFFLOAD_BYTES).


def _model(kind: str = "llama"):
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    common = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ)
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "nemotron_h":  # a Mamba2 layer, an attention layer, an MLP layer
        cfg = transformers.NemotronHConfig(
            **{k: v for k, v in common.items() if k != "num_hidden_layers"}, head_dim=32,
            layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4,
            mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=64)
    else:  # a gated delta net layer, then a (gated) attention layer
        cfg = transformers.Qwen3_5TextConfig(
            **common, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _rank_step(fields: dict, world: int, documents: bool = False, kind: str = "llama"):
    """One forward/backward of the SP model built from ``fields``; returns the loss, the
    gradients, the attention kernel's forward calls in forward and in backward, and the
    offload pool's stats."""
    from arctic import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    import ulysses.kernels as kernels

    # The kernel calls counted are the step's: no first-use check (ulysses.self_check) among
    # them, whichever test ran first in this worker.
    config = SequenceParallelConfig(sequence_parallel_size=world, kernel_self_check=False,
                                    **fields)
    mesh = config.dims(world).build_mesh("cpu")
    model = _model(kind)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 28)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids}
    if documents:  # two packed documents: the attention masks across their boundary
        cut = SEQ // 3
        sample["position_ids"] = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])[None]
    batch = prepare_sp_batch(sample, mesh)
    calls = []
    real = kernels._FORWARD["cpu_flash"]

    def counted(*args):
        calls.append(1)
        return real(*args)

    kernels._FORWARD["cpu_flash"] = counted
    try:
        loss = model(**batch)
        forward_calls = len(calls)
        loss.backward()
    finally:
        kernels._FORWARD["cpu_flash"] = real
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    session = model.activation_offload
    stats = None if session is None else session.pool.stats
    return (loss.detach(), grads, forward_calls, len(calls) - forward_calls,
            None if stats is None else (stats.bytes_offloaded, stats.peak_host_bytes))


STACKS = {
    "ulysses": dict(),
    "chunked": dict(head_chunk_size=1),
    "fused": dict(head_chunk_size=1, fuse_projections=True),
    "hybrid": dict(ring_degree=2, head_chunk_size=1),
}


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_kept_attention_gradients_are_bit_identical_and_skip_the_recompute(stack, offload):
    world = 4 if stack == "hybrid" else 2
    fields = dict(STACKS[stack], activation_checkpointing=True, offload_activations=offload)
    full = dist_pool.run(_rank_step, fields, world, world_size=world)
    kept = dist_pool.run(_rank_step, {**fields, "recompute_attention": False}, world,
                         world_size=world)
    for (loss_f, grads_f, fwd_f, bwd_f, stats_f), (loss_k, grads_k, fwd_k, bwd_k, stats_k) \
            in zip(full, kept):
        assert torch.equal(loss_f, loss_k)
        for name in grads_f:
            assert torch.equal(grads_f[name], grads_k[name]), name
        # The full recompute runs every attention forward again in backward; kept runs none.
        assert fwd_f == fwd_k > 0
        assert bwd_f == fwd_f and bwd_k == 0, (bwd_f, bwd_k)
        if offload:
            # The kept out (B x s x hidden, fp32 here) goes to the host with the layer input.
            s = SEQ // world
            out_bytes = s * HIDDEN * 4
            assert stats_k[0] - stats_f[0] >= LAYERS * out_bytes, (stats_f, stats_k)
            assert stats_k[1] - stats_f[1] >= LAYERS * out_bytes, (stats_f, stats_k)


@pytest.mark.parametrize("kind,offload", [("qwen3_5", True), ("nemotron_h", False),
                                         pytest.param("qwen3_5", False, marks=pytest.mark.slow),
                                         pytest.param("nemotron_h", True,
                                                      marks=pytest.mark.slow)])
def test_a_hybrid_keeps_its_attention_layers_results_and_recomputes_its_mixers(kind, offload):
    """Qwen3.5 (a gated delta net layer, then an attention layer) and Nemotron-H (a Mamba2
    layer, an attention layer, an MLP layer): the attention layer keeps its results; the
    mixer layers, with no attention to keep, recompute as with True. The same gradients, bit
    for bit, and no attention kernel in the backward."""
    import transformers
    if not hasattr(transformers, {"qwen3_5": "Qwen3_5TextConfig",
                                  "nemotron_h": "NemotronHConfig"}[kind]):
        pytest.skip(f"this transformers has no {kind}")
    fields = dict(activation_checkpointing=True, offload_activations=offload)
    full = dist_pool.run(_rank_step, fields, 2, False, kind, world_size=2)
    kept = dist_pool.run(_rank_step, {**fields, "recompute_attention": False}, 2, False,
                         kind, world_size=2)
    for (loss_f, grads_f, fwd_f, bwd_f, stats_f), (loss_k, grads_k, fwd_k, bwd_k, stats_k) \
            in zip(full, kept):
        assert torch.equal(loss_f, loss_k)
        for name in grads_f:
            assert torch.equal(grads_f[name], grads_k[name]), name
        assert fwd_f == fwd_k == 1 and bwd_f == 1 and bwd_k == 0, (fwd_f, fwd_k, bwd_f, bwd_k)
        if offload:  # the one attention layer's out went to the host with its input
            out_bytes = SEQ // 2 * HIDDEN * 4
            assert stats_k[0] - stats_f[0] >= out_bytes, (stats_f, stats_k)


@pytest.mark.parametrize("chunked", [False, True], ids=["ulysses", "chunked"])
def test_kept_attention_with_packed_documents(chunked):
    """Documents reach the attention through the model's checkpoint context (the batch the
    forward saw); kept attention composes with it and stays bit-identical."""
    fields = dict(activation_checkpointing=True, offload_activations=True,
                  head_chunk_size=1 if chunked else None)
    full = dist_pool.run(_rank_step, fields, 2, True, world_size=2)
    kept = dist_pool.run(_rank_step, {**fields, "recompute_attention": False}, 2, True,
                         world_size=2)
    plain = dist_pool.run(_rank_step, fields, 2, False, world_size=2)
    for f, k, p in zip(full, kept, plain):
        assert not torch.equal(f[0], p[0])  # the documents changed the loss
        assert torch.equal(f[0], k[0])
        assert all(torch.equal(f[1][n], k[1][n]) for n in f[1])
        assert k[3] == 0 < f[3]


def _rank_refusals():
    from arctic import SequenceParallelConfig, apply_activation_checkpointing
    from arctic.recipe import apply_sp_recipe

    errors = {}
    errors["no SP attention"] = value_error_of(
        lambda: apply_activation_checkpointing(_model(), recompute_attention=False))
    model = _model()
    config = SequenceParallelConfig(sequence_parallel_size=2)
    apply_sp_recipe(model, config=config, mesh=config.dims(2).build_mesh("cpu"),
                    averaged_over_sp=True)
    errors["not a bool"] = value_error_of(
        lambda: apply_activation_checkpointing(model, recompute_attention="no"))
    return errors


def test_kept_attention_is_refused_where_it_would_have_no_effect():
    from arctic import SequenceParallelConfig

    errors = dist_pool.run(_rank_refusals, world_size=2)[0]
    assert "call arctic.apply_sequence_parallel" in errors["no SP attention"], errors
    assert "recompute_attention must be True or False" in errors["not a bool"], errors
    err = value_error_of(lambda: SequenceParallelConfig(recompute_attention=False))
    assert "recompute_attention=false needs activation_checkpointing" in err, err
    err = value_error_of(lambda: SequenceParallelConfig.from_ds_config(
        {"ulysses": {"recompute_attention": "false"}}))
    assert "recompute_attention must be true or false" in err, err


def test_a_checkpointed_layer_without_our_attention_is_refused_at_its_forward():
    """offload's generic ``keep=``: a layer whose forward records nothing is refused."""
    import offload
    from ulysses.keep import KeptAttention

    layer = torch.nn.Linear(4, 4)
    offload.apply_activation_checkpointing(layer, layers=[layer], keep=KeptAttention)
    err = value_error_of(lambda: layer(torch.randn(2, 4, requires_grad=True)))
    assert "Linear ran no attention that can keep its results" in err, err


def test_only_the_layers_named_keeping_keep():
    """offload's ``keeping=``: the layers that keep; the others recompute everything (and so
    are not refused for recording nothing). It must name some of ``layers``, with ``keep``."""
    import offload
    from ulysses.keep import KeptAttention

    def two():
        return torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    a, b = two()
    holder = torch.nn.Sequential(a, b)
    offload.apply_activation_checkpointing(holder, layers=[a, b], keep=KeptAttention,
                                           keeping=[a])
    x = torch.randn(2, 4, requires_grad=True)
    b(x).sum().backward()  # b keeps nothing: checkpointed as usual
    assert x.grad is not None
    assert "Linear ran no attention that can keep its results" in value_error_of(lambda: a(x))
    a, b = two()
    err = value_error_of(lambda: offload.apply_activation_checkpointing(
        torch.nn.Sequential(a), layers=[a], keep=KeptAttention, keeping=[b]))
    assert "keeping= must be a non-empty subset of layers=" in err, err
    err = value_error_of(lambda: offload.apply_activation_checkpointing(
        torch.nn.Sequential(a), layers=[a], keeping=[a]))
    assert "keeping= names the layers that keep results, and needs keep=" in err, err


def test_the_recompute_refuses_a_different_attention_call():
    """The store checks each replayed call against what the forward recorded."""
    from ulysses.keep import KeptAttention, kept_or_computed

    store = KeptAttention()
    record, replay = store.contexts()
    with record:
        kept_or_computed(("a", (1, 2)), lambda: (torch.ones(2),))
    with replay, pytest.raises(RuntimeError, match="the forward recorded"):
        kept_or_computed(("a", (1, 3)), lambda: (torch.ones(3),))
    store = KeptAttention()
    with store.contexts()[0]:
        kept_or_computed(("a",), lambda: (torch.ones(2),))
    with store.contexts()[1]:
        assert torch.equal(kept_or_computed(("a",), lambda: (torch.zeros(2),))[0],
                           torch.ones(2))
        with pytest.raises(RuntimeError, match="more attention calls than the forward"):
            kept_or_computed(("a",), lambda: (torch.zeros(2),))
