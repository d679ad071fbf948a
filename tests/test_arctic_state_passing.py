"""Hybrid models' linear mixers by state passing (``mixer_parallelism="state_passing"``,
:mod:`ulysses.state_passing`): each rank scans its own piece with every head, from the state
the earlier pieces leave. The SP step's loss and every gradient equal the unmodified model's
on one process (fp32), with packed documents whose starts fall inside pieces and on a piece's
first position, and at a degree above the mixer's head count (which the all-to-all cannot
split).

Each check is seen to fail: with the incoming state dropped, and with the state crossing the
documents (the mixers' documents hidden from them).
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, assert_step_matches, get_mesh, value_error_of
from test_arctic_hybrid_models import (DOCS, S, _config, _NoDocuments, _skip_unless_supported,
                                       _tokens, _worst, step_on_pieces)
from test_arctic_hybrid_models import _model as _stock_model

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

def _lasting(model):
    """Slow decays (0.01 to 0.05 per unit step) in every mixer, Mamba2's steps near 1 (not
    0.001 to 0.1) and its inputs 10 times larger: the state a piece leaves still matters a
    piece later, so that a dropped one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(0.01, 0.05, p.numel()).log().reshape(p.shape))
            if name.endswith("mixer.dt_bias"):
                p.fill_(0.5)
            if name.endswith("mixer.in_proj.weight"):  # B, C and x large enough to matter
                p.mul_(10)
    return model


def _model(family: str):
    return _lasting(_stock_model(family))


def _reference(family: str, documents):
    from helpers import causal_lm_loss, grads_of

    model = _model(family)
    loss = causal_lm_loss(model, _tokens(), documents)
    loss.backward()
    return loss.item(), grads_of(model)


_REFS: dict = {}


def _cached_reference(family: str, documents):
    if (family, documents) not in _REFS:
        _REFS[family, documents] = _reference(family, documents)
    return _REFS[family, documents]


def _rank_step(family: str, ulysses: int, documents, broken: str | None = None,
               heads: int | None = None, mode: str = "state_passing", ring: int = 1,
               zigzag: bool = True):
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.hf.mixers import token_mixers
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh
    import ulysses.state_passing as sp

    original = sp.Shared.apply
    try:
        if broken == "dropped":
            sp.Shared.apply = lambda x, *a: torch.zeros_like(original(x, *a))
        mesh = get_mesh(ulysses * ring, ulysses, ring, zigzag)
        model = _model(family) if heads is None else _fewer_heads(family, heads)
        model = apply_sequence_parallel(model, mesh=mesh, mixer_parallelism=mode)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
        for m in token_mixers(model):
            assert m.sp_mixer.passing or m.sp_mixer.kind.scan is None
            if broken == "crossing":
                m.sp_mixer.batch = _NoDocuments()
        return step_on_pieces(model, mesh, documents)
    finally:
        sp.Shared.apply = original


