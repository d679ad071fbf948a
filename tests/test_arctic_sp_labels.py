"""HF's loss arguments on sequence pieces: ``labels=`` (unshifted), ``ignore_index=`` and
``num_items_in_batch=`` give HF's loss of the whole sequence, through a bare
``apply_sequence_parallel`` model (its ``loss_function``) and through ``apply_sp_loss`` alike,
with a ring's zigzag cut too. The target of each piece's last token lives on the next rank."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 32, 64


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batch():
    """Two rows; labels ignored here and there, and at every piece boundary a valid target."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, S), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100
    labels[1, 20:23] = -100
    return ids, labels


CASES = {  # the keyword arguments of model(...) besides input_ids
    "labels": lambda labels: {"labels": labels},
    "ignore_index": lambda labels: {"labels": labels.masked_fill(labels == -100, 5),
                                    "ignore_index": 5},
    "num_items_in_batch": lambda labels: {"labels": labels, "num_items_in_batch": 100},
}


def _reference(case):
    model = _model()
    ids, labels = _batch()
    loss = model(input_ids=ids, **CASES[case](labels)).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rank(case, ulysses, ring, recipe):
    from arctic import apply_sequence_parallel, apply_sp_loss
    from ulysses import flat_mesh, shard_sequence

    mesh = get_mesh(2, ulysses, ring)
    model = apply_sequence_parallel(_model(), mesh=mesh)
    if recipe:
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    ids, labels = _batch()
    kwargs = {k: shard_sequence(v, mesh) if torch.is_tensor(v) else v
              for k, v in CASES[case](labels).items()}
    out = model(input_ids=shard_sequence(ids, mesh),
                position_ids=shard_sequence(torch.arange(S).expand(2, S), mesh),
                return_dict=True, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", [False, True], ids=["bare", "apply_sp_loss"])
@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)], ids=["ulysses2", "ring2-zigzag"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_loss_arguments_give_the_whole_sequence_loss(case, ulysses, ring, recipe):
    loss, grads = _reference(case)
    results = dist_pool.run(_rank, case, ulysses, ring, recipe, world_size=2)
    for rank_loss, _ in results:
        torch.testing.assert_close(rank_loss, loss, rtol=1e-5, atol=0)
    # DDP-style averaging over the SP ranks gives the single-process gradients.
    for name, ref in grads.items():
        mean = sum(g[name] for _, g in results) / len(results)
        torch.testing.assert_close(mean, ref, rtol=1e-4, atol=1e-6, msg=name)


def _rank_refusals():
    from arctic import apply_sequence_parallel
    from ulysses import shard_sequence

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model(), mesh=mesh)
    ids, labels = _batch()
    piece = dict(input_ids=shard_sequence(ids, mesh),
                 position_ids=shard_sequence(torch.arange(S).expand(2, S), mesh))
    errors = []
    try:  # -100 in the labels while another value is the ignored one: HF rejects it too
        model(**piece, labels=shard_sequence(labels, mesh), ignore_index=5)
    except ValueError as e:
        errors.append(str(e))
    # shift_labels whose only -100 (the last target) lives on the last rank: every rank refuses
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    try:
        model(**piece, labels=shard_sequence(ids, mesh),
              shift_labels=shard_sequence(shifted, mesh), ignore_index=5)
    except ValueError as e:
        errors.append(str(e))
    # a loss argument of a (future) transformers that the SP loss does not compute
    from arctic.loss.token import SPCausalLMLoss

    newer = SPCausalLMLoss(mesh, loss_arguments=frozenset({"labels", "label_smoothing"}))
    try:
        newer(torch.zeros(2, 16, VOCAB), shard_sequence(ids, mesh), VOCAB, label_smoothing=0.1)
    except ValueError as e:
        errors.append(str(e))
    model.loss_function = lambda *a, **k: None  # a loss of the user's: SP does not replace it
    apply_sequence_parallel(model, mesh=mesh)
    try:
        model(**piece, labels=shard_sequence(ids, mesh))
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_what_the_pieces_cannot_compute_is_refused():
    for errors in dist_pool.run(_rank_refusals, world_size=2):
        assert len(errors) == 4, errors
        assert "ignore_index=5" in errors[0] and "ignore_index=5" in errors[1]
        assert "['label_smoothing']" in errors[2]
        assert "not the causal-LM loss" in errors[3]
