"""Multi-head latent attention under sequence parallelism: DeepSeek-V2 and V3, MiniCPM3,
GLM-4.7-Flash (``glm4_moe_lite``) and Youtu. Their keys and values come from one compressed
latent, with a q/k head dim (here 16 + 8) other than v's (12). The SP step's loss and every
gradient equal the unmodified model's on one process (fp32), with and without packed
documents whose boundaries fall inside the pieces (reference: each document run alone);
with head chunks; through the recipe's memory stack.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import (assert_step_matches, averaged_grads, causal_lm_loss, get_mesh,
                     grads_of, value_error_of)

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 128, 96
DOCS = (50, 30, S - 80)
MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12, tie_word_embeddings=False, pad_token_id=0,
           bos_token_id=1, eos_token_id=2)
"""4 heads with q/k head dim 24 and v head dim 12, a latent of 32."""
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)


def _config(family: str):
    import transformers as tf

    return {
        # q from its own projection; layer 0 dense, layer 1 MoE
        "deepseek_v2": lambda: tf.DeepseekV2Config(**MLA, q_lora_rank=None,
                                                   first_k_dense_replace=1, **MOE),
        # q through its low-rank path (q_a_proj, norm, q_b_proj)
        "deepseek_v3": lambda: tf.DeepseekV3Config(**MLA, q_lora_rank=24,
                                                   first_k_dense_replace=1, n_group=1,
                                                   topk_group=1, **MOE),
        "minicpm3": lambda: tf.MiniCPM3Config(**MLA, q_lora_rank=24),
        "glm4_moe_lite": lambda: tf.Glm4MoeLiteConfig(**MLA, q_lora_rank=24,
                                                      first_k_dense_replace=1, n_group=1,
                                                      topk_group=1, **MOE),
        "youtu": lambda: tf.YoutuConfig(**MLA, q_lora_rank=24),
    }[family]()


def _skip_unless_available(family: str) -> None:
    import importlib

    try:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"this transformers has no {family}")


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")


def _tokens():
    return torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))



_REFS: dict = {}


def _reference(family: str, documents: bool):
    """``(loss, grads)`` of the unmodified model on one process; with ``documents``, each
    document run on its own."""
    key = (family, documents)
    if key not in _REFS:
        model = _model(family)
        loss = causal_lm_loss(model, _tokens(), DOCS if documents else None)
        loss.backward()
        _REFS[key] = loss.item(), grads_of(model)
    return _REFS[key]


def _rank_step(family: str, ulysses: int, documents: bool, chunk=None, hide_documents=False,
               ring=1, seq_chunk=None):
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(ulysses * ring, ulysses, ring)
    model = apply_sequence_parallel(_model(family), mesh=mesh, head_chunk_size=chunk,
                                    seq_chunk=seq_chunk)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
    raw = {"input_ids": _tokens(), "labels": _tokens()}
    if documents:
        raw["position_ids"] = torch.cat([torch.arange(n) for n in DOCS])[None]
    batch = prepare_sp_batch(raw, mesh)
    if hide_documents:  # the broken variant: attention across the documents
        model.model.layers[0].self_attn.sp_attention.batch.segments = lambda: None
    loss = model(**batch)
    loss.backward()
    return loss.item(), averaged_grads(model, ulysses * ring)



CASES = [("deepseek_v2", 2, True, None), ("deepseek_v3", 2, True, None),
         ("deepseek_v3", 2, False, None), ("deepseek_v3", 4, True, 1),
         ("minicpm3", 2, True, None), ("glm4_moe_lite", 2, True, None), ("youtu", 2, True, 1)]


@pytest.mark.hf_facing
@pytest.mark.parametrize("family,ulysses,documents,chunk", [
    pytest.param(*c, id=f"{c[0]}-sp{c[1]}-{'documents' if c[2] else 'whole'}"
                 f"{'-chunk' + str(c[3]) if c[3] else ''}",
                 marks=[pytest.mark.slow] if c[0] in ("minicpm3", "youtu") else [])
    for c in CASES])
def test_latent_attention_matches_unmodified_model(family, ulysses, documents, chunk):
    _skip_unless_available(family)
    assert_step_matches(dist_pool.run(_rank_step, family, ulysses, documents, chunk, world_size=ulysses),
           _reference(family, documents))


@pytest.mark.parametrize("ring,chunk,seq_chunk", [(2, 1, None), (1, 1, 2)],
                         ids=["ulysses2_x_ring2-chunk1", "chunk1-seq_chunk2"])
def test_latent_attention_on_a_ring_and_in_sequence_blocks(ring, chunk, seq_chunk):
    """Ulysses x Ring (zigzag) with packed documents, and sequence blocks inside head chunks:
    the padded v through the ring's hops and the blocks' host buffers."""
    _skip_unless_available("deepseek_v3")
    documents = ring > 1
    results = dist_pool.run(_rank_step, "deepseek_v3", 2, documents, chunk, False, ring,
                            seq_chunk, world_size=2 * ring)
    assert_step_matches(results, _reference("deepseek_v3", documents))


def test_attention_across_documents_fails_theassert_step_matches():
    """The same check fails when the attention does not see the documents."""
    _skip_unless_available("deepseek_v3")
    results = dist_pool.run(_rank_step, "deepseek_v3", 2, True, None, True, world_size=2)
    with pytest.raises(AssertionError):
        assert_step_matches(results, _reference("deepseek_v3", True))


def _rank_recipe():
    """DeepSeek-V3 through apply_sp_recipe at SP=2: head chunks of 1, tiled MLP and norms, the
    tiled loss, checkpointing with the layer inputs offloaded, the cut's padding."""
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from offload.checkpoint import _CheckpointedForward

    config = SequenceParallelConfig(sequence_parallel_size=2, head_chunk_size=1, tiled_mlp=2,
                                    loss_tiles=2, activation_checkpointing=True,
                                    offload_activations=True)
    mesh = config.dims(2).build_mesh("cpu")
    model = _model("deepseek_v3")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 28)
    assert all(isinstance(layer.forward, _CheckpointedForward) for layer in model.model.layers)
    ids = _tokens()[:, :S - 3]
    loss = model(**prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh))
    loss.backward()
    return loss.item(), averaged_grads(model, 2)


