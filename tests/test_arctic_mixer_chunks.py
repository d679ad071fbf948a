"""``mixer_chunk`` (:mod:`arctic.hf.mixer_chunks`): a hybrid's mixer layers run in sequence
chunks of each rank's piece, checkpointed, the convolution's window and the scan's state
carried from chunk to chunk and between ranks. The SP step's loss and every gradient equal
the unmodified model's on one process (fp32), with packed documents starting inside chunks
and on a chunk's first position, at SP=2 and 4 and on a ring; the state or the window
dropped between chunks fails the check.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, assert_step_matches, get_mesh, value_error_of
from test_arctic_hybrid_models import DOCS, S, _NoDocuments, _skip_unless_supported, _tokens, \
    _worst, step_on_pieces
from test_arctic_state_passing import _cached_reference, _model, family_cases

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

CHUNK = 25
"""At SP=2 (pieces of 64): rank 0's chunks start at 0, 25 and 50 (the second document's
start: on a chunk's first position), rank 1's at 64, 89 and 114 (the third document starts
at 80, inside one)."""


def _rank_chunked(family: str, ulysses: int, documents, chunk: int = CHUNK, ring: int = 1,
                  zigzag: bool = True, broken: str | None = None):
    import arctic.hf.mixers as mixers
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.hf.mixers import token_mixers
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(ulysses * ring, ulysses, ring, zigzag)
    piece = S // (ulysses * ring)
    scan, conv = mixers.chunk_scan, mixers.chunk_conv

    def dropped_state(chunk, *args):
        if chunk.mode == "output" and chunk.lo % piece and chunk.state is not None:
            chunk.state = torch.zeros_like(chunk.state)
        return scan(chunk, *args)

    def dropped_window(chunk, *args):
        if chunk.mode != "tail" and chunk.lo % piece and chunk.history is not None:
            chunk.history = torch.zeros_like(chunk.history)
        return conv(chunk, *args)

    try:
        if broken == "state":
            mixers.chunk_scan = dropped_state
        if broken == "window":
            mixers.chunk_conv = dropped_window
        model = apply_sequence_parallel(_model(family), mesh=mesh, mixer_chunk=chunk)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
        for m in token_mixers(model):
            assert m.sp_mixer.chunk == chunk
            if broken == "crossing":
                m.sp_mixer.batch = _NoDocuments()
        return step_on_pieces(model, mesh, documents)
    finally:
        mixers.chunk_scan, mixers.chunk_conv = scan, conv


CASES = [("qwen3_5", 2, True), ("nemotron_h", 2, True), ("qwen3_5", 4, False),
         ("nemotron_h", 4, True), ("qwen3_5", 2, False), ("kimi_linear", 2, True),
         ("jamba", 2, True), ("falcon_mamba", 4, True), ("lfm2", 2, True),
         ("mamba2", 2, False), ("qwen3_5", 4, True)]
FAST = {("qwen3_5", 2, True), ("nemotron_h", 2, True), ("jamba", 2, True)}


@pytest.mark.parametrize("family,ulysses,documents", family_cases(CASES, FAST))
def test_chunked_mixers_match_unmodified_model(family, ulysses, documents):
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    chunk = CHUNK if ulysses == 2 else 10
    assert_step_matches(dist_pool.run(_rank_chunked, family, ulysses, docs, chunk,
                                      world_size=ulysses), _cached_reference(family, docs))


def _rank_slice_grads(family: str) -> list[tuple[int, ...]]:
    """The shapes that the backwards of a chunked step's slices along the sequence (dim 1) at
    SP=2 make."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        shapes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("slice_backward") and args[2] == 1:
                self.shapes.append(tuple(args[1]))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        _rank_chunked(family, 2, DOCS, CHUNK)
    return record.shapes


