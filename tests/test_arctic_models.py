"""Sequence-parallel training of HF models built from tiny configs, against plain HF.

Every rank builds the same model from one seed and the same token batch. The SP runs go
through the public path: ``apply_sequence_parallel``, ``prepare_sp_batch``, ``apply_sp_loss``
and a DDP-style gradient average over all ranks; the reference is the unmodified model with
its own loss (``labels=input_ids``) on one process.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh

transformers = pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB, STEPS = 256, 128, 10


def _model(name: str, kv_heads: int, seed: int = 0):
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config)

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[name]
    cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=1024,
              attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _tokens(seed: int = 1):
    return torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(seed))


def _labels(masked_tail: bool):
    """The input ids as labels; with ``masked_tail`` the second half is -100, so on 2 ranks
    the second rank holds no valid label at all."""
    labels = _tokens().clone()
    if masked_tail:
        labels[:, S // 2:] = -100
    return labels


def _fit(model, step_loss, after_backward=lambda model: None):
    """STEPS AdamW steps of ``step_loss()``; returns the losses and the gradients of step 1
    (taken after ``after_backward``, e.g. a DDP-style average)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(STEPS):
        loss = step_loss()
        loss.backward()
        after_backward(model)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _train_reference(name, kv_heads, masked_tail=False):
    model = _model(name, kv_heads)
    ids, labels = _tokens(), _labels(masked_tail)
    return _fit(model, lambda: model(input_ids=ids, labels=labels).loss)


def _rank_train_sp(name, kv_heads, ulysses, ring, chunk, tiled_mlp=False, masked_tail=False):
    import torch.distributed as dist

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from arctic.tiling.mlp import apply_tiled_mlp
    from ulysses import flat_mesh

    world = ulysses * ring
    mesh = get_mesh(world, ulysses, ring)
    model = apply_sequence_parallel(_model(name, kv_heads), mesh=mesh, head_chunk_size=chunk)
    if tiled_mlp:
        apply_tiled_mlp(model, tiles=3)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    batch = prepare_sp_batch({"input_ids": _tokens(), "labels": _labels(masked_tail)}, mesh)
    if masked_tail and flat_mesh(mesh, "sp").get_local_rank() == 1:
        assert (batch["shift_labels"] == -100).all()

    def average(model):  # what DDP does: average over every rank
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world

    return _fit(model, lambda: model(**batch), average)


def _check(results, reference):
    ref_losses, ref_grads = reference
    for losses, grads in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=0,
                                   rtol=1e-5)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")


_REFS: dict = {}


def _reference(name, kv_heads, masked_tail=False):
    key = (name, kv_heads, masked_tail)
    if key not in _REFS:
        _REFS[key] = _train_reference(name, kv_heads, masked_tail)
    return _REFS[key]


@pytest.mark.parametrize("sp", [2, 4])
def test_llama_sp_matches_single_device(sp):
    """10 AdamW steps: the loss trajectory within 1e-5 relative, every gradient after step 1."""
    results = dist_pool.run(_rank_train_sp, "llama", 4, sp, 1, None, world_size=sp)
    _check(results, _reference("llama", 4))


def test_rank_with_only_ignored_labels():
    """SP=2 where rank 1's labels are all -100: finite loss, single-device trajectory and
    gradients."""
    results = dist_pool.run(_rank_train_sp, "llama", 4, 2, 1, None, masked_tail=True,
                            world_size=2)
    assert all(all(map(lambda x: x == x and abs(x) < 1e9, losses)) for losses, _ in results)
    _check(results, _reference("llama", 4, masked_tail=True))


def test_qwen2_kv_replicated_sp4():
    """Qwen2 with 2 kv heads on 4 Ulysses ranks: each kv head is replicated to 2 ranks."""
    results = dist_pool.run(_rank_train_sp, "qwen2", 2, 4, 1, None, world_size=4)
    _check(results, _reference("qwen2", 2))