def _fewer_heads(family: str, heads: int):
    from transformers import AutoModelForCausalLM

    config = _config(family)
    config.linear_num_value_heads = config.linear_num_key_heads = heads
    torch.manual_seed(0)
    return _lasting(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def _reference_fewer_heads(family: str, heads: int):
    from helpers import causal_lm_loss, grads_of

    model = _fewer_heads(family, heads)
    loss = causal_lm_loss(model, _tokens(), None)
    loss.backward()
    return loss.item(), grads_of(model)


ON_BOUNDARY = (32, 32, S - 64)
"""At SP=4 (pieces of 32) the second and third documents start on a piece's first
position: the state entering pieces 1 and 2 must be dropped, not continued."""

CASES = [("qwen3_5", 2, True), ("qwen3_5", 4, True), ("qwen3_5", 2, False),
         ("kimi_linear", 2, True), ("nemotron_h", 4, True), ("mamba2", 2, False),
         ("qwen3_5_moe", 4, True), ("qwen3_next", 4, True), ("olmo_hybrid", 2, True),
         ("kimi_linear", 4, True), ("nemotron_h", 2, True), ("bamba", 2, True),
         ("bamba", 4, True), ("granitemoehybrid", 4, True), ("falcon_h1", 4, True),
         ("zamba2", 2, True), ("zamba2", 4, True), ("mamba2", 4, True), ("jamba", 2, True),
         ("jamba", 4, True), ("mamba", 2, False), ("mamba", 4, True), ("falcon_mamba", 2, True),
         ("falcon_mamba", 4, True)]
FAST = {("qwen3_5", 4, True), ("kimi_linear", 2, True), ("nemotron_h", 4, True),
        ("jamba", 4, True)}


def family_cases(cases, fast) -> list:
    """``(family, ulysses degree, documents)`` cases as pytest params, those not in ``fast``
    marked slow."""
    return [pytest.param(*c, id=f"{c[0]}-sp{c[1]}-{'documents' if c[2] else 'whole'}",
                         marks=[] if c in fast else [pytest.mark.slow]) for c in cases]


@pytest.mark.parametrize("family,ulysses,documents", family_cases(CASES, FAST))
def test_state_passing_matches_unmodified_model(family, ulysses, documents):
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    assert_step_matches(dist_pool.run(_rank_step, family, ulysses, docs, world_size=ulysses),
                        _cached_reference(family, docs))


def _rank_step_in_chunks(family: str, ulysses: int, documents, elements: int):
    """:func:`_rank_step` with Mamba1's incoming-state term computed in position chunks of
    ``elements`` (a few positions each), recomputed in the backward."""
    import arctic.hf.mixer_state as ms

    original = ms.FIX_ELEMENTS
    ms.FIX_ELEMENTS = elements
    try:
        return _rank_step(family, ulysses, documents)
    finally:
        ms.FIX_ELEMENTS = original


def test_mamba1_incoming_state_term_in_chunks():
    """Jamba (Mamba1) with the incoming state's term cut into chunks of 3 positions (the
    bound that keeps ``[b, C, t, N]`` small at long lengths): still the unmodified model."""
    _skip_unless_supported("jamba")
    elements = 3 * 64 * 4  # b * C * N = 1 * 64 * 4: three positions per chunk
    assert_step_matches(dist_pool.run(_rank_step_in_chunks, "jamba", 2, DOCS, elements,
                                      world_size=2), _cached_reference("jamba", DOCS))


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("nemotron_h", marks=pytest.mark.slow)])
def test_documents_starting_on_a_piece_boundary(family):
    """Starts exactly on pieces' first positions (SP=4): equal to each document run alone."""
    _skip_unless_supported(family)
    assert_step_matches(dist_pool.run(_rank_step, family, 4, ON_BOUNDARY, world_size=4),
                        _cached_reference(family, ON_BOUNDARY))


def test_a_degree_above_the_mixer_heads():
    """Qwen3.5 with 2 value heads at SP=4: the all-to-all is refused (naming the valid
    degrees); "auto" passes the state, and matches the model on one process."""
    _skip_unless_supported("qwen3_5")
    ref = _reference_fewer_heads("qwen3_5", 2)
    assert_step_matches(dist_pool.run(_rank_step, "qwen3_5", 4, None, None, 2, "auto",
                                      world_size=4), ref)
    refused = dist_pool.run(_refusal, "all_to_all", world_size=4)
    assert all("valid degrees: [1, 2]" in r for r in refused), refused


def _refusal(mode: str, family: str = "qwen3_5", heads: int | None = 2):
    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(4, 4) if heads else get_mesh(2, 2)
    model = _fewer_heads(family, heads) if heads else _model(family)
    return value_error_of(lambda: apply_sequence_parallel(model, mesh=mesh,
                                                          mixer_parallelism=mode))


def test_an_unknown_mode_is_refused_by_name():
    unknown = dist_pool.run(_refusal, "ring", "qwen3_5", None, world_size=2)[0]
    assert "mixer_parallelism must be one of" in unknown, unknown


@pytest.mark.parametrize("family,broken,documents", [
    ("qwen3_5", "dropped", False), ("qwen3_5", "crossing", True),
    ("nemotron_h", "dropped", False), ("kimi_linear", "crossing", True),
    ("jamba", "dropped", False), ("falcon_mamba", "crossing", True),
    pytest.param("mamba2", "dropped", False, marks=pytest.mark.slow),
    pytest.param("kimi_linear", "dropped", False, marks=pytest.mark.slow),
    pytest.param("nemotron_h", "crossing", True, marks=pytest.mark.slow)])
def test_each_check_fails_when_broken(family, broken, documents):
    """The incoming state dropped, or the state crossing the documents, fails the parity
    check the working path passes, with gradients over 50 times its tolerance away."""
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    ref = _cached_reference(family, docs)
    results = dist_pool.run(_rank_step, family, 2, docs, broken, world_size=2)
    with pytest.raises(AssertionError):
        assert_step_matches(results, ref)
    assert _worst(results[0][1], ref[1]) > 50 * TOL[torch.float32]["atol"]


