"""HF model families under sequence parallelism: every attention and loss feature the model
asks for is honoured (the SP step equals the unmodified model's step on one process) or
refused (``ValueError`` on every rank, before any collective).

Each family is built from a tiny config with the feature switched on where it changes the
result (a window of 16 at S = 128, sinks, logit transforms, packed documents). The reference
is the unmodified model with its own loss (``labels=``) on one process, or, for packed
documents, each document run on its own. Every case also checks that the reference with the
feature switched off differs, so a path that dropped the feature would fail here.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, causal_lm_loss, count_collectives, get_mesh

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB, WINDOW = 128, 96, 16
DOCS = (50, 30, S - 80)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, attention_dropout=0.0, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(family: str, feature_on: bool = True):
    """The family's tiny config with its features on (or, ``feature_on=False``, off)."""
    import transformers as tf

    w = WINDOW if feature_on else None
    alternate = ["sliding_attention", "full_attention"]
    build = {
        "mistral": lambda: tf.MistralConfig(**SMALL, sliding_window=w),
        "qwen2": lambda: tf.Qwen2Config(**SMALL, use_sliding_window=feature_on,
                                        sliding_window=WINDOW, max_window_layers=1),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, use_sliding_window=feature_on,
                                        sliding_window=WINDOW, max_window_layers=1),
        # Gemma2 at its default attention softcap (50); gemma2_softcap caps at 1 the scores
        # that _model makes large, so that the cap changes the result.
        "gemma2": lambda: tf.Gemma2Config(**SMALL, sliding_window=WINDOW if feature_on else S,
                                          attn_logit_softcapping=50.0 if feature_on else None,
                                          final_logit_softcapping=2.0 if feature_on else None,
                                          query_pre_attn_scalar=24, layer_types=alternate),
        "gemma2_softcap": lambda: tf.Gemma2Config(
            **SMALL, sliding_window=WINDOW, attn_logit_softcapping=1.0 if feature_on else None,
            final_logit_softcapping=None, query_pre_attn_scalar=24, layer_types=alternate),
        "gemma3": lambda: tf.Gemma3TextConfig(**SMALL, sliding_window=WINDOW if feature_on else S,
                                              final_logit_softcapping=None,
                                              query_pre_attn_scalar=24, layer_types=alternate),
        # no causal mask: full layers see every key (of their document), sliding layers
        # |q - k| < 17 (the config halves the window it is given: 32 // 2 + 1); off: causal
        "gemma3_bidirectional": lambda: tf.Gemma3TextConfig(
            **SMALL, sliding_window=2 * WINDOW, use_bidirectional_attention=feature_on,
            final_logit_softcapping=None, query_pre_attn_scalar=24, layer_types=alternate),
        "cohere2": lambda: tf.Cohere2Config(**SMALL, sliding_window=WINDOW if feature_on else S,
                                            layer_types=alternate,
                                            logit_scale=0.5 if feature_on else 1.0),
        "gpt_oss": lambda: tf.GptOssConfig(**{**SMALL, "intermediate_size": 32},
                                           sliding_window=WINDOW if feature_on else S,
                                           layer_types=alternate, num_local_experts=4,
                                           num_experts_per_tok=2),
        "granite": lambda: tf.GraniteConfig(**SMALL, logits_scaling=4.0 if feature_on else 1.0,
                                            attention_multiplier=0.2 if feature_on else 0.25,
                                            embedding_multiplier=2.0, residual_multiplier=0.5),
        "cohere": lambda: tf.CohereConfig(**SMALL, logit_scale=0.25 if feature_on else 1.0),
        "stablelm": lambda: tf.StableLmConfig(**SMALL, partial_rotary_factor=0.5),
        "nemotron": lambda: tf.NemotronConfig(**SMALL, partial_rotary_factor=0.5),
        "llama": lambda: tf.LlamaConfig(**SMALL),
        # chunks of 32 positions on layer 0 (4 per sequence, cutting the 2-rank pieces),
        # global attention on layer 1; MoE on both layers
        # NoPE on layer 0 with attention temperature tuning at a floor of 4 positions (the
        # default 8192 would leave every factor at 1 here); off: no tuning
        "llama4_temperature": lambda: tf.Llama4TextConfig(
            **SMALL, intermediate_size_mlp=96, num_local_experts=4, attention_chunk_size=32,
            layer_types=["full_attention", "full_attention"], no_rope_layers=[0, 1],
            attn_temperature_tuning=feature_on, floor_scale=4, attn_scale=2.0),
        "llama4": lambda: tf.Llama4TextConfig(
            **SMALL, intermediate_size_mlp=96, num_local_experts=4, attention_chunk_size=32,
            layer_types=["chunked_attention" if feature_on else "full_attention",
                         "full_attention"]),
    }[family]
    return build()


