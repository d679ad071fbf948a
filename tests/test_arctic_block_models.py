"""Models built from blocks of one sublayer through the recipe (``apply_sp_recipe``):
Nemotron-H (each block's ``mixer`` a Mamba2 mixer, an attention, an MLP or an MoE, by
``config.layers_block_type``) and the state-space models Mamba2 and FalconMamba (a Mamba
mixer in every block, no attention, no MLP).

The blocks are the decoder layers (:func:`arctic.hf.anatomy.decoder_layers`): every one is
checkpointed with its input offloaded, Nemotron-H's MLP and MoE blocks are the MLPs tiled
and every block's norm is tiled. The SP step's loss and every gradient equal the unmodified
model's on one process (fp32). Settings that would have no effect on these models
(``head_chunk_size`` without attention, ``tiled_mlp`` without an MLP) are refused by name
before the model changes.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import assert_step_matches, averaged_grads, grads_of, value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB, SP = 128, 96, 2
LENGTH = S - 3
"""Tokens per row: the cut pads each row to a multiple of SP."""
IDS = dict(vocab_size=VOCAB, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
           eos_token_id=2)
BLOCKS = {"mlp": ["mamba", "attention", "mlp"], "moe": ["mamba", "attention", "moe"]}
"""Nemotron-H's block types: a Mamba2 mixer (4 heads over 2 B/C groups), an attention, then
an MLP, or an MoE (4 experts, 2 per token, and a shared expert)."""
RECIPE = dict(tiled_mlp=2, loss_tiles=2, activation_checkpointing=True,
              offload_activations=True)


def _config(family: str, blocks: str = "mlp"):
    import transformers as tf

    if family == "nemotron_h":
        return tf.NemotronHConfig(
            **IDS, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layers_block_type=BLOCKS[blocks],
            mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1)
    if family == "mamba2":
        return tf.Mamba2Config(**IDS, hidden_size=64, num_hidden_layers=2, num_heads=4,
                               head_dim=32, n_groups=2, state_size=8, chunk_size=16, expand=2)
    if family == "zamba2":  # Mamba2 layers and hybrid layers (the shared attention block)
        return tf.Zamba2Config(**IDS, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=4, mamba_headdim=16, n_mamba_heads=8,
                               mamba_ngroups=2, mamba_d_state=8, chunk_size=16,
                               layers_block_type=["mamba", "hybrid"] * 2)
    if family == "granitemoehybrid":  # its MLP: an MoE beside a shared MLP
        return tf.GraniteMoeHybridConfig(
            **IDS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
            num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16, mamba_expand=2)
    return tf.FalconMambaConfig(**IDS, hidden_size=64, num_hidden_layers=2, state_size=4,
                                expand=1, time_step_rank=8)


def _model(family: str, blocks: str = "mlp"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, blocks), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # states that last (decays 0.01-0.05)
                p.copy_(torch.linspace(0.01, 0.05, p.shape[-1]).log().expand_as(p))
            if name.endswith("gate.weight"):  # the router zero-initialised: ties everywhere
                p.normal_(0, 1)
    return model


def _tokens():
    return torch.randint(3, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))



def _reference(family: str, blocks: str = "mlp"):
    """``(loss, grads)`` of the unmodified model on one process, on the whole row."""
    model = _model(family, blocks)
    ids = _tokens()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), grads_of(model)



def _rank_recipe(family: str, blocks: str, settings: dict):
    """The model through apply_sp_recipe at SP=2 with ``settings``, one step: the loss and the
    gradients averaged over the ranks (as DDP would). Checks, before the step, that every
    block is checkpointed and which modules are tiled."""
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.anatomy import base_model, is_mlp
    from arctic.recipe import apply_sp_recipe
    from arctic.tiling.tiles import TiledForward
    from offload.checkpoint import _CheckpointedForward

    config = SequenceParallelConfig(sequence_parallel_size=SP, **settings)
    mesh = config.dims(SP).build_mesh("cpu")
    model = _model(family, blocks)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 28)
    decoder = base_model(model)
    assert all(isinstance(block.forward, _CheckpointedForward) for block in decoder.layers)
    if config.tiled_mlp is not None and family == "granitemoehybrid":
        # the MoE block and the shared MLP beside it, in every layer
        assert all(isinstance(m.forward, TiledForward) for layer in decoder.layers
                   for m in (layer.block_sparse_moe, layer.shared_mlp))
    elif config.tiled_mlp is not None and family == "zamba2":
        # the MLP of the shared attention block that the hybrid layers run (with the calling
        # layer's index, which picks its adapter, passed to every tile)
        shared = [layer.shared_transformer.feed_forward for layer in decoder.layers
                  if hasattr(layer, "shared_transformer")]
        assert shared and all(isinstance(m.forward, TiledForward) for m in shared)
    elif config.tiled_mlp is not None:
        # the MLP and MoE blocks' sublayer is tiled, a token mixer or attention never is
        assert [isinstance(b.mixer.forward, TiledForward) for b in decoder.layers] == [
            is_mlp(b.mixer) for b in decoder.layers]
        assert any(is_mlp(b.mixer) for b in decoder.layers)
        norms = [b.norm for b in decoder.layers] + [decoder.norm_f]
        assert all(isinstance(n.forward, TiledForward) for n in norms)
    ids = _tokens()
    loss = model(**prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh))
    loss.backward()
    return loss.item(), averaged_grads(model, SP)


@pytest.mark.parametrize("blocks", ["mlp", "moe"])
def test_nemotron_h_through_the_recipe_matches_unmodified_model(blocks):
    """Head chunks of 1 in the attention block, the MLP (or MoE) block tiled in 2, the norms
    tiled, the loss in 2 tiles, every block checkpointed with its input offloaded."""
    settings = dict(head_chunk_size=1, **RECIPE)
    assert_step_matches(dist_pool.run(_rank_recipe, "nemotron_h", blocks, settings, world_size=SP),
           _reference("nemotron_h", blocks))


@pytest.mark.parametrize("family", ["zamba2", "granitemoehybrid"])
def test_layers_of_the_decoder_list_through_the_recipe(family):
    """Zamba2 (a hybrid layer runs the shared attention block, then a Mamba2 layer) and
    GraniteMoeHybrid (an MoE beside a shared MLP): the decoder's layer list is what the
    recipe checkpoints (every element, its input offloaded); head chunks of 1, the loss in 2
    tiles. GraniteMoeHybrid's MoE block and shared MLP are both tiled; so is the MLP of
    Zamba2's shared attention block, called with each hybrid layer's index."""
    settings = dict(head_chunk_size=1, **RECIPE)
    assert_step_matches(dist_pool.run(_rank_recipe, family, "mlp", settings, world_size=SP),
           _reference(family))


@pytest.mark.parametrize("family", ["mamba2", "falcon_mamba"])
def test_state_space_model_through_the_recipe_matches_unmodified_model(family):
    """No attention and no MLP: every block checkpointed with its input offloaded, the loss
    in 2 tiles (head_chunk_size and tiled_mlp would have no effect and are refused, below)."""
    settings = {k: v for k, v in RECIPE.items() if k != "tiled_mlp"}
    assert_step_matches(dist_pool.run(_rank_recipe, family, "mlp", settings, world_size=SP),
           _reference(family))


def test_blocks_are_the_decoder_layers():
    """The anatomy: each block of the decoder's layer list is a decoder layer, its sublayer
    is its MLP only where that is an MLP or MoE, and its norm and the final ``norm_f`` are
    per-token norms."""
    from arctic.hf.anatomy import decoder_layers, layer_mlp, token_norms

    for family, blocks in (("nemotron_h", "mlp"), ("nemotron_h", "moe"), ("mamba2", "mlp")):
        model = _model(family, blocks)
        decoder = model.backbone if family == "mamba2" else model.model
        layers = list(decoder.layers)
        assert decoder_layers(model) == layers
        mlps = [type(layer_mlp(b)).__name__ for b in layers]
        expected = {"mamba2": ["NoneType"] * 2,
                    "nemotron_h": ["NoneType", "NoneType",
                                   "NemotronHMLP" if blocks == "mlp" else "NemotronHMoE"]}
        assert mlps == expected[family], mlps
        assert token_norms(model) == [b.norm for b in layers] + [decoder.norm_f]


def _recipe_refusal(family: str, settings: dict):
    """The recipe's ValueError on this rank, and whether it left every forward as it was."""
    from arctic.config import SequenceParallelConfig
    from arctic.recipe import apply_sp_recipe
    from ulysses.patching import instance_method

    config = SequenceParallelConfig(sequence_parallel_size=SP, **settings)
    mesh = config.dims(SP).build_mesh("cpu")
    model = _model(family)
    message = value_error_of(lambda: apply_sp_recipe(model, config=config, mesh=mesh))
    return message, all(instance_method(m) is None for m in model.modules())