def test_deepseek_v3_through_the_recipe_matches_unmodified_model():
    _skip_unless_available("deepseek_v3")
    model = _model("deepseek_v3")
    ids = _tokens()[:, :S - 3]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert_step_matches(dist_pool.run(_rank_recipe, world_size=2), (loss.item(), grads_of(model)))


def test_fused_projections_refused_by_name():
    """fuse_projections computes q/k/v from q/k/v projections; latent attention has none."""
    _skip_unless_available("deepseek_v3")
    from arctic.hf.fused import check_fusable

    attention = _model("deepseek_v3").model.layers[0].self_attn
    message = value_error_of(lambda: check_fusable(attention, num_heads=4, num_kv_heads=4,
                                                   hidden_size=64))
    assert "DeepseekV3Attention" in message, message


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_refused_by_name(family):
    """DeepSeek Sparse Attention (an indexer that keeps each query's top-k keys) is refused
    before any collective."""
    _skip_unless_available(family)
    import transformers as tf
    from transformers import AutoModelForCausalLM

    from arctic.hf.anatomy import attention_modules
    from arctic.hf.features import check_model_features

    config = {"deepseek_v32": tf.DeepseekV32Config,
              "glm_moe_dsa": tf.GlmMoeDsaConfig}[family](**MLA, q_lora_rank=24, **MOE)
    model = AutoModelForCausalLM.from_config(config)
    message = value_error_of(lambda: check_model_features(model, attention_modules(model)))
    assert "DeepSeek Sparse Attention" in message, message
