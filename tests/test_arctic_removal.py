"""``arctic.remove_sequence_parallel`` / ``restore_sequence_parallel``: the model SP was applied
to runs its own forward again (logits on the whole sequence, ``generate``), with every instance
entry the recipe set taken off; restored, its SP loss and gradients are those it had before."""

from __future__ import annotations

import pytest
import torch

import dist_pool

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 64, 128
# Every stage of the recipe that changes the model: SP attention with fused projections and
# head chunks, the tiled MLP, norms and layer tail, the tiled loss, checkpointing with offload
# and kept attention.
EVERYTHING = dict(head_chunk_size=1, fuse_projections=True, tiled_mlp=2, tiled_norms=True,
                  tiled_layer=True, loss_tiles=2, activation_checkpointing=True,
                  offload_activations=True, recompute_attention=False)


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _instance_state(model) -> list:
    """Every module's and config's instance entries (but the removal's own record), hook tables entry by entry, by identity."""
    state = []
    for name, m in model.named_modules():
        for owner in (m, getattr(m, "config", None)):
            if owner is None:
                continue
            for k, v in sorted(vars(owner).items()):
                if k in ("_sp_journal", "activation_offload"):  # the undo record; a report
                    continue
                if isinstance(v, dict):
                    state.append((name, k, tuple((i, id(e)) for i, e in v.items())))
                else:
                    state.append((name, k, id(v)))
    return state


def _plain_outputs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hf_loss = model(input_ids=ids, labels=ids).loss
        generated = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    return logits, hf_loss, generated


def _sp_loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _rank_remove_and_restore():
    from arctic import (SequenceParallelConfig, apply_tiled_mlp, remove_sequence_parallel,
                        restore_sequence_parallel)
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from arctic.order import applied_stages

    config = SequenceParallelConfig(sequence_parallel_size=2, **EVERYTHING)
    mesh = config.dims(2).build_mesh("cpu")
    model = _model()
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
    before, plain = _instance_state(model), _plain_outputs(model, ids)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 26)
    applied = _instance_state(model)
    batch = prepare_sp_batch({"input_ids": ids}, mesh)
    sp = _sp_loss_and_grads(model, batch)

    remove_sequence_parallel(model)
    removed_state, removed = _instance_state(model), _plain_outputs(model, ids)
    stages_removed = applied_stages(model)
    remove_sequence_parallel(model)  # twice: a no-op
    try:
        apply_tiled_mlp(model, tiles=2)
        refused = None
    except ValueError as e:
        refused = str(e)

    restore_sequence_parallel(model)
    restored_state, again = _instance_state(model), _sp_loss_and_grads(model, batch)
    return (before == removed_state, applied == restored_state, before != applied,
            plain, removed, sp, again, stages_removed, refused)


def test_removed_runs_the_model_own_forward_and_restored_runs_sp():
    for (same_removed, same_restored, changed, plain, removed, sp, again, stages,
         refused) in dist_pool.run(_rank_remove_and_restore, world_size=2):
        assert changed  # the recipe did change instance entries
        assert same_removed and same_restored
        assert stages == set()
        # The model's own forward, on the whole sequence: the same logits, HF loss, tokens.
        for a, b in zip(plain, removed):
            assert torch.equal(a, b)
        # Put back: the SP loss and its gradients are those of before.
        assert torch.equal(sp[0], again[0])
        assert sp[1].keys() == again[1].keys()
        for name in sp[1]:
            assert torch.equal(sp[1][name], again[1][name]), name
        assert refused is not None and "restore_sequence_parallel" in refused


def _rank_replaced_after():
    from arctic import apply_sequence_parallel, apply_sp_loss, remove_sequence_parallel
    from helpers import get_mesh
    from ulysses import flat_mesh

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model(), mesh=mesh)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: None)  # not ours: kept
    own = model.forward
    model.forward = lambda *a, **k: own(*a, **k)  # someone wraps the forward after us
    errors = []
    for call in (remove_sequence_parallel, lambda m: remove_sequence_parallel(torch.nn.Linear(
            1, 1))):
        try:
            call(model)
        except ValueError as e:
            errors.append(str(e))
    model.forward = own  # the wrapper taken off: SP comes off
    remove_sequence_parallel(model)
    hooks = len(model.model.layers[0].self_attn._forward_hooks)
    return errors, hooks, model.config._attn_implementation


def test_a_forward_replaced_after_sp_is_not_overwritten():
    for errors, hooks, impl in dist_pool.run(_rank_replaced_after, world_size=2):
        assert len(errors) == 2
        assert "changed after sequence parallelism was applied" in errors[0]
        assert "no sequence parallelism applied" in errors[1]
        assert hooks == 1  # the hook registered after SP survives its removal
        assert impl == "sdpa"