@pytest.mark.parametrize("family,settings,expected", [
    ("mamba2", dict(head_chunk_size=1), "head_chunk_size=1 would have no effect"),
    ("mamba2", dict(head_chunk_size=1, fuse_projections=True, seq_chunk=2),
     "head_chunk_size=1 would have no effect"),
    ("mamba2", dict(attention_backend="math"), "attention_backend='math'"),
    ("falcon_mamba", dict(activation_checkpointing=True, recompute_attention=False),
     "recompute_attention=False would have no effect"),
    ("mamba2", dict(tiled_mlp=2), "tiled_mlp would have no effect"),
    ("falcon_mamba", dict(tiled_mlp="auto"), "tiled_mlp would have no effect"),
])
def test_settings_without_effect_are_refused(family, settings, expected):
    """On every rank, by name, before the model changes: head chunks, the attention kernel
    and keeping attention results on a model without attention; the tiled MLP on one
    without an MLP."""
    for message, unchanged in dist_pool.run(_recipe_refusal, family, settings, world_size=SP):
        assert expected in message, message
        assert unchanged


def test_tiled_layer_is_refused_for_blocks():
    """``tiled_layer`` reproduces the Llama layer's forward, not a block's: refused by name."""
    from arctic.tiling.layer import check_tilable

    block = _model("nemotron_h").model.layers[2]
    assert "set tiled_layer to false" in value_error_of(lambda: check_tilable(block))