def _model(family: str, feature_on: bool = True, attn: str = "eager"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, feature_on), attn_implementation=attn)
    if family == "gemma2_softcap":  # scores of a few units, against a cap of 1
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8)
    sinks = [m for n, m in model.named_parameters() if n.endswith("sinks")]
    with torch.no_grad():  # sinks large enough to matter (GPT-OSS)
        for i, s in enumerate(sinks):
            s.copy_(torch.randn(s.shape, generator=torch.Generator().manual_seed(i)) * 2
                    if feature_on else torch.full(s.shape, -1e4))
    return model


def _tokens():
    return torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))


def _doc_positions():
    return torch.cat([torch.arange(n) for n in DOCS])[None]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(family: str, feature_on: bool = True, documents: bool = False):
    """``(loss, grads)`` of the unmodified model on one process."""
    model = _model(family, feature_on)
    loss = causal_lm_loss(model, _tokens(), DOCS if documents else None)
    loss.backward()
    return loss.item(), _grads(model)


_REFS: dict = {}


def _cached_reference(*key):
    if key not in _REFS:
        _REFS[key] = _reference(*key)
    return _REFS[key]


def _rank_step(family, ulysses, ring=1, chunk=None, fuse=False, documents=False,
               tiled_layer=False, seq_chunk=None, dp=1, layout=True, varlen=None,
               checkpoint=False):
    """One SP training step of ``family``: loss and DDP-averaged gradients (``dp`` data-
    parallel groups, each running the same batch). ``layout``: the ring's (True zigzag,
    False contiguous, ``"per_document"``). ``varlen``: the documents also (``"given"``) or
    only (``"only"``: positions that do not restart) as flash-attn's varlen arguments, or
    the batch's varlen arguments left out (``"dropped"``). ``checkpoint``: tiled norms and
    activation checkpointing with the layer inputs offloaded."""
    import torch.distributed as dist

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    world = dp * ulysses * ring
    mesh = get_mesh(world, ulysses, ring, layout)
    model = apply_sequence_parallel(_model(family), mesh=mesh, head_chunk_size=chunk,
                                    fuse_projections=fuse, seq_chunk=seq_chunk)
    if tiled_layer:
        from arctic import apply_tiled_layers

        apply_tiled_layers(model, tiles=3)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    if checkpoint:
        from arctic import apply_activation_checkpointing
        from arctic.tiling.norms import apply_tiled_norms

        apply_tiled_norms(model, tiles=2)
        apply_activation_checkpointing(model, offload_to_cpu=True)
    raw = {"input_ids": _tokens(), "labels": _tokens()}
    if documents:
        raw["position_ids"] = _doc_positions()
    if varlen in ("given", "only"):  # as DataCollatorWithFlattening gives them
        bounds = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
        raw.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(DOCS),
                   max_length_k=max(DOCS))
    batch = prepare_sp_batch(raw, mesh)
    if varlen == "dropped":
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            batch.pop(name)
    loss = model(**batch)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    return loss.item(), _grads(model)


def _differs(a, b) -> float:
    """How far two ``(loss, grads)`` are apart: the largest gradient difference."""
    return max((a[1][n] - b[1][n]).abs().max().item() for n in a[1] if n in b[1])


