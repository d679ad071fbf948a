"""Calls to wrapped HF forwards are bound through the installed signature
(:mod:`arctic.hf.binding`): arguments are found by role under any name a release gives them,
HF's loss arguments pass over the attention, and DeepSpeed's ALST-style ``model(**batch)``
with ``shift_labels`` runs on an SP model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import dist_pool
from helpers import TOL, assert_fp32_exact, count_collectives, get_mesh

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")
pytestmark = pytest.mark.hf_facing

from test_arctic_hf_families import S, _model, _tokens  # noqa: E402


def _future_module():
    """A module whose forward a later release might ship: the cache renamed again (found by
    its ``Cache`` annotation), the old name kept through transformers' ``deprecate_kwarg``."""
    from transformers.cache_utils import Cache
    from transformers.utils.deprecation import deprecate_kwarg

    class FutureAttention(nn.Module):
        @deprecate_kwarg("kv_memory", version="99.0", new_name="kv_store")
        def forward(self, hidden_states: torch.Tensor, rotary=None,
                    kv_store: Cache | None = None, **kwargs):
            return hidden_states

    return FutureAttention()


def test_roles_are_found_by_annotation_and_renames_by_deprecate_kwarg():
    from arctic.hf.binding import of_module

    sig = of_module(_future_module())
    assert sig.first == "hidden_states" and sig.roles["cache"] == "kv_store"
    assert sig.renames["kv_memory"] == "kv_store"  # the release's own deprecate_kwarg
    assert sig.renames["past_key_values"] == "kv_store"  # an older name of the role
    x = torch.ones(1)
    for name in ("kv_store", "kv_memory", "past_key_values"):
        call = sig.bind((), {"hidden_states": x, name: "cache-object"})
        assert call.first is x and call.role("cache") == "cache-object" and not call.extra
    with pytest.raises(ValueError, match="'kv_memory' and 'kv_store'"):
        sig.bind((x,), {"kv_memory": 1, "kv_store": 2})
    call = sig.bind((x, "rope"), {"position_ids": 3})
    assert call.unknown() == ["rotary"] and call.extra == {"position_ids": 3}


def _undeclared_wrapper(name: str):
    """transformers 5.13's ``force_accelerate_hooks``, line for line in what matters: a
    pass-through ``(self, *args, **kwargs)`` without ``functools.wraps``."""
    def decorator(forward_func):
        def wrapped(self, *args, **kwargs):
            getattr(self, name)
            return forward_func(self, *args, **kwargs)
        return wrapped
    return decorator


def test_a_wrapper_that_does_not_declare_its_forward_is_seen_through():
    """Qwen3.5's gated delta net forward is so wrapped in transformers 5.13: its input and its
    ``cache_params`` are found in the forward the wrapper holds, under a ``deprecate_kwarg``
    outside it as well."""
    from transformers.cache_utils import Cache
    from transformers.utils.deprecation import deprecate_kwarg

    from arctic.hf.binding import of_module

    class Mixer(nn.Module):
        @deprecate_kwarg("old_cache", version="99.0", new_name="cache_params")
        @_undeclared_wrapper("conv1d")
        def forward(self, hidden_states, cache_params: Cache | None = None, attention_mask=None,
                    **kwargs):
            return hidden_states

    sig = of_module(Mixer())
    assert sig.first == "hidden_states" and sig.roles["cache"] == "cache_params"
    assert sig.roles["attention_mask"] == "attention_mask"
    assert sig.renames["old_cache"] == "cache_params"
    assert sig.renames["past_key_values"] == "cache_params"
    call = sig.bind((torch.ones(1),), {"past_key_values": "c"})
    assert call.role("cache") == "c" and not call.extra


