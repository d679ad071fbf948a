"""Hybrid models under sequence parallelism: gated delta nets (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next, OLMo-hybrid), Kimi Linear's KDA (beside latent attention), Mamba2 layers
(Nemotron-H, Bamba, GraniteMoeHybrid, Falcon-H1, Zamba2), Mamba1 layers (Jamba, and
FalconMamba alone) and gated short convolutions (LFM2) beside attention. The SP step's loss and every gradient equal the
unmodified model's on one process (fp32), with and without packed documents whose boundaries
fall inside the pieces (reference: each document run on its own).

Each check is seen to fail: with the mixers left on their local piece (the stock forward),
and with their state crossing the documents (the mixers' documents hidden from them), the
gradients are far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import (TOL, assert_step_matches, averaged_grads, causal_lm_loss,
                     get_mesh, grads_of, value_error_of)

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 128, 96
DOCS = (50, 30, S - 80)
"""Three documents; at SP=2 (pieces of 64) and SP=4 (32) their starts fall inside pieces."""
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"])
"""4 value heads sharing 2 key heads: split at SP=2, the key heads replicated at SP=4."""
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8,
             mamba_chunk_size=16, mamba_expand=2)
"""Mamba2 layers of 4 heads over 2 B/C groups, chunks of 16 (several per document)."""


def _config(family: str):
    import transformers as tf

    return {
        "qwen3_5": lambda: tf.Qwen3_5TextConfig(**SMALL, **LINEAR),
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeTextConfig(**SMALL, **LINEAR, **MOE),
        "qwen3_next": lambda: tf.Qwen3NextConfig(**SMALL, **LINEAR, **MOE),
        "olmo_hybrid": lambda: tf.OlmoHybridConfig(**SMALL, **LINEAR),
        # a Mamba2 layer (4 heads over 2 B/C groups), an attention layer, an MLP layer
        "nemotron_h": lambda: tf.NemotronHConfig(
            **{k: v for k, v in SMALL.items() if k != "num_hidden_layers"},
            layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4,
            mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=16),
        "bamba": lambda: tf.BambaConfig(
            **{k: v for k, v in SMALL.items() if k != "head_dim"}, attn_layer_indices=[1],
            **MAMBA),
        "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
            **{k: v for k, v in SMALL.items() if k != "head_dim"},
            layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            **MAMBA),
        # a gated short convolution (width 3), then an attention layer
        # KDA (4 heads of 8) then multi-head latent attention (q/k head dim 24, v 12)
        "kimi_linear": lambda: tf.KimiLinearConfig(
            **{k: v for k, v in SMALL.items() if k not in ("head_dim", "num_key_value_heads")},
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, q_lora_rank=None, linear_head_dim=8, linear_num_heads=4,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        # attention and a Mamba2 mixer side by side in every layer
        "falcon_h1": lambda: tf.FalconH1Config(
            **{k: v for k, v in SMALL.items()}, mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16, mamba_expand=2,
            mamba_d_ssm=128),
        # Mamba2 layers and hybrid layers (a Mamba2 layer after the shared attention block)
        "zamba2": lambda: tf.Zamba2Config(
            **{k: v for k, v in SMALL.items() if k not in ("head_dim", "num_hidden_layers",
                                                           "intermediate_size")},
            num_hidden_layers=4, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=2,
            mamba_d_state=8, chunk_size=16, layers_block_type=["mamba", "hybrid"] * 2),
        # Mamba1: every channel its own recurrence, one B/C shared by all
        "jamba": lambda: tf.JambaConfig(
            **{k: v for k, v in SMALL.items() if k != "head_dim"}, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, num_experts=2, mamba_d_state=4,
            mamba_dt_rank=8, mamba_expand=1),
        "mamba": lambda: tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=4, expand=1,
            time_step_rank=8, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2),
        "falcon_mamba": lambda: tf.FalconMambaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=4, expand=1,
            time_step_rank=8, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2),
        "mamba2": lambda: tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
            n_groups=2, state_size=8, chunk_size=16, expand=2, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "lfm2_moe": lambda: tf.Lfm2MoeConfig(
            **{k: v for k, v in SMALL.items() if k != "head_dim"}, moe_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
            layer_types=["conv", "full_attention"]),
        "lfm2": lambda: tf.Lfm2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"},
                                      layer_types=["conv", "full_attention"]),
    }[family]()


CLASSES = {"qwen3_5": ("qwen3_5", "Qwen3_5GatedDeltaNet"),
           "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
           "qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet"),
           "olmo_hybrid": ("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
           "kimi_linear": ("kimi_linear", "KimiLinearDeltaAttention"),
           "falcon_h1": ("falcon_h1", "FalconH1Mixer"),
           "zamba2": ("zamba2", "Zamba2MambaMixer"),
           "jamba": ("jamba", "JambaMambaMixer"),
           "falcon_mamba": ("falcon_mamba", "FalconMambaMixer"),
           "mamba": ("mamba", "MambaMixer"),
           "lfm2": ("lfm2", "Lfm2ShortConv"),
           "lfm2_moe": ("lfm2_moe", "Lfm2MoeShortConv"),
           "mamba2": ("mamba2", "Mamba2Mixer"),
           "nemotron_h": ("nemotron_h", "NemotronHMamba2Mixer"),
           "bamba": ("bamba", "BambaMixer"),
           "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridMambaLayer")}


def _skip_unless_supported(family: str) -> None:
    """Skip where the installed transformers lacks the family, or its mixer's forward is not
    the one sequence parallelism reaches in a release before 5.24 (refused, see
    test_an_older_forward_is_refused). From 5.24 on, such a forward fails the test: a newer
    release that moved the mixing calls (5.25 moved them into helpers of the model's file)
    is caught by the HF-facing job, not skipped there."""
    import importlib

    import transformers
    from packaging.version import Version

    from arctic.hf.mixers import unreached_calls

    folder, name = CLASSES[family]
    try:
        module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    except ImportError:
        pytest.skip(f"this transformers has no {family}")
    missing = unreached_calls(getattr(module, name))
    if missing and Version(transformers.__version__) >= Version("5.24"):
        pytest.fail(f"{name}'s forward in transformers {transformers.__version__} does not "
                    f"call {missing} from its file, as 5.24 and 5.25 do: sequence "
                    f"parallelism refuses it (arctic.hf.mixers.unreached_calls)")
    if missing:
        pytest.skip(f"{name}'s forward in this transformers does not call {missing}")


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    if family in ("lfm2", "lfm2_moe"):  # taps large enough that a crossing window shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("conv.conv.weight"):
                    p.mul_(100)
    if family == "falcon_h1":  # B, C and x large enough that the state matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mamba.in_proj.weight"):
                    p.mul_(10)
    if family in ("jamba", "mamba", "falcon_mamba", "falcon_h1"):  # states that last (decays 0.01-0.05)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.linspace(0.01, 0.05, p.shape[-1]).log().expand_as(p))
    return model


def _tokens():
    return torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))



def _reference(family: str, documents: bool):
    """``(loss, grads)`` of the unmodified model on one process; with ``documents``, each
    document run on its own and the loss the mean over all their tokens."""
    model = _model(family)
    loss = causal_lm_loss(model, _tokens(), DOCS if documents else None)
    loss.backward()
    return loss.item(), grads_of(model)


_REFS: dict = {}


def _cached_reference(*key):
    if key not in _REFS:
        _REFS[key] = _reference(*key)
    return _REFS[key]


class _NoDocuments:
    """A batch state that hides the documents (the broken variant: state crosses them)."""

    def segments(self):
        return None


def _rank_step(family: str, ulysses: int, documents: bool, broken: str | None = None,
               chunk=None, seq_chunk=None):
    """One SP step: the loss and the gradients averaged over the ranks (as DDP would).
    ``broken``: ``"local"`` (the mixers' stock forward, on this rank's piece) or
    ``"crossing"`` (the mixers do not see the documents)."""
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.hf.mixers import token_mixers
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh
    from ulysses.patching import restore_method

    mesh = get_mesh(ulysses, ulysses)
    model = apply_sequence_parallel(_model(family), mesh=mesh, head_chunk_size=chunk,
                                    seq_chunk=seq_chunk)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
    for m in token_mixers(model):
        if broken == "local":
            restore_method(m)
        elif broken == "crossing":
            m.sp_mixer.batch = _NoDocuments()
    return step_on_pieces(model, mesh, DOCS if documents else None)


def step_on_pieces(model, mesh, documents):
    """One step of ``model`` (made sequence-parallel over ``mesh``) on this rank's pieces of
    the test sequence, ``documents`` packed (their lengths; None: one): the loss and the
    gradients averaged over the SP ranks (as DDP would)."""
    from arctic.data.batch import prepare_sp_batch

    raw = {"input_ids": _tokens(), "labels": _tokens()}
    if documents:
        raw["position_ids"] = torch.cat([torch.arange(n) for n in documents])[None]
    loss = model(**prepare_sp_batch(raw, mesh))
    loss.backward()
    return loss.item(), averaged_grads(model, mesh.size())


def _worst(got, ref) -> float:
    return max((got[n] - ref[n]).abs().max().item() for n in ref)



CASES = [("qwen3_5", 2, True), ("qwen3_5", 4, True), ("qwen3_5", 2, False),
         ("qwen3_5_moe", 2, True), ("qwen3_next", 2, True), ("olmo_hybrid", 2, True),
         ("qwen3_next", 4, True), ("olmo_hybrid", 4, False), ("lfm2", 2, True),
         ("lfm2", 4, True), ("nemotron_h", 2, True), ("nemotron_h", 4, True),
         ("bamba", 2, True), ("granitemoehybrid", 2, True), ("kimi_linear", 2, True),
         ("kimi_linear", 4, True), ("kimi_linear", 2, False), ("falcon_h1", 2, True),
         ("falcon_h1", 4, True), ("zamba2", 2, True), ("zamba2", 4, False),
         ("jamba", 2, True), ("jamba", 4, True), ("falcon_mamba", 2, True),
         ("falcon_mamba", 2, False), ("mamba2", 2, True), ("lfm2_moe", 2, True),
         ("qwen3_5_moe", 4, True), ("bamba", 4, True), ("granitemoehybrid", 4, True),
         ("falcon_mamba", 4, True), ("mamba2", 4, True), ("lfm2_moe", 4, True)]


@pytest.mark.parametrize("family,ulysses,documents", [
    pytest.param(*c, id=f"{c[0]}-sp{c[1]}-{'documents' if c[2] else 'whole'}",
                 marks=[pytest.mark.slow] if c[1] == 4 and c[0] != "qwen3_5" else
                 [pytest.mark.hf_facing] if c[1] == 2 else [])
    for c in CASES])
def test_hybrid_matches_unmodified_model(family, ulysses, documents):
    _skip_unless_supported(family)
    ref = _cached_reference(family, documents)
    assert_step_matches(dist_pool.run(_rank_step, family, ulysses, documents, world_size=ulysses), ref)


def test_attention_chunks_beside_the_mixers():
    """Head chunks of 1 and two sequence blocks per piece on the attention layers; the
    mixers beside them unchanged."""
    _skip_unless_supported("qwen3_5")
    assert_step_matches(dist_pool.run(_rank_step, "qwen3_5", 2, False, None, 1, 2, world_size=2),
           _cached_reference("qwen3_5", False))


@pytest.mark.hf_facing
@pytest.mark.parametrize("family,broken,documents", [
    ("qwen3_5", "local", False), ("qwen3_5", "crossing", True),
    ("lfm2", "local", False), ("lfm2", "crossing", True),
    ("nemotron_h", "local", False), ("nemotron_h", "crossing", True),
    ("kimi_linear", "local", False), ("kimi_linear", "crossing", True),
    ("jamba", "local", False), ("jamba", "crossing", True),
    ("zamba2", "crossing", True), ("falcon_h1", "local", False)])
def test_each_check_fails_when_broken(family, broken, documents):
    """The mixers on their local piece, or their state (the convolution's window) crossing
    the documents, fail the parity check the working path passes, with gradients over 50
    times its tolerance away."""
    _skip_unless_supported(family)
    ref = _cached_reference(family, documents)
    results = dist_pool.run(_rank_step, family, 2, documents, broken, world_size=2)
    with pytest.raises(AssertionError):
        assert_step_matches(results, ref)
    assert _worst(results[0][1], ref[1]) > 50 * TOL[torch.float32]["atol"]


def _refusal(ulysses: int, ring: int, what: str):
    from transformers import AutoModelForCausalLM

    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(ulysses * ring, ulysses, ring, False)
    config = _config("qwen3_5")
    if what == "heads":  # 2 value heads: the attention's 4 split over 4 ranks, these do not
        config.linear_num_value_heads = 2
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if what == "cache":
        model = apply_sequence_parallel(model, mesh=mesh)
        ids = torch.zeros(1, S // (ulysses * ring), dtype=torch.long)
        pos = torch.arange(ids.shape[1])[None]
        return value_error_of(lambda: model(input_ids=ids, position_ids=pos, use_cache=True))
    mode = "all_to_all" if what in ("heads", "apply") else "auto"  # auto passes the state
    return value_error_of(lambda: apply_sequence_parallel(model, mesh=mesh,
                                                          mixer_parallelism=mode))


@pytest.mark.hf_facing
@pytest.mark.parametrize("ulysses,ring,what,expected", [
    (1, 2, "apply", "mixer_parallelism='all_to_all' runs under Ulysses only"),
    (4, 1, "heads", "valid degrees: [1, 2]"),
    (2, 1, "cache", "use_cache=False"),
])
def test_refused_before_any_collective(ulysses, ring, what, expected):
    """A ring and head counts the degree does not split (by the all-to-all; "auto" passes
    the state instead: test_arctic_state_passing.py), and a cache are refused with a
    ValueError on every rank, before any collective (a collective would hang here)."""
    _skip_unless_supported("qwen3_5")
    results = dist_pool.run(_refusal, ulysses, ring, what, world_size=ulysses * ring)
    for message in results:
        assert expected in message, message


def _zamba():
    """A tiny Zamba v1: its Mamba mixer scans its heads one call each (not one of FAMILIES)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tf.ZambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "hybrid", "hybrid"], attention_head_dim=16,
        n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=8, mamba_expand=2))