def _check(results, ref, off):
    loss, grads = ref
    for got_loss, got in results:
        assert abs(got_loss - loss) <= 1e-5 * abs(loss), (got_loss, loss)
        assert set(got) == set(grads)
        for n, g in got.items():
            torch.testing.assert_close(g, grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")
    if off is None:  # no feature of the model's own under test
        return
    # The feature changes the result: a run without it would fail the checks above.
    assert _differs(ref, off) > 100 * TOL[torch.float32]["atol"], "the feature has no effect"


# family -> (what it exercises, extra step arguments)
HONOURED = {
    "mistral": "sliding window on every layer",
    "qwen2": "sliding window on layer 1 only (max_window_layers=1), bias",
    "qwen3": "sliding window on layer 1 only, per-head q/k norms",
    "gemma2": "sliding window on alternate layers, query_pre_attn_scalar, final softcapping, "
              "attention softcapping at its default (50)",
    "gemma2_softcap": "attention logit softcapping (1.0, on large scores) with the window on "
                      "alternate layers",
    "gemma3": "sliding window on alternate layers, query_pre_attn_scalar",
    "gemma3_bidirectional": "use_bidirectional_attention: no causal mask, symmetric window",
    "cohere2": "sliding window on alternate layers (RoPE only there), logit_scale",
    "gpt_oss": "attention sinks (s_aux) and sliding window on alternate layers",
    "granite": "logits_scaling and attention_multiplier (scaling)",
    "cohere": "logit_scale",
    "llama4": "chunked attention on layer 0 (chunks of 32), MoE (apply_sp_loss finds its "
              "decoder at .model)",
    "llama4_temperature": "attention temperature tuning on a NoPE layer (row positions)",
}


@pytest.mark.parametrize("sp", [pytest.param(2, marks=pytest.mark.hf_facing), 4])
@pytest.mark.parametrize("family", list(HONOURED))
def test_family_matches_single_device(family, sp):
    results = dist_pool.run(_rank_step, family, sp, world_size=sp)
    _check(results, _cached_reference(family), _cached_reference(family, False))


@pytest.mark.parametrize("sp", [pytest.param(2, marks=pytest.mark.hf_facing), 4])
@pytest.mark.parametrize("family", ["stablelm", "nemotron", "mistral", "llama4",
                                    "gemma3_bidirectional"])
def test_packed_documents_reach_the_attention(family, sp):
    """StableLM and Nemotron decoder layers pass no keyword arguments on to their attention:
    the documents must reach it anyway. Mistral: documents inside a sliding window. Llama4:
    chunks restart at each document's start, as transformers' chunked mask counts positions
    within a packed document."""
    results = dist_pool.run(_rank_step, family, sp, documents=True, world_size=sp)
    _check(results, _cached_reference(family, True, True), _cached_reference(family))


@pytest.mark.parametrize("family,sp,ring", [
    ("llama", 1, 2), ("qwen3", 1, 2), ("gpt_oss", 1, 2), ("llama4", 1, 2),
    ("llama", 2, 2), ("qwen3", 2, 2), ("gpt_oss", 2, 2), ("llama4", 2, 2),
    ("gemma3_bidirectional", 1, 2), ("gemma3_bidirectional", 2, 2),
])
def test_packed_documents_on_a_ring(family, sp, ring):
    """Documents crossing ring blocks and zigzag halves (50, 30 and 48 tokens; ring blocks
    of 64, zigzag chunks of 32): plain (Llama), with a window on layer 1 (Qwen3), with sinks
    and windows (GPT-OSS), and Llama4's chunks of 32 restarting at each document."""
    results = dist_pool.run(_rank_step, family, sp, ring, documents=True, world_size=sp * ring)
    _check(results, _cached_reference(family, True, True), _cached_reference(family))


def test_chunked_attention_with_data_parallel_groups():
    """Llama4's chunks count the sequence over the ulysses and ring axes only: on a mesh with
    two data-parallel groups the full length is not the mesh's size times the piece."""
    results = dist_pool.run(_rank_step, "llama4", 2, documents=True, dp=2, world_size=4)
    _check(results, _cached_reference("llama4", True, True), _cached_reference("llama4"))


@pytest.mark.parametrize("family,sp,ring,chunk,fuse", [
    ("mistral", 2, 1, 1, True),     # window, head chunks, fused projections
    ("qwen2", 4, 1, 1, True),       # per-layer window, replicated kv, fused
    ("gemma2", 4, 1, 1, False),     # window with head chunks
    ("mistral", 2, 2, None, False),  # window across a zigzag ring (U=2 x R=2)
    ("gpt_oss", 2, 2, 1, False),    # sinks and window: ring and head chunks
    ("gemma3_bidirectional", 2, 2, 1, False),  # symmetric window: ring and head chunks
    ("gemma3_bidirectional", 1, 2, None, False),  # the same on a pure ring
    ("llama4_temperature", 1, 2, None, False),  # row positions in zigzag order
    # softcap with the window: ring and head chunks (slow: the kernel-level ring case of
    # tests/test_ulysses_softcap.py is in the default run)
    pytest.param("gemma2_softcap", 2, 2, 1, False, marks=pytest.mark.slow),
])
def test_chunked_fused_and_ring_paths(family, sp, ring, chunk, fuse):
    results = dist_pool.run(_rank_step, family, sp, ring, chunk, fuse, world_size=sp * ring)
    _check(results, _cached_reference(family), _cached_reference(family, False))


@pytest.mark.parametrize("family,sp,ring", [
    ("gpt_oss", 2, 1),          # sinks and window, 2 sequence blocks per piece
    # the same across a zigzag ring (U=2 x R=2); softcap and window (the kernel-level
    # tests/test_ulysses_softcap.py runs seq_chunk with a window in the default run)
    pytest.param("gpt_oss", 2, 2, marks=pytest.mark.slow),
    pytest.param("gemma2_softcap", 2, 1, marks=pytest.mark.slow),
])
def test_sequence_chunks_with_sinks_and_softcap(family, sp, ring):
    """The sequence-chunked loop (seq_chunk=2, one head per chunk) applies the sinks to each
    query block's merged result and takes their gradient block by block."""
    results = dist_pool.run(_rank_step, family, sp, ring, 1, seq_chunk=2, world_size=sp * ring)
    _check(results, _cached_reference(family), _cached_reference(family, False))


@pytest.mark.parametrize("family,sp,ring", [
    ("gpt_oss", 2, 1),  # sinks and windows
    ("llama4", 2, 1),   # chunks of 32 restarting at each document
    pytest.param("gpt_oss", 2, 2, marks=pytest.mark.slow),  # across a zigzag ring
])
def test_sequence_chunks_with_packed_documents(family, sp, ring):
    """seq_chunk=2 (one head per chunk) with packed documents that cross the blocks."""
    results = dist_pool.run(_rank_step, family, sp, ring, 1, documents=True, seq_chunk=2,
                            world_size=sp * ring)
    _check(results, _cached_reference(family, True, True), _cached_reference(family))


@pytest.mark.parametrize("sp", [pytest.param(2, marks=pytest.mark.hf_facing), 4])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_projections_and_tiled_layer(family, sp):
    """The families whose attention and decoder layer the fused forward and the tiled layer
    reproduce (``arctic.hf.fused.FUSABLE``, ``arctic.tiling.layer.TILABLE``), both on, with
    the installed transformers' own call conventions (5.24 passes ``cache=``)."""
    from arctic.hf.fused import FUSABLE
    from arctic.tiling.layer import TILABLE

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    assert f"{prefix[family]}Attention" in FUSABLE and f"{prefix[family]}DecoderLayer" in TILABLE
    results = dist_pool.run(_rank_step, family, sp, 1, 1, True, False, True, world_size=sp)
    off = None if family == "llama" else _cached_reference(family, False)
    _check(results, _cached_reference(family), off)


def test_llama4_layers_checkpointed():
    """Llama4's decoder layers hold ``feed_forward`` (an MoE block on MoE layers): the
    anatomy finds them, so activation checkpointing (layer inputs offloaded) and the tiled
    norms wrap every layer, with packed documents and its chunks; the tiled MLP is refused
    (its MoE block returns the router logits beside its output)."""
    from arctic.hf.anatomy import decoder_layers

    assert len(decoder_layers(_model("llama4"))) == _config("llama4").num_hidden_layers
    results = dist_pool.run(_rank_step, "llama4", 2, documents=True, checkpoint=True,
                            world_size=2)
    _check(results, _cached_reference("llama4", True, True), _cached_reference("llama4"))
    got = dist_pool.run(_rank_llama4_tiled_mlp, world_size=2)[0]
    assert "returns tuple" in got and "Llama4TextMoe" in got, got


def _rank_llama4_tiled_mlp() -> str:
    from arctic import apply_tiled_mlp
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("llama4"), mesh=mesh)
    apply_tiled_mlp(model, tiles=2)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    batch = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens()}, mesh)
    try:
        model(**batch)
    except ValueError as e:
        return str(e)
    return "no error"