RINGS = [("qwen3_5", 1, 2, True, True), ("qwen3_5", 2, 2, True, True),
         ("qwen3_5", 1, 2, False, True), ("nemotron_h", 1, 2, True, True),
         ("kimi_linear", 2, 2, True, False), ("lfm2", 1, 2, True, True),
         ("mamba2", 1, 4, True, False), ("bamba", 2, 2, True, True),
         ("olmo_hybrid", 1, 2, True, True), ("falcon_h1", 2, 2, True, True),
         ("jamba", 1, 2, True, True), ("falcon_mamba", 2, 2, True, True),
         ("mamba", 1, 2, False, False), ("qwen3_5", 1, 2, "per_document", True),
         ("nemotron_h", 2, 2, "per_document", True), ("jamba", 1, 2, "per_document", True),
         ("lfm2", 1, 4, "per_document", True), ("kimi_linear", 1, 4, "per_document", True)]
FAST_RINGS = {("qwen3_5", 2, 2, True, True), ("nemotron_h", 1, 2, True, True),
              ("qwen3_5", 1, 2, "per_document", True)}
LAYOUTS = {True: "zigzag", False: "contiguous", "per_document": "per_document"}


@pytest.mark.parametrize("family,ulysses,ring,zigzag,documents", [
    pytest.param(*c, id=f"{c[0]}-u{c[1]}r{c[2]}-{LAYOUTS[c[3]]}-"
                 f"{'documents' if c[4] else 'whole'}",
                 marks=[] if c in FAST_RINGS else [pytest.mark.slow]) for c in RINGS])
def test_rings_match_unmodified_model(family, ulysses, ring, zigzag, documents):
    """A ring of 2 (and 4), alone and as Ulysses 2 x Ring 2, zigzag, contiguous and cut
    document by document: each rank's runs (a zigzag rank holds two, a per-document one two
    per document) take their convolution's tail and their scan's state from the runs before
    them in the sequence, whichever ranks hold them."""
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    assert_step_matches(dist_pool.run(_rank_step, family, ulysses, docs, None, None, "auto",
                                      ring, zigzag, world_size=ulysses * ring),
                        _cached_reference(family, docs))


def _rank_chained_in_rank_order(family: str, documents):
    """The broken variant of a zigzag ring: the runs chained in rank order (every rank's
    runs as if contiguous), not in sequence order."""
    import ulysses.mixers as mixers

    import arctic.hf.mixer_state as ms

    original = mixers.sp_runs
    mixers.sp_runs = ms.sp_runs = lambda mesh, piece: _rank_order(original(mesh, piece))
    try:
        return _rank_step(family, 1, documents, None, None, "auto", 2, True)
    finally:
        mixers.sp_runs = ms.sp_runs = original


def _rank_order(runs):
    """The runs renumbered as if the ranks' pieces followed each other in rank order (each
    rank's own runs kept in their order): positions ``[r s, (r + 1) s)`` for rank r."""
    out, start = [], 0
    for own in runs:
        mine = []
        for _, n in own:
            mine.append((start, n))
            start += n
        out.append(mine)
    return out


def test_zigzag_chained_in_rank_order_fails():
    """A zigzag ring whose runs are chained in rank order instead of sequence order fails
    the parity check, far outside its tolerance."""
    _skip_unless_supported("qwen3_5")
    ref = _cached_reference("qwen3_5", None)
    results = dist_pool.run(_rank_chained_in_rank_order, "qwen3_5", None, world_size=2)
    with pytest.raises(AssertionError):
        assert_step_matches(results, ref)
    assert _worst(results[0][1], ref[1]) > 50 * TOL[torch.float32]["atol"]


def _rank_from_config(family: str, mode: str):
    """The mixers' path after apply_sp_recipe with ``ulysses.mixer_parallelism=mode`` (a DS
    config, as DeepSpeed and Trainer users give it): per mixer whether it passes its state,
    or the refusal."""
    from arctic.config import SequenceParallelConfig
    from arctic.hf.mixers import token_mixers
    from arctic.recipe import apply_sp_recipe

    config = SequenceParallelConfig.from_ds_config(
        {"sequence_parallel_size": 2, "ulysses": {"mixer_parallelism": mode}}, world_size=2)
    model = _stock_model(family) if family != "llama" else _llama()
    mesh = config.dims(2).build_mesh("cpu")
    try:
        apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    except ValueError as e:
        return str(e)
    return [m.sp_mixer.passing for m in token_mixers(model)]


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2), attn_implementation="sdpa")