def test_other_token_mixers_are_still_refused():
    """A state-space hybrid whose mixer is not one of FAMILIES (Zamba's, which scans its
    heads one call each) is refused by name."""

    from arctic.hf.mixers import check_token_mixers

    model = _zamba()
    message = value_error_of(lambda: check_token_mixers(model))
    assert message.startswith("ZambaForCausalLM: ") and "supported:" in message, message


def _rank_zamba_with_the_trainer_config():

    from arctic.config import SequenceParallelConfig
    from arctic.recipe import apply_sp_recipe
    from helpers import get_mesh

    model = _zamba()
    sp = SequenceParallelConfig.from_ds_config("configs/cpu_trainer.json", world_size=2)
    return value_error_of(lambda: apply_sp_recipe(model, config=sp, mesh=get_mesh(2, 2)))


def test_a_family_sp_cannot_run_is_refused_before_any_setting():
    """Zamba v1 with the shipped Trainer config (tiled_mlp "auto"): the first refusal names
    its token mixer, which SP does not implement, not a setting (its MLP is not found)."""
    for message in dist_pool.run(_rank_zamba_with_the_trainer_config, world_size=2):
        assert message.startswith("ZambaForCausalLM: ") and "supported:" in message, message


def _rank_recipe(length: int):
    """Qwen3.5 through apply_sp_recipe at SP=4: head chunks of 1, tiled MLP and norms, the
    tiled loss, checkpointing with the layer inputs offloaded, the cut's padding."""
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from offload.checkpoint import _CheckpointedForward

    config = SequenceParallelConfig(sequence_parallel_size=4, head_chunk_size=1, tiled_mlp=2,
                                    loss_tiles=2, activation_checkpointing=True,
                                    offload_activations=True)
    mesh = config.dims(4).build_mesh("cpu")
    model = _model("qwen3_5")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 28)
    layers = model.model.layers
    assert all(isinstance(layer.forward, _CheckpointedForward) for layer in layers)
    ids = _tokens()[:, :length]
    loss = model(**prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh))
    loss.backward()
    return loss.item(), averaged_grads(model, 4)