# --- refusals -------------------------------------------------------------------------------

REFUSED = {
    "attention_dropout": ["LlamaForCausalLM", "attention_dropout"],
    "gemma2_bidirectional": ["Gemma2ForCausalLM", "use_bidirectional_attention", "Gemma2Model"],
    "config_is_causal_false": ["LlamaForCausalLM", "config.is_causal=False"],
    "output_attentions": ["LlamaAttention", "output_attentions"],
    # honoured when they describe the batch (tests/test_arctic_document_layout.py); here
    # they cover half of it (64 of the 128 tokens of the two ranks' pieces)
    "varlen_kwargs": ["cu_seq_lens_q", "cumulative document lengths", "128 last"],
    "seq_idx": ["LlamaAttention", "seq_idx"],
    "attention_switched_back": ["LlamaAttention", "'sdpa'"],
    # token mixers outside attention that SP does not implement would see only this rank's
    # piece (gated delta nets, Mamba1/2 are honoured: tests/test_arctic_hybrid_models.py;
    # Zamba's mixer, which scans its heads one call each, is not)
    "mamba_layers": ["ZambaForCausalLM", "outside attention"],
    "convolution_in_a_layer": ["LlamaForCausalLM", "layers.0.mixer (Conv1d)", "outside attention"],
}
"""Each refusal -> words its message must hold (the model or module class, the feature)."""