def test_installed_llama_forwards_bind_the_cache_by_role():
    """Whatever the installed release calls the cache (``past_key_values`` before 5.24,
    ``cache`` since), both names bind to it, on the attention and on the decoder layer."""
    from transformers.models.llama import modeling_llama as ml

    from arctic.memory.checkpointing import cache_kwargs
    from arctic.hf.binding import class_forward

    for cls in (ml.LlamaAttention, ml.LlamaDecoderLayer):
        sig = class_forward(cls)
        own = sig.roles["cache"]
        assert own in sig.signature.parameters
        for name in ("past_key_values", "cache"):
            call = sig.bind((torch.ones(1),), {name: "kv", "position_embeddings": (1, 2)})
            assert call.role("cache") == "kv" and call.named[own] == "kv", (cls, name)
            assert not call.unknown() and not call.extra
    layers = _model("llama").model.layers
    assert {"past_key_values", "cache", class_forward(ml.LlamaDecoderLayer).roles["cache"]} \
        <= set(cache_kwargs(list(layers)))


def _mlp_and_references(x):
    """A Llama model, its first MLP, that MLP's untiled fp32 output on ``x`` and its fp64
    one (a copy in fp64)."""
    model = _model("llama")
    mlp = model.model.layers[0].mlp
    want = type(mlp).forward(mlp, x)
    ref = type(mlp).forward(copy.deepcopy(mlp).double(), x.double())
    return model, mlp, want, ref


def test_tiled_mlp_binds_its_input_by_name_and_refuses_more():
    from arctic import apply_tiled_mlp

    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0))
    model, mlp, want, ref = _mlp_and_references(x)
    apply_tiled_mlp(model, tiles=2)
    name = list(inspect.signature(type(mlp).forward).parameters)[1]
    # Two products of 4 rows against one of 8: a matrix library may add them in another
    # order (2.8e-9 apart on an AVX-512 CPU, issue 56), so "as exact as the untiled MLP"
    # against fp64; a misplaced or dropped tile is ~max |ref| off (the test below).
    assert_fp32_exact(mlp(**{name: x}), want, ref, what="tiled MLP, input by name")
    assert_fp32_exact(mlp(x), want, ref, what="tiled MLP, input by position")
    with pytest.raises(TypeError):
        mlp(x, x)


@pytest.mark.parametrize("wrong", ["tile dropped", "tiles swapped", "shifted a token",
                                   "scaled by 1 + 1e-5"])
def test_tiled_mlp_check_rejects_a_wrong_tiling(wrong):
    """The check above fails each wrong result built from the same MLP's own tiles."""
    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0))
    _, mlp, want, ref = _mlp_and_references(x)
    tile = lambda part: type(mlp).forward(mlp, part)  # noqa: E731
    got = {"tile dropped": lambda: torch.cat([tile(x[:, :4]), torch.zeros(1, 4, 64)], 1),
           "tiles swapped": lambda: torch.cat([tile(x[:, 4:]), tile(x[:, :4])], 1),
           "shifted a token": lambda: tile(x.roll(1, dims=1)),
           "scaled by 1 + 1e-5": lambda: want * (1 + 1e-5)}[wrong]()
    with pytest.raises(AssertionError, match="more than twice the plain path"):
        assert_fp32_exact(got, want, ref, what=wrong)


def _rank_fused_call_names():
    """The fused attention module called as each release's decoder layer calls it."""
    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("llama"), mesh=mesh, head_chunk_size=1,
                                    fuse_projections=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, S // 2, 64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(S // 2)[None] + dist_rank() * S // 2
    rope = model.model.rotary_emb(x, pos)
    outs = [attn(hidden_states=x, position_embeddings=rope, **{name: None}, use_cache=False,
                 position_ids=pos)[0] for name in ("past_key_values", "cache")]
    outs.append(attn(x, rope, None, None)[0])  # all positional: hidden, rope, mask, cache
    refusals = {}
    for name, kw in {"cache": {"cache": object()}, "past": {"past_key_values": object()},
                     "unknown": {"fresh_argument": 1}}.items():
        with count_collectives() as counts:
            try:
                attn(hidden_states=x, position_embeddings=rope, **kw)
                refusals[name] = "no error"
            except ValueError as e:
                refusals[name] = str(e)
        assert not counts, (name, counts)
    return [o.detach() for o in outs], refusals


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_fused_attention_binds_every_name_of_the_cache_and_refuses_a_cache():
    for outs, refusals in dist_pool.run(_rank_fused_call_names, world_size=2):
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0], atol=0, rtol=0)
        assert "KV cache" in refusals["cache"] and "KV cache" in refusals["past"], refusals
        assert "'fresh_argument'" in refusals["unknown"] and "transformers" in \
            refusals["unknown"], refusals