def test_qwen3_5_through_the_recipe_matches_unmodified_model():
    """S - 3 tokens: the cut pads each row to a multiple of 4."""
    _skip_unless_supported("qwen3_5")
    model = _model("qwen3_5")
    ids = _tokens()[:, :S - 3]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert_step_matches(dist_pool.run(_rank_recipe, S - 3, world_size=4), (loss.item(), grads_of(model)))


def _rank_recipe_tiles(family: str):
    """``family`` through apply_sp_recipe at SP=2 with the tiled MLP, norms and loss and
    checkpointing: the step, and which of the model's norms ran tiled."""
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.anatomy import language_model
    from arctic.recipe import apply_sp_recipe
    from arctic.tiling.tiles import TiledForward

    config = SequenceParallelConfig(sequence_parallel_size=2, tiled_mlp=2, tiled_norms=True,
                                    loss_tiles=2, activation_checkpointing=True)
    mesh = config.dims(2).build_mesh("cpu")
    model = _model(family)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    tiled = sorted({name.split(".")[-1] for name, m in language_model(model).named_modules()
                    if "Norm" in type(m).__name__ and isinstance(m.forward, TiledForward)})
    ids = _tokens()
    loss = model(**prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh))
    loss.backward()
    return (loss.item(), averaged_grads(model, 2)), tiled