def test_the_config_key_reaches_the_mixers():
    """``ulysses.mixer_parallelism`` in a DeepSpeed config: state_passing and all_to_all as
    named, auto the all-to-all where the heads split (SP=2); a value other than auto on a
    model without a scanning mixer is refused, and an unknown value when the config is read."""
    from arctic.config import SequenceParallelConfig

    _skip_unless_supported("qwen3_5")
    got = {mode: dist_pool.run(_rank_from_config, "qwen3_5", mode, world_size=2)[0]
           for mode in ("state_passing", "all_to_all", "auto")}
    assert got == {"state_passing": [True], "all_to_all": [False], "auto": [False]}, got
    llama = dist_pool.run(_rank_from_config, "llama", "all_to_all", world_size=2)[0]
    assert "mixer_parallelism='all_to_all' would have no effect" in llama, llama
    assert "[]" == str(dist_pool.run(_rank_from_config, "llama", "auto", world_size=2)[0])
    with pytest.raises(ValueError, match="ulysses.mixer_parallelism must be one of"):
        SequenceParallelConfig.from_ds_config(
            {"sequence_parallel_size": 2, "ulysses": {"mixer_parallelism": "ring"}},
            world_size=2)


def _rank_ring_engine(engine: str):
    """Qwen3.5 through apply_sp_recipe on a zigzag ring of 2 (``ulysses.ring_degree``),
    checkpointed, under DeepSpeed ZeRO-3 (arctic.initialize, 2 ranks) or FSDP2 (dp=2 x
    ring 2, 4 ranks, each dp replica its own sequence): the loss and the full gradients."""
    import torch.distributed as dist

    import arctic
    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from helpers import init_deepspeed_comm
    from ulysses.mesh import axis_rank

    ulysses_block = {"ring_degree": 2, "activation_checkpointing": True, "loss_tiles": 2}
    model = _model("qwen3_5")
    if engine == "zero3":
        import arctic.train.deepspeed
        from deepspeed.utils import groups, safe_get_full_grad

        init_deepspeed_comm()
        groups.mpu = None
        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
                  "ulysses": ulysses_block}
        run, _, _, _ = arctic.train.deepspeed.initialize(model=model, config=config)
        ids = _tokens()
        loss = run(**prepare_sp_batch({"input_ids": ids, "labels": ids}, run.sp_mesh))
        run.backward(loss)
        grads = {n: safe_get_full_grad(p) for n, p in run.module.named_parameters()}
    else:
        config = SequenceParallelConfig.from_ds_config(
            {"sequence_parallel_size": 2, "ulysses": ulysses_block}, world_size=4)
        mesh = config.dims(4).build_mesh("cpu")
        apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
        run = arctic.apply_fsdp(model, mesh=mesh)
        ids = _two_sequences()[axis_rank(mesh, "dp")]
        loss = run(**prepare_sp_batch({"input_ids": ids, "labels": ids}, mesh))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
    grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
             for n, g in grads.items()}
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    dist.barrier()
    return loss.item() / dist.get_world_size(), grads


def _two_sequences():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 96, (1, S), generator=g) for _ in range(2)]


def _reference_two_sequences():
    """The unmodified model on one process: the mean of the two sequences' losses and
    gradients (what dp=2 averages)."""
    from helpers import causal_lm_loss, grads_of

    model = _model("qwen3_5")
    loss = sum(causal_lm_loss(model, ids, None) for ids in _two_sequences()) / 2
    loss.backward()
    return loss.item(), grads_of(model)


@pytest.mark.parametrize("engine", ["zero3", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_qwen3_5_on_a_ring_under_zero3_and_fsdp2(engine):
    _skip_unless_supported("qwen3_5")
    ref = _cached_reference("qwen3_5", None) if engine == "zero3" else \
        _reference_two_sequences()
    world = 2 if engine == "zero3" else 4
    results = dist_pool.run(_rank_ring_engine, engine, world_size=world, timeout=240)
    for loss, grads in results:
        assert abs(loss - ref[0]) <= 1e-5 * abs(ref[0]), (loss, ref[0])
        assert set(grads) == set(ref[1])
        for n, g in grads.items():
            torch.testing.assert_close(g, ref[1][n], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{engine} {n}: {m}")