def test_the_chunks_gradients_go_to_one_buffer():
    """Each chunk's gradient is added into one buffer of the piece's shape: no slice's
    backward makes a tensor of the whole piece (a zero one per chunk and pass: two at once as
    they are summed, and a fill of the piece per chunk)."""
    _skip_unless_supported("qwen3_5")
    hidden = _model("qwen3_5").config.get_text_config().hidden_size
    for shapes in dist_pool.run(_rank_slice_grads, "qwen3_5", world_size=2):
        assert shapes and (1, S // 2, hidden) not in shapes, shapes  # (others: in a chunk)


@pytest.mark.parametrize("family,ulysses,ring", [
    ("qwen3_5", 1, 2), pytest.param("nemotron_h", 2, 2, marks=pytest.mark.slow)])
def test_chunked_mixers_on_a_zigzag_ring(family, ulysses, ring):
    """A zigzag ring's two runs per rank, each in chunks (of 12: three chunks of a 32-long
    run at ring 2 x Ulysses 1... and of a 16-long one at Ulysses 2 x Ring 2)."""
    _skip_unless_supported(family)
    assert_step_matches(dist_pool.run(_rank_chunked, family, ulysses, DOCS, 12, ring, True,
                                      world_size=ulysses * ring),
                        _cached_reference(family, DOCS))


@pytest.mark.parametrize("family,broken,documents", [
    ("qwen3_5", "state", False), ("qwen3_5", "window", False),
    ("nemotron_h", "state", False), pytest.param("qwen3_5", "crossing", True,
                                                 marks=pytest.mark.slow),
    pytest.param("jamba", "state", False, marks=pytest.mark.slow),
    pytest.param("lfm2", "window", False, marks=pytest.mark.slow)])
def test_each_chunk_check_fails_when_broken(family, broken, documents):
    """The scan's state or the convolution's window dropped between chunks (not between
    ranks), or the state crossing documents, fails the parity check the working path
    passes, far outside its tolerance."""
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    ref = _cached_reference(family, docs)
    results = dist_pool.run(_rank_chunked, family, 2, docs, CHUNK, 1, True, broken,
                            world_size=2)
    with pytest.raises(AssertionError):
        assert_step_matches(results, ref)
    assert _worst(results[0][1], ref[1]) > 50 * TOL[torch.float32]["atol"]


def _refusal(family: str, mode: str, chunk):
    from arctic.hf.attention import apply_sequence_parallel
    from test_arctic_state_passing import _llama

    model = _llama() if family == "llama" else _model(family)
    return value_error_of(lambda: apply_sequence_parallel(
        model, mesh=get_mesh(2, 2), mixer_parallelism=mode, mixer_chunk=chunk))


def test_mixer_chunk_is_refused_where_it_cannot_act():
    _skip_unless_supported("qwen3_5")
    got = [dist_pool.run(_refusal, *case, world_size=2)[0] for case in (
        ("qwen3_5", "all_to_all", 16), ("llama", "auto", 16), ("qwen3_5", "auto", 0))]
    assert "mixer_parallelism='all_to_all' scans each head" in got[0], got[0]
    assert "mixer_chunk=16 would have no effect" in got[1], got[1]
    assert "mixer_chunk must be a positive number" in got[2], got[2]
    from arctic.config import SequenceParallelConfig

    for bad in (0, -4, 2.5, True, "auto"):
        with pytest.raises(ValueError, match="ulysses.mixer_chunk must be a positive int"):
            SequenceParallelConfig.from_ds_config(
                {"sequence_parallel_size": 2, "ulysses": {"mixer_chunk": bad}}, world_size=2)


GATED = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
"""The families whose gated attention fuse_projections runs."""


def _rank_recipe(family: str, documents, world: int = 2):
    """``family`` through apply_sp_recipe from a DeepSpeed config's ``ulysses`` block with
    mixer_chunk and the memory stack around it: checkpointed layers with their inputs on the
    host, head chunks in the attention layers, the tiled MLP and the tiled loss; on Qwen3.5,
    the gated attention's fused projections and the tiled layer tail on every layer."""
    from arctic.config import SequenceParallelConfig
    from arctic.hf.mixers import token_mixers
    from arctic.recipe import apply_sp_recipe

    config = SequenceParallelConfig.from_ds_config(
        {"sequence_parallel_size": world,
         "ulysses": {"mixer_chunk": CHUNK // (world // 2), "activation_checkpointing": True,
                     "offload_activations": True, "head_chunk_size": 1, "tiled_mlp": 2,
                     "fuse_projections": family in GATED,
                     "tiled_layer": family == "qwen3_5",
                     "loss_tiles": 2}}, world_size=world)
    model = _model(family)
    mesh = config.dims(world).build_mesh("cpu")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    assert all(m.sp_mixer.chunk == CHUNK // (world // 2) and
               (m.sp_mixer.passing or not m.sp_mixer.kind.scan)
               for m in token_mixers(model))
    layers = model.model.layers
    if family in GATED:  # the gated attention fused
        assert all(layer.self_attn._sp_fused for layer in layers if hasattr(layer, "self_attn"))
    if family == "qwen3_5":  # every layer's tail tiled
        assert all("forward" in vars(layer) and layer._z3_leaf for layer in layers)
    return step_on_pieces(model, mesh, documents)


@pytest.mark.parametrize("family,documents,world", [
    ("qwen3_5", True, 2), ("nemotron_h", False, 2),
    pytest.param("qwen3_5", False, 2, marks=pytest.mark.slow),
    pytest.param("nemotron_h", True, 2, marks=pytest.mark.slow),
    pytest.param("qwen3_5", True, 4, marks=pytest.mark.slow),
    pytest.param("qwen3_5", False, 4, marks=pytest.mark.slow),
    pytest.param("nemotron_h", True, 4, marks=pytest.mark.slow),
    pytest.param("nemotron_h", False, 4, marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe", True, 2, marks=pytest.mark.slow),
    pytest.param("qwen3_next", True, 2, marks=pytest.mark.slow)])
def test_through_the_recipe_with_the_memory_stack(family, documents, world):
    """The loss and every gradient of the unmodified model, with the memory stack on: on
    Qwen3.5, also the gated attention's fused projections and every layer's tiled tail."""
    _skip_unless_supported(family)
    docs = DOCS if documents else None
    assert_step_matches(dist_pool.run(_rank_recipe, family, docs, world, world_size=world),
                        _cached_reference(family, docs))


def _rank_normed_pieces_held() -> int:
    """Qwen3.5 through the recipe with mixer_chunk and the tiled layer, not checkpointed: how
    many outputs of a linear-attention layer's input norm that span this rank's whole piece
    are alive after the forward (what the backward will hold)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from arctic.config import SequenceParallelConfig
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe

    made, plain = [], qwen.Qwen3_5RMSNorm.forward

    def recording(self, x):
        y = plain(self, x)
        if getattr(self, "_input_of_mixer", False) and x.shape[1] == S // 2:
            made.append(StorageWeakRef(y.untyped_storage()))  # views keep the storage
        return y

    qwen.Qwen3_5RMSNorm.forward = recording
    try:
        config = SequenceParallelConfig.from_ds_config(
            {"sequence_parallel_size": 2,
             "ulysses": {"mixer_chunk": CHUNK, "head_chunk_size": 1, "tiled_mlp": 2,
                         "fuse_projections": True, "tiled_layer": True,
                         "tiled_norms": False}}, world_size=2)  # (the norm called whole)
        model = _model("qwen3_5")
        mesh = config.dims(2).build_mesh("cpu")
        apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
        for layer in model.model.layers:
            layer.input_layernorm._input_of_mixer = hasattr(layer, "linear_attn")
        raw = {"input_ids": _tokens(), "labels": _tokens()}
        loss = model(**prepare_sp_batch(raw, mesh))
        held = sum(not r.expired() for r in made)
        loss.backward()
        return len(made), held
    finally:
        qwen.Qwen3_5RMSNorm.forward = plain


def test_a_chunked_mixer_norms_its_input_a_chunk_at_a_time():
    """Under the tiled layer a chunked mixer takes the layer's input and its norm: each chunk
    is normed inside its checkpoint, so no normed copy of the whole piece waits for the
    backward beside the layer's input (the exactness: the recipe test above)."""
    _skip_unless_supported("qwen3_5")
    for made, held in dist_pool.run(_rank_normed_pieces_held, world_size=2):
        assert made and held == 0, (made, held)  # (the tail pass norms the whole tiny piece)