def _refused_calls():
    """name -> a call that must raise, on an SP=2 mesh (rank side)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, ZambaConfig

    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)  # built here: new_group is a collective
    ids, pos = _tokens()[:, :64], torch.arange(64)[None]

    def apply(model, **kw):
        return apply_sequence_parallel(model, mesh=mesh, **kw)

    def build(config):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    def switched_back():
        model = apply(_model("llama"))
        model.set_attn_implementation("sdpa")
        return model(input_ids=ids, position_ids=pos)

    def with_conv(model):
        model.model.layers[0].mixer = torch.nn.Conv1d(8, 8, 4, groups=8)
        return model

    varlen = dict(cu_seq_lens_q=torch.tensor([0, 64]), cu_seq_lens_k=torch.tensor([0, 64]),
                  max_length_q=64, max_length_k=64)
    return {
        "attention_dropout": lambda: apply(build(LlamaConfig(**{**SMALL,
                                                                "attention_dropout": 0.1}))),
        "gemma2_bidirectional": lambda: apply(build(Gemma2Config(
            **SMALL, use_bidirectional_attention=True))),
        "config_is_causal_false": lambda: apply(build(LlamaConfig(**SMALL, is_causal=False))),
        "output_attentions": lambda: apply(_model("llama"))(input_ids=ids, position_ids=pos,
                                                            output_attentions=True),
        "varlen_kwargs": lambda: apply(_model("llama"))(input_ids=ids, position_ids=pos,
                                                        **varlen),
        "seq_idx": lambda: apply(_model("llama"))(input_ids=ids, position_ids=pos,
                                                  seq_idx=torch.zeros_like(ids, dtype=torch.int32)),
        "attention_switched_back": switched_back,
        "mamba_layers": lambda: apply(build(ZambaConfig(
            **{k: v for k, v in SMALL.items() if k not in ("num_hidden_layers", "head_dim")},
            num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "hybrid"],
            attention_head_dim=16, n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=8,
            mamba_expand=2))),
        "convolution_in_a_layer": lambda: apply(with_conv(_model("llama"))),
    }


def _rank_refusals():
    found = {}
    for name, call in _refused_calls().items():
        with count_collectives() as counts:
            try:
                call()
                found[name] = ("no error", dict(counts))
            except ValueError as e:
                found[name] = (str(e), dict(counts))
    return found


@pytest.mark.hf_facing
def test_refusals_raise_on_every_rank_before_any_collective():
    for found in dist_pool.run(_rank_refusals, world_size=2):
        for name, words in REFUSED.items():
            message, counts = found[name]
            assert all(w in message for w in words), (name, message)
            assert not counts, (name, counts)


# --- checkpoint recompute sees its own documents ---------------------------------------------

def _rank_interleaved(hf_checkpointing: bool):
    """Forward a packed batch, then a plain one, then backward the first: the recompute of the
    first forward's layers must use its own documents (ours), or be refused (HF's)."""
    import torch.distributed as dist

    from arctic import apply_activation_checkpointing
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("stablelm"), mesh=mesh)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    model.train()
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        apply_activation_checkpointing(model)
    packed = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens(),
                               "position_ids": _doc_positions()}, mesh)
    plain = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens()}, mesh)
    loss = model(**packed)
    try:
        model(**plain)
    except ValueError as e:
        return str(e)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2
    return loss.item(), _grads(model)


def test_checkpoint_recompute_uses_its_own_documents():
    results = dist_pool.run(_rank_interleaved, False, world_size=2)
    _check(results, _cached_reference("stablelm", True, True), _cached_reference("stablelm"))


def test_hf_checkpointing_refuses_a_forward_with_other_documents_before_backward():
    for message in dist_pool.run(_rank_interleaved, True, world_size=2):
        assert "before the previous forward's backward" in message, message


def test_a_per_call_is_causal_must_agree_with_the_module():
    """``is_causal`` passed to one attention call is honoured only where it says what the
    module is: a causal module given False, or a bidirectional one given True, would get
    another mask from transformers depending on its attention implementation."""
    from types import SimpleNamespace

    from arctic.hf.features import read_attention_kwargs

    causal, bidirectional = SimpleNamespace(is_causal=True), SimpleNamespace(is_causal=False)
    read_attention_kwargs(causal, {"is_causal": True})
    read_attention_kwargs(bidirectional, {"is_causal": False})
    for module, flag in ((causal, False), (bidirectional, True)):
        with pytest.raises(ValueError, match=f"is_causal={flag}"):
            read_attention_kwargs(module, {"is_causal": flag})