def test_mistral_hybrid_chunked_tiled():
    """Mistral on U=2 x R=2 (zigzag) with head chunks of 1 and a tiled MLP."""
    results = dist_pool.run(_rank_train_sp, "mistral", 4, 2, 2, 1, tiled_mlp=True,
                            world_size=4)
    _check(results, _reference("mistral", 4))


def _rank_packed(ring):
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from ulysses import gather_sequence

    mesh = get_mesh(2, 2 // ring, ring)
    model = apply_sequence_parallel(_model("llama", 4), mesh=mesh)
    ids = _tokens()
    lengths = (100, 60, S - 160)  # three documents packed in one row
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = prepare_sp_batch({"input_ids": ids, "position_ids": position_ids}, mesh)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    full = gather_sequence(logits.detach(), mesh, dim=1)[:, :S]
    shift = gather_sequence(batch["shift_labels"], mesh, dim=1)[:, :S]
    return full, shift


@pytest.mark.parametrize("ring", [1, 2], ids=["ulysses2", "ring2"])
def test_packed_documents_do_not_attend_across_boundaries(ring):
    lengths = (100, 60, S - 160)
    model, ids = _model("llama", 4), _tokens()
    with torch.no_grad():
        separate = torch.cat([model(input_ids=part).logits
                              for part in ids.split(list(lengths), dim=1)], dim=1)
    for full, shift in dist_pool.run(_rank_packed, ring, world_size=2):
        torch.testing.assert_close(full, separate, **TOL[torch.float32])
        ends = torch.tensor(lengths).cumsum(0) - 1  # a document's last token predicts nothing
        assert (shift[0, ends] == -100).all() and (shift[0, :-1] != -100).sum() == S - 3


def _rank_errors():
    from arctic.hf.attention import apply_sequence_parallel

    mesh, errors = get_mesh(4, 4), {}
    model = apply_sequence_parallel(_model("llama", 4), mesh=mesh)
    cases = {
        "no_position_ids": lambda: model(input_ids=_tokens()[:, :64]),
        "too_many_ranks": lambda: apply_sequence_parallel(_model_heads(3), mesh=mesh),
        "bad_chunk": lambda: apply_sequence_parallel(_model("llama", 4), mesh=mesh,
                                                     head_chunk_size=3),
        "bad_impl": lambda: apply_sequence_parallel(_model("llama", 4), mesh=mesh,
                                                    attn_implementation="sdpa"),
        "flash_on_cpu": lambda: apply_sequence_parallel(
            _model("llama", 4), mesh=mesh, attn_implementation="ulysses_flash_attention_2"),
    }
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    return errors


def _model_heads(kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=6,
                                        num_key_value_heads=kv_heads))


def test_bad_setup_raises_value_error_on_every_rank():
    for errors in dist_pool.run(_rank_errors, world_size=4, timeout=120):
        assert "position_ids are required" in errors["no_position_ids"]
        assert "num_kv_heads (3)" in errors["too_many_ranks"]
        assert "head_chunk_size=3" in errors["bad_chunk"]
        assert "ulysses_sdpa" in errors["bad_impl"]
        assert "flash_attn" in errors["flash_on_cpu"]


def _rank_reapply():
    from arctic.hf.attention import apply_sequence_parallel

    model, mesh = _model("llama", 4), get_mesh(2, 2)
    for _ in range(2):
        apply_sequence_parallel(model, mesh=mesh)
    rows = slice(16 * mesh["ulysses"].get_local_rank(), 16 * (mesh["ulysses"].get_local_rank() + 1))
    logits = model(input_ids=_tokens()[:, rows],
                   position_ids=torch.arange(32)[None, rows]).logits
    return len(model.model._forward_pre_hooks), tuple(logits.shape)


def test_applying_twice_keeps_one_batch_hook():
    for hooks, shape in dist_pool.run(_rank_reapply, world_size=2):
        assert hooks == 1 and shape == (1, 16, VOCAB)
