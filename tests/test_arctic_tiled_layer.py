"""``ulysses.tiled_layer`` (arctic.tiling.layer): each decoder layer's tail after attention as one
tiled unit. Same loss and gradients as the stock layer, one hidden-sized tensor less saved for
backward and at the planner's peak, and refusals for what it cannot reproduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dist_pool
from helpers import value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 96, 256


def _model(family: str, dtype=torch.float32, layers: int = 2):
    import transformers

    extra = {} if family != "Qwen3_5Text" else dict(  # a gated delta net, then attention
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=(["linear_attention", "full_attention"] * layers)[:layers])
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)


def _ids():
    return torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model):
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_skipped_tile_fails_the_check(monkeypatch):
    """Qwen3.5's tiled tails, with a tile left out of the forward and the backward, no longer
    match the stock layers: the check above can fail."""
    import arctic.tiling.layer as layer_module
    from arctic import apply_tiled_layers

    loss0, grads0 = _loss_and_grads(_model("Qwen3_5Text"))
    tiles = layer_module.tile_rows

    def all_but_one(*args):
        got = list(tiles(*args))
        return got[:1] + got[2:]

    monkeypatch.setattr(layer_module, "tile_rows", all_but_one)
    model = apply_tiled_layers(_model("Qwen3_5Text"), tiles=5)
    loss1, grads1 = _loss_and_grads(model)
    worst = max((grads1[n] - g).abs().max().item() for n, g in grads0.items())
    assert not torch.isclose(loss1, loss0, rtol=1e-4) or worst > 1e-3


@pytest.mark.hf_facing
@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3_5Text"])
@pytest.mark.parametrize("before", ["none", "tiled_mlp_and_norms"])
def test_tiled_layer_matches_the_stock_layer(family, before):
    from arctic import apply_tiled_layers, apply_tiled_mlp
    from arctic.tiling.norms import apply_tiled_norms

    loss0, grads0 = _loss_and_grads(_model(family))
    model = _model(family)
    if before != "none":
        apply_tiled_mlp(model, tiles=2)
        apply_tiled_norms(model, tiles=2)
    apply_tiled_layers(model, tiles=5)
    layers = model.model.layers
    assert all(m.forward.__func__.__name__ == "_tiled_layer_forward" for m in layers)
    loss1, grads1 = _loss_and_grads(model)
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=1e-6)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def test_tiled_layer_under_checkpointing_with_offload():
    from arctic import apply_activation_checkpointing, apply_tiled_layers

    loss0, grads0 = _loss_and_grads(_model("Llama"))
    model = _model("Llama")
    apply_tiled_layers(model, tiles=3)
    apply_activation_checkpointing(model, offload_to_cpu=True)
    model.activation_offload.min_bytes = 0
    loss1, grads1 = _loss_and_grads(model)
    assert model.activation_offload.pool.stats.bytes_offloaded > 0
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=1e-6)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def _saved_bytes(model, x, pe):
    """Bytes of the distinct storages one layer's forward saves for backward."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_embeddings=pe)
    seen.pop(x.untyped_storage().data_ptr(), None)  # the layer input is the caller's
    return sum(seen.values())


def test_tiled_layer_saves_the_attention_output_only():
    """Stock (with the MLP and norms tiled) saves the post-attention norm's input h and the
    MLP's input norm2(h); the tiled tail saves the attention output a (and the layer input,
    which the stock norm saves too): one [B, S, E] tensor less per layer."""
    from arctic import apply_tiled_layers, apply_tiled_mlp
    from arctic.tiling.norms import apply_tiled_norms

    hidden = 2 * S * 64 * 4  # [2, S, 64] float32
    out = {}
    for tiled in (False, True):
        model = _model("Llama", layers=1)
        apply_tiled_mlp(model, tiles=4)
        apply_tiled_norms(model, tiles=4)
        if tiled:
            apply_tiled_layers(model, tiles=4)
        x = torch.randn(2, S, 64, requires_grad=True)
        pe = model.model.rotary_emb(x, torch.arange(S)[None])
        out[tiled] = _saved_bytes(model, x, pe)
    assert out[False] - out[True] == hidden, out