def test_lfm2s_norms_are_tiled_and_the_step_matches_the_unmodified_model():
    """LFM2 calls its layer norms operator_norm and ffn_norm and its final norm
    embedding_norm: tiled_norms tiles all three, and the step still matches."""
    _skip_unless_supported("lfm2")
    ref = _cached_reference("lfm2", False)
    results = dist_pool.run(_rank_recipe_tiles, "lfm2", world_size=2)
    assert_step_matches([step for step, _ in results], ref)
    for _, tiled in results:
        assert tiled == ["embedding_norm", "ffn_norm", "operator_norm"], tiled


def _rank_removed():
    """SP applied, a step, SP removed: the model runs its own forward on the whole sequence
    (its mixers' stock forward); SP restored: the SP step again."""
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.hf.mixers import token_mixers
    from arctic.loss.head import apply_sp_loss
    from arctic.removal import remove_sequence_parallel, restore_sequence_parallel
    from ulysses import flat_mesh
    from ulysses.patching import instance_method

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("qwen3_5"), mesh=mesh)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
    ids = _tokens()
    batch = prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh)
    sp_loss = model(**batch).item()
    remove_sequence_parallel(model)
    assert all(instance_method(m) is None for m in token_mixers(model))
    whole = model(input_ids=ids, labels=ids).loss.item()  # a cache is fine without SP
    restore_sequence_parallel(model)
    return sp_loss, whole, model(**batch).item()


