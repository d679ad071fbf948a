"""HF models on a per-document ring layout, and flash-attn's varlen arguments.

On a mesh built with ``per_document`` (``ulysses.ring_layout: "per_document"``) each packed
document is cut into 2R chunks; ``arctic.data`` cuts the batch so and hands the documents on
as ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``, which the model's sequence-parallel
attention reads. Each case runs one training step against the unmodified model on one
process, the documents run one by one (``test_arctic_hf_families``), and checks that the
model without documents differs. Then the varlen arguments on their own: honoured on any
mesh (documents from them alone, with positions that do not restart), refused when they
disagree with the position ids or with themselves, and required on a per-document mesh.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh
from test_arctic_hf_families import _cached_reference, _check, _model, _rank_step, _tokens

PER_DOCUMENT = "per_document"


@pytest.mark.parametrize("family,sp,ring,chunk,seq_chunk", [
    pytest.param("llama", 1, 2, None, None,  # documents of 50, 30, 48: chunks of 12-13
                 marks=pytest.mark.hf_facing),
    # window on layer 1, hybrid U2 x R2 (slow: the kernel-level hybrid case is fast)
    pytest.param("qwen3", 2, 2, None, None, marks=pytest.mark.slow),
    ("gpt_oss", 1, 2, 1, None),        # sinks and windows, head chunks
    ("llama4", 1, 2, None, None),      # chunks of 32 within documents: layout != documents
    pytest.param("gpt_oss", 2, 2, 1, 2, marks=pytest.mark.slow),  # sequence chunks
    pytest.param("gemma3_bidirectional", 2, 2, None, None, marks=pytest.mark.slow),
])
def test_packed_documents_in_the_per_document_layout(family, sp, ring, chunk, seq_chunk):
    results = dist_pool.run(_rank_step, family, sp, ring, chunk, documents=True,
                            seq_chunk=seq_chunk, layout=PER_DOCUMENT, world_size=sp * ring)
    _check(results, _cached_reference(family, True, True), _cached_reference(family))


def test_temperature_tuning_rows_in_the_per_document_layout():
    """Llama4's NoPE temperature at row positions, a row cut per document (one document:
    the rows' positions come from the layout)."""
    results = dist_pool.run(_rank_step, "llama4_temperature", 1, 2, layout=PER_DOCUMENT,
                            world_size=2)
    _check(results, _cached_reference("llama4_temperature"),
           _cached_reference("llama4_temperature", False))


@pytest.mark.hf_facing
@pytest.mark.parametrize("sp,ring,layout", [(2, 1, True), (1, 2, True), (1, 2, PER_DOCUMENT)],
                         ids=["u2", "r2_zigzag", "r2_per_document"])
def test_varlen_arguments_alone_give_the_documents(sp, ring, layout):
    """Positions that count on across the documents (RoPE is relative, so within a document
    they attend as if restarted) and the documents in cu_seq_lens_q only: the result of
    running the documents one by one, as flash-attn's varlen attention computes it."""
    results = dist_pool.run(_rank_step, "llama", sp, ring, layout=layout, varlen="only",
                            world_size=sp * ring)
    _check(results, _cached_reference("llama", True, True), _cached_reference("llama"))


def test_varlen_arguments_beside_restarting_positions():
    results = dist_pool.run(_rank_step, "mistral", 2, documents=True, varlen="given",
                            world_size=2)
    _check(results, _cached_reference("mistral", True, True), _cached_reference("mistral"))


def _refusals():
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from test_arctic_hf_families import _doc_positions
    from ulysses import flat_mesh

    found = {}
    for name, layout in (("zigzag", True), ("per_document", PER_DOCUMENT)):
        mesh = get_mesh(2, 1, 2, layout)
        model = apply_sequence_parallel(_model("llama"), mesh=mesh)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
        raw = {"input_ids": _tokens(), "labels": _tokens(), "position_ids": _doc_positions()}
        batch = prepare_sp_batch(raw, mesh)
        bounds = torch.tensor([0, 50, 80, 128], dtype=torch.int32)
        cases = {
            "disagree": dict(cu_seq_lens_q=torch.tensor([0, 64, 128]),
                             cu_seq_lens_k=torch.tensor([0, 64, 128])),
            "q_and_k": dict(cu_seq_lens_q=bounds, cu_seq_lens_k=torch.tensor([0, 64, 128])),
            "max_length": dict(cu_seq_lens_q=bounds, max_length_q=40),
            "not_cumulative": dict(cu_seq_lens_q=torch.tensor([0, 80, 50, 128])),
            "without_cu": dict(max_length_q=50),
        }
        if name == "per_document":
            cases["dropped"] = {}
        try:  # the data side: documents of the positions that cu_seq_lens_q does not name
            prepare_sp_batch({**raw, "cu_seq_lens_q": torch.tensor([0, 50, 128])}, mesh)
            found[name, "data"] = None
        except ValueError as e:
            found[name, "data"] = str(e)
        for case, varlen in cases.items():
            given = {k: v for k, v in batch.items() if not k.startswith(("cu_", "max_"))}
            try:
                model(**given, **varlen)
                found[name, case] = None
            except ValueError as e:
                found[name, case] = str(e)
    return found


@pytest.mark.hf_facing
def test_varlen_arguments_that_cannot_be_honoured_are_refused():
    for found in dist_pool.run(_refusals, world_size=2):
        for layout in ("zigzag", "per_document"):
            assert "count up" in found[layout, "disagree"] or \
                "restart at" in found[layout, "disagree"]
            assert "cu_seq_lens_k differs" in found[layout, "q_and_k"]
            assert "max_length_q=40" in found[layout, "max_length"]
            assert "cumulative document lengths" in found[layout, "not_cumulative"]
            assert "without cu_seq_lens_q" in found[layout, "without_cu"]
            assert "position_ids restart at (row, position) [[0, 80]]" in found[layout, "data"]
        assert "give the batch's documents as cu_seq_lens_q" in found["per_document", "dropped"]