@pytest.mark.slow  # 24 s; the saved tensor: test_tiled_layer_saves_the_attention_output_only
def test_planner_finds_one_hidden_tensor_less_at_the_peak(tmp_path):
    """Llama-3-8B, 2 layers, 1M tokens on ring 8 (131,072 tokens per rank): the backward peak
    of the tail held the MLP's input gradient beside the norm's; tiled, one [s, 4096] bf16
    tensor (1 GiB) is gone from the traced peak."""
    from test_arctic_plan import _plan

    args = ["--model", "llama3-8b", "--layers", "2", "--seq-len", "1M", "--gpus", "8",
            "--ring", "8", "--ulysses", "1"]
    tiled = _plan(tmp_path, *args, "--tiled-layer", name="t.json")["estimate"]
    stock = _plan(tmp_path, *args, "--no-tiled-layer", name="s.json")["estimate"]
    assert tiled["sp"]["tiled_layer"] and not stock["sp"]["tiled_layer"]
    hidden = 131072 * 4096 * 2
    saved = stock["device_peak_bytes"] - tiled["device_peak_bytes"]
    print(f"\ndevice peak: stock {stock['device_peak_bytes'] / 2**30:.2f} GiB, tiled layer "
          f"{tiled['device_peak_bytes'] / 2**30:.2f} GiB ({saved / hidden:.2f} hidden tensors)")
    assert saved >= 0.85 * hidden


def test_refusals():
    from arctic import apply_tiled_layers
    from arctic.config import SequenceParallelConfig

    assert "needs ulysses.tiled_mlp" in value_error_of(
        lambda: SequenceParallelConfig(tiled_layer=True))
    assert "must be true or false" in value_error_of(
        lambda: SequenceParallelConfig(tiled_mlp=2, tiled_layer="yes"))
    assert "'tiled_layer'" in value_error_of(lambda: SequenceParallelConfig.from_ds_config(
        {"ulysses": {"tiled_layers": True}}))

    model = _model("Llama")
    model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "LlamaDecoderLayer.mlp has forward hooks" in value_error_of(
        lambda: apply_tiled_layers(model))
    assert all("forward" not in vars(m) for m in model.model.layers)  # nothing changed

    model = _model("Llama")
    model.model.layers[0].extra_norm = nn.LayerNorm(64)
    assert "['extra_norm']" in value_error_of(lambda: apply_tiled_layers(model))

    model = _model("Llama")
    model.model.layers[0].forward = lambda *a, **k: None
    assert "already replaced" in value_error_of(lambda: apply_tiled_layers(model))

    class ArgsOnlyAttention(nn.Module):  # its input has no name to pass it by
        def forward(self, *args, **kwargs):
            return args[0], None

    model = _model("Llama")
    model.model.layers[1].self_attn = ArgsOnlyAttention()
    assert "LlamaDecoderLayer.self_attn.forward takes no named input" in value_error_of(
        lambda: apply_tiled_layers(model))

    class OtherDecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = nn.Linear(2, 2), nn.Linear(2, 2)

    model = _model("Llama")
    model.model.layers.append(OtherDecoderLayer())
    assert "OtherDecoderLayer may compute something else" in value_error_of(
        lambda: apply_tiled_layers(model))
    assert "tiles must be a positive int" in value_error_of(
        lambda: apply_tiled_layers(_model("Llama"), tiles=0))


def _rank_sp(extra):
    """SP over 2 ranks (Ulysses 2, head chunks of 1, fused projections), checkpointing with
    offload, through apply_sp_recipe: the SP loss and gradients of every parameter."""
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe

    import torch.distributed as dist

    sp = SequenceParallelConfig(sequence_parallel_size=2, head_chunk_size=1,
                                fuse_projections=True, tiled_mlp=2, loss_tiles=2,
                                activation_checkpointing=True, offload_activations=True, **extra)
    mesh = sp.dims(dist.get_world_size()).build_mesh("cpu")
    model = _model("Qwen2")
    apply_sp_recipe(model, config=sp, mesh=mesh, averaged_over_sp=True)
    model.activation_offload.min_bytes = 0
    batch = prepare_sp_batch({"input_ids": _ids()}, mesh)
    loss = model(**batch)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    inner = [getattr(m.forward, "forward", None) for m in model.model.layers]  # checkpointed
    tiled = all(getattr(f, "__func__", f).__name__ == "_tiled_layer_forward" for f in inner)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, tiled


def test_sp_recipe_with_tiled_layer_matches_without():
    base = dist_pool.run(_rank_sp, {}, world_size=2)
    tiled = dist_pool.run(_rank_sp, {"tiled_layer": True}, world_size=2)
    for (l0, g0, t0), (l1, g1, t1) in zip(base, tiled):
        assert not t0 and t1
        assert abs(l1 - l0) <= 1e-6 * abs(l0)
        for n, g in g0.items():
            torch.testing.assert_close(g1[n], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