def test_removal_gives_back_the_stock_mixers():
    _skip_unless_supported("qwen3_5")
    ref, _ = _cached_reference("qwen3_5", False)
    for sp_loss, whole, again in dist_pool.run(_rank_removed, world_size=2):
        for got in (sp_loss, whole, again):
            assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


def test_an_older_forward_is_refused():
    """A mixer whose forward calls its convolution and scan through the instance (as
    transformers 5.13's did), not as functions of its module, is refused when SP is applied:
    the calls would not reach sequence parallelism."""
    from arctic.hf.mixers import unreached_calls

    class Qwen3_5GatedDeltaNet(torch.nn.Module):  # the name of a supported family
        def forward(self, x):
            return self.chunk_gated_delta_rule(self.causal_conv1d_fn(x))

    assert unreached_calls(Qwen3_5GatedDeltaNet) == ["causal_conv1d_fn",
                                                     "torch_chunk_gated_delta_rule"]


_HELPERS_FILE = '''
import torch


def causal_conv1d_fn(x, weight, bias=None, activation=None):
    return x


def torch_chunk_gated_delta_rule(query, key, value, g, beta):
    return value, None


def _module_of(func):  # the kernels package's module of a function, as it makes one
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def _conv_forward(conv, x, cache, layer_idx):  # transformers 5.25's causal_conv1d_forward
    return causal_conv1d_fn(x, conv.weight)


causal_conv1d_forward = _module_of(_conv_forward)


def scan_forward(module, q, k, v, g, beta):
    return torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]


class Qwen3_5GatedDeltaNet(torch.nn.Module):  # the name of a supported family
    def forward(self, x):
        x = causal_conv1d_forward(self.conv1d, x, None, 0)
        return scan_forward(self, x, x, x, x, x)


class Qwen3NextGatedDeltaNet(torch.nn.Module):  # calls the helpers' siblings, not them
    def forward(self, x):
        return _module_of(x)
'''


def test_a_forward_that_mixes_through_its_files_helpers_is_reached():
    """transformers 5.25 calls the convolution and the scan from helper functions of the
    model's file (``causal_conv1d_forward``, which the ``kernels`` package makes a module of,
    and ``mamba2_scan_forward``); those helpers look them up in the file when called, where
    sequence parallelism replaces them: such a forward is reached. A forward that calls
    neither helper is not."""
    import sys
    import types

    from arctic.hf.mixers import unreached_calls

    file = types.ModuleType("arctic_test_helpers_file")
    sys.modules[file.__name__] = file
    try:
        exec(compile(_HELPERS_FILE, file.__name__, "exec"), file.__dict__)
        assert isinstance(file.causal_conv1d_forward, torch.nn.Module)
        assert unreached_calls(file.Qwen3_5GatedDeltaNet) == []
        assert unreached_calls(file.Qwen3NextGatedDeltaNet) == [
            "causal_conv1d_fn", "torch_chunk_gated_delta_rule"]
    finally:
        del sys.modules[file.__name__]