def _rank_alst_style(positional_ids: bool):
    """DeepSpeed's / HF's ALST loop: ``model(**batch)`` with ``shift_labels`` (and the HF
    Trainer's ``num_items_in_batch``) in the batch on an SP model, the loss from the logits."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("llama"), mesh=mesh)
    batch = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens()}, mesh)
    shift_labels = batch["shift_labels"]
    valid = (shift_labels != -100).sum()
    if positional_ids:  # the batch hook binds position_ids given positionally too
        hidden = model.model(batch["input_ids"], None, batch["position_ids"]).last_hidden_state
        logits = model.lm_head(hidden)
    else:
        logits = model(**batch, num_items_in_batch=valid).logits
    total = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(),
                            reduction="sum")
    sums = torch.stack([total.detach(), valid.float()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


@pytest.mark.parametrize("positional_ids", [False, True])
def test_alst_style_call_with_shift_labels_runs_and_matches(positional_ids):
    ids = _tokens()
    want = _model("llama")(input_ids=ids, labels=ids).loss.item()
    for got in dist_pool.run(_rank_alst_style, positional_ids, world_size=2):
        assert abs(got - want) <= TOL[torch.float32]["rtol"] * abs(want), (got, want)


def _rank_sp_loss_refuses_hf_loss_arguments():
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("llama"), mesh=mesh)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    batch = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens()}, mesh)
    found = {}
    for name, value in {"vocab_size": 128}.items():  # HF's loss arguments not computed here
        with count_collectives() as counts:
            try:
                model(**batch, **{name: value})
                found[name] = "no error"
            except ValueError as e:
                found[name] = str(e)
        found[name + " collectives"] = dict(counts)
    unshifted = {k: v for k, v in batch.items() if k != "shift_labels"}
    with count_collectives() as counts:
        try:
            model(**unshifted)
            found["no labels"] = "no error"
        except ValueError as e:
            found["no labels"] = str(e)
    found["no labels collectives"] = dict(counts)
    # num_items_in_batch is HF's divisor: the group's summed loss over it, and the gradient
    # scaled the same way.
    totals = (batch["shift_labels"] != -100).sum().float().reshape(1)  # this rank's piece
    torch.distributed.all_reduce(totals)
    mean = model(**batch)
    mean.backward()
    g_mean = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    divided = model(**batch, num_items_in_batch=torch.tensor(1000))
    divided.backward()
    g_divided = model.model.embed_tokens.weight.grad.clone()
    found["return_dict"] = (type(model(**batch, return_dict=True)).__name__,
                            model(**batch, return_dict=True).loss.item(),
                            model(**batch, return_dict=False)[0].item(), mean.item())
    found["ratio"] = (divided / mean).item()
    found["grad ratio"] = (g_divided.norm() / g_mean.norm()).item()
    found["count"] = totals.item()
    with count_collectives() as counts:
        try:
            model(**batch, num_items_in_batch=0)
            found["zero"] = "no error"
        except ValueError as e:
            found["zero"] = str(e)
    return found


def test_sp_loss_refuses_hf_loss_arguments_it_does_not_compute():
    """A loss argument the SP loss does not compute (vocab_size) and a batch without labels
    are refused before any collective; num_items_in_batch divides the summed loss (forward
    and backward) instead of the count. (labels= and ignore_index=: test_arctic_sp_labels.)"""
    for found in dist_pool.run(_rank_sp_loss_refuses_hf_loss_arguments, world_size=2):
        assert "'vocab_size'" in found["vocab_size"], found
        assert not found["vocab_size collectives"], found
        assert "got neither" in found["no labels"], found
        assert not found["no labels collectives"], found
        want = found["count"] / 1000
        assert found["ratio"] == pytest.approx(want, rel=1e-5), found
        assert found["grad ratio"] == pytest.approx(want, rel=1e-4), found
        assert "num_items_in_batch must be positive" in found["zero"], found
        kind, as_dict, as_tuple, mean = found["return_dict"]
        assert kind == "CausalLMOutput" and as_dict == as_tuple == mean, found
