"""Fused projections (ulysses.fused_attention, arctic fuse_projections): the same loss and
gradients as the unfused head-chunked path and a single-device reference, less memory.

Kernel-level cases build one random Llama-style attention block (q/k/v/o weights, optional
biases and Qwen3 per-head norms) from a seed on every rank; the unfused path is
``o_proj(ulysses_attention(rope(q_proj(x)), ...))`` on the same shards, and the reference
is the block in float64 on the whole sequence. fp32 tolerances are :data:`helpers.TOL`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_pool
from helpers import TOL, get_mesh
from helpers import value_error_of as _error
from ulysses import flat_mesh, gather_sequence, shard_sequence, ulysses_attention
from ulysses.fused_attention import fused_attention
from ulysses.attention import local_attention

transformers = pytest.importorskip("transformers", reason="the HF cases need transformers")

E, D = 32, 8
WEIGHTS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm_weight", "k_norm_weight")


def _block_params(seed, H, K, bias, norm):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    p = dict(wq=rand(H * D, E), wk=rand(K * D, E), wv=rand(K * D, E), wo=rand(E, H * D))
    if bias:
        p.update(bq=rand(H * D), bk=rand(K * D), bv=rand(K * D), bo=rand(E))
    if norm:
        p.update(q_norm_weight=1 + rand(D), k_norm_weight=1 + rand(D))
    return p


def _inputs(seed, B, S, rotary: int = D, offset: int = 5):
    """x and dy ``[B, S, E]``, and HF-style cos/sin ``[B, S, rotary]`` (rows start ``offset``
    positions apart)."""
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, S, E, generator=g), torch.randn(B, S, E, generator=g)
    pos = torch.arange(S)[None] + offset * torch.arange(B)[:, None]
    freqs = pos[..., None].float() / 10000 ** (torch.arange(0, rotary, 2).float() / rotary)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, dy, emb.cos(), emb.sin()


def _unfused(x, cos, sin, p, H, K, attention, eps=1e-6):
    """The HF attention block, written out: q/k/v Linear, Qwen3 norm, RoPE, attention, o_proj."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, s, _ = x.shape
    q, k, v = (F.linear(x, p[w], p.get(b)).view(B, s, -1, D)
               for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    if "q_norm_weight" in p:
        def norm(t, w):
            t32 = t.float()
            return w * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)
        q, k = norm(q, p["q_norm_weight"]), norm(k, p["k_norm_weight"])
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    out = attention(q, k, v)
    return F.linear(out.reshape(B, s, H * D), p["wo"], p.get("bo"))


def _grads(fn, x, dy, p):
    """``fn(x, p)``'s output and the gradients of x and every parameter for output grad dy."""
    x = x.clone().requires_grad_()
    p = {n: t.clone().requires_grad_() for n, t in p.items()}
    y = fn(x, p)
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, **{n: t.grad for n, t in p.items()}}


def _reference(H, K, B, S, bias, norm, seed, segments=None):
    x, dy, cos, sin = (t.double() for t in _inputs(seed, B, S))
    p = {n: t.double() for n, t in _block_params(seed, H, K, bias, norm).items()}
    if segments is None:
        attention = lambda q, k, v: local_attention(q, k, v, causal=True, backend="math")  # noqa
    else:
        def attention(q, k, v):  # each document alone
            rows = []
            for b, starts in enumerate(segments):
                ends = starts[1:] + (S,)
                rows.append(torch.cat([local_attention(
                    q[b:b + 1, i:j], k[b:b + 1, i:j], v[b:b + 1, i:j], causal=True,
                    backend="math") for i, j in zip(starts, ends)], dim=1))
            return torch.cat(rows)
    return _grads(lambda x, p: _unfused(x, cos, sin, p, H, K, attention), x, dy, p)


def _rank_block(world, ulysses, H, K, B, S, chunk, overlap, bias, norm, seed, segments=None):
    """Fused and unfused fwd+bwd on this rank's shards: y and dx shards, and this rank's
    (partial) parameter gradients."""
    mesh = get_mesh(world, ulysses, world // ulysses)
    x, dy, cos, sin = (shard_sequence(t, mesh) for t in _inputs(seed, B, S))
    p = _block_params(seed, H, K, bias, norm)
    common = dict(mesh=mesh, head_chunk_size=chunk, segments=segments)
    fused = _grads(lambda x, p: fused_attention(x, cos, sin, **p, num_heads=H, num_kv_heads=K,
                                                chunk_overlap=overlap, **common), x, dy, p)
    unfused = _grads(lambda x, p: _unfused(x, cos, sin, p, H, K, lambda q, k, v: ulysses_attention(
        q, k, v, causal=True, chunk_overlap=overlap, **common)), x, dy, p)
    return mesh, fused, unfused


def _rank_block_sharded(*args, **kwargs):
    mesh, fused, unfused = _rank_block(*args, **kwargs)
    # y and dx: gather the shards back into the natural order; parameter grads: sum the ranks'.
    out = []
    for got in (fused, unfused):
        got = dict(got)
        for n in ("y", "x"):
            got[n] = gather_sequence(got[n], mesh, dim=1)
        for n in sorted(set(got) - {"y", "x"}):  # one order on every rank
            torch.distributed.all_reduce(got[n])
        out.append(got)
    return out


def _check(results, ref):
    for fused, unfused in results:
        assert set(fused) == set(unfused) == set(ref)
        for name in ref:
            torch.testing.assert_close(fused[name].double(), ref[name], **TOL[torch.float32],
                                       msg=lambda m: f"fused {name} vs reference: {m}")
            torch.testing.assert_close(fused[name], unfused[name], **TOL[torch.float32],
                                       msg=lambda m: f"fused {name} vs unfused: {m}")


CASES = {  # world, ulysses, H, K, chunk, overlap, bias, norm
    "u2-gqa-c1": (2, 2, 8, 4, 1, True, False, False),
    "u2-gqa-c2-nooverlap-bias": (2, 2, 8, 4, 2, False, True, False),
    "u2-k2-c1-qwen3norm": (2, 2, 8, 2, 1, True, False, True),
    "u4-k2-replicated-c1": (4, 4, 8, 2, 1, True, False, False),
    "u4-k2-replicated-c2-nooverlap-bias": (4, 4, 8, 2, 2, False, True, False),
    "u4-k4-c1-bias-norm": (4, 4, 8, 4, 1, True, True, True),
    "u4-uneven-gqa-idle-ranks": (4, 4, 12, 6, 1, True, True, False),
    "u4-uneven-mha-nooverlap": (4, 4, 6, 6, 1, False, False, False),
    "u4-mqa-c2": (4, 4, 8, 1, 2, True, True, False),
    "u2xr2-hybrid-c1": (4, 2, 8, 4, 1, True, True, False),
    "u1xr2-ring-auto": (2, 1, 8, 4, "auto", True, False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_unfused_and_reference(case):
    """B=2, S=32: y, dx and every weight/bias/norm gradient (summed over ranks)."""
    world, ulysses, H, K, chunk, overlap, bias, norm = CASES[case]
    seed = sum(map(ord, case)) % 1000
    results = dist_pool.run(_rank_block_sharded, world, ulysses, H, K, 2, 32, chunk, overlap,
                            bias, norm, seed, world_size=world)
    _check(results, _reference(H, K, 2, 32, bias, norm, seed))


@pytest.mark.parametrize("world,ulysses", [(2, 2), (2, 1), (4, 2)],
                         ids=["u2", "u1xr2-ring", "u2xr2-hybrid"])
def test_packed_documents(world, ulysses):
    """Documents in one row (segments): no token attends across a boundary; on a ring they
    cross ring blocks and zigzag halves (chunks of 8 at R = 2)."""
    segments = ((0, 10, 21), (0, 16))
    results = dist_pool.run(_rank_block_sharded, world, ulysses, 8, 2, 2, 32, 1, True, True,
                            False, 7, segments=segments, world_size=world)
    _check(results, _reference(8, 2, 2, 32, True, False, 7, segments=segments))


def test_per_rank_gradients_equal_unfused():
    """Before any reduction, each rank's own parameter gradients (from its tokens) equal the
    unfused path's: the fused backward routes every head's gradient to the rank that
    projected it."""
    for _mesh, fused, unfused in dist_pool.run(_rank_block, 4, 4, 12, 6, 2, 32, 1, True, True,
                                               False, 3, world_size=4):
        for name in fused:
            torch.testing.assert_close(fused[name], unfused[name], **TOL[torch.float32],
                                       msg=lambda m: f"{name}: {m}")


# --- HF models through apply_sequence_parallel ------------------------------------------------

S, VOCAB = 64, 96


def _model(name, kv_heads, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[name]
    extra = {"head_dim": 8} if name == "qwen3" else {}
    cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=256,
              attention_dropout=0.0, tie_word_embeddings=False, use_cache=False, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # HF initializes biases and norms to 0 and 1: make them count
        for n, p in model.named_parameters():
            if n.endswith(("_proj.bias", "_norm.weight")):
                p.add_(0.5 * torch.randn(p.shape))
    return model


def _tokens():
    return torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))


def _rank_model(name, kv_heads, ulysses, ring, chunk, checkpointing=False):
    """Loss and DDP-averaged gradients of one step, fused and unfused, on the same batch."""
    import torch.distributed as dist

    from arctic import apply_activation_checkpointing
    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss

    world = ulysses * ring
    mesh = get_mesh(world, ulysses, ring)
    batch = prepare_sp_batch({"input_ids": _tokens()}, mesh)
    got = {}
    for fuse in (True, False):
        model = apply_sequence_parallel(_model(name, kv_heads), mesh=mesh, head_chunk_size=chunk,
                                        fuse_projections=fuse)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
        if checkpointing:
            apply_activation_checkpointing(model)
        loss = model(**batch)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        got[fuse] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
        if fuse:
            attn = model.model.layers[0].self_attn
            assert "forward" in vars(attn) and attn._z3_leaf
            assert set(model.state_dict()) == set(_model(name, kv_heads).state_dict())
    return got


def _model_reference(name, kv_heads):
    model, ids = _model(name, kv_heads), _tokens()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,kv_heads,ulysses,ring,chunk,ckpt", [
    ("llama", 4, 2, 1, 1, False), ("llama", 2, 2, 1, 2, True), ("qwen2", 2, 4, 1, 1, False),
    ("qwen3", 4, 2, 1, 1, False), ("llama", 4, 2, 2, 1, False)],
    ids=["llama-u2-c1", "llama-u2-c2-checkpointed", "qwen2-bias-u4-replicated",
         "qwen3-norm-u2", "llama-u2xr2-hybrid"])
def test_hf_model_fused_matches_unfused(name, kv_heads, ulysses, ring, chunk, ckpt):
    """Tiny random models end to end (apply_sequence_parallel + SP loss): the fused loss and
    every parameter gradient equal the unfused ones (to 1e-5) and the single-device model's."""
    ref_loss, ref_grads = _model_reference(name, kv_heads)
    for got in dist_pool.run(_rank_model, name, kv_heads, ulysses, ring, chunk, ckpt,
                             world_size=ulysses * ring):
        (f_loss, f_grads), (u_loss, u_grads) = got[True], got[False]
        assert abs(f_loss - u_loss) <= 1e-5 * abs(u_loss)
        assert abs(f_loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert set(f_grads) == set(u_grads) == set(ref_grads)
        for n in f_grads:
            torch.testing.assert_close(f_grads[n], u_grads[n], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{n} fused vs unfused: {m}")
            torch.testing.assert_close(f_grads[n], ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n} fused vs reference: {m}")


# --- memory -----------------------------------------------------------------------------------

def _rank_attention_peak(S_full, hidden, H, K):
    """MemTracker peak (beyond what exists before) of one HF attention block's forward +
    backward at c=1, stock forward vs fused; min of 3 warm runs each (gloo's worker thread can
    hold a finished exchange's buffer a moment longer, which only ever adds memory)."""
    from ulysses.torch_internals import step_mem_tracker
    from transformers import LlamaConfig, LlamaForCausalLM

    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden,
                      num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=K,
                      use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    x, dy = (shard_sequence(torch.randn(1, S_full, hidden, generator=g), mesh).contiguous()
             for _ in range(2))
    position_ids = shard_sequence(torch.arange(S_full)[None], mesh)
    cos, sin = model.model.rotary_emb(x, position_ids)
    attn = model.model.layers[0].self_attn
    peaks, held = {}, {}
    for fuse in (False, True):
        apply_sequence_parallel(model, mesh=mesh, head_chunk_size=1, fuse_projections=fuse)
        runs = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            mt = step_mem_tracker()
            mt.track_external(model, leaf, dy, cos, sin)
            with mt:
                base = mt.get_tracker_snapshot("current")[x.device]["Total"]
                y, _ = attn(leaf, position_embeddings=(cos, sin), attention_mask=None)
                after_forward = mt.get_tracker_snapshot("current")[x.device]["Total"] - base
                y.backward(dy)
            runs.append((mt.get_tracker_snapshot("peak")[x.device]["Total"] - base,
                         after_forward))
        # The first call is cold (allocator, lazy init).
        peaks[fuse], held[fuse] = (min(r[i] for r in runs[1:]) for i in (0, 1))
    head_dim = hidden // H
    q_bytes = x.shape[0] * x.shape[1] * H * head_dim * 4  # all-heads seq-local q, fp32
    return peaks, held, q_bytes


def test_fused_peak_is_lower_by_at_least_the_all_heads_q():
    """Llama block, Hq=Hkv=8, D=32, S=2048 on 2 ranks, c=1: the fused forward+backward peak is
    below the stock forward's by at least the all-heads seq-local q, k and v (3 x 1 MiB here),
    which the stock forward keeps for backward and the fused one never forms (nor their
    gradients, nor the all-heads dout: measured 4.7 MiB less)."""
    for peaks, held, q_bytes in dist_pool.run(_rank_attention_peak, 2048, 256, 8, 8,
                                              world_size=2):
        print(f"peak unfused {peaks[False]} B, fused {peaks[True]} B, all-heads q {q_bytes} B; "
              f"held after forward: unfused {held[False]} B, fused {held[True]} B")
        assert peaks[False] - peaks[True] >= 3 * q_bytes, (peaks, q_bytes)
        # Between forward and backward the fused block holds its output y ([1, 1024, 256]
        # fp32: q_bytes here), the attention output it saved (q_bytes), the fp32 lse
        # ([1, 4, 2048]) and its head index plans (< 8 KiB); nothing else of activation size.
        lse_bytes = 4 * 2048 * 4
        assert held[True] <= 2 * q_bytes + lse_bytes + 8192, (held, q_bytes)


# --- ZeRO-3 -----------------------------------------------------------------------------------

def _rank_zero3():
    """arctic.initialize with ZeRO-3: the fused attention module is a ZeRO-3 leaf, so its
    projections are gathered although no q_proj(...) call happens."""
    from deepspeed.utils import safe_get_full_grad

    import arctic.train.deepspeed
    from arctic.data.batch import prepare_sp_batch
    from helpers import init_deepspeed_comm

    init_deepspeed_comm()
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
              "ulysses": {"head_chunk_size": 1, "fuse_projections": True,
                          "activation_checkpointing": True}}
    engine, *_ = arctic.train.deepspeed.initialize(model=_model("qwen2", 2), config=config)
    batch = prepare_sp_batch({"input_ids": _tokens()}, engine.sp_mesh)
    loss = engine(**batch)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.step()
    return loss.item(), grads


def test_zero3_fused_matches_single_device():
    ref_loss, ref_grads = _model_reference("qwen2", 2)
    for loss, grads in dist_pool.run(_rank_zero3, world_size=2, timeout=240):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")


def _rank_fsdp2():
    """FSDP2 (arctic.apply_fsdp, each layer resharded after forward) over checkpointed, fused
    layers: the projections' weights are read from the unsharded layer in forward and in the
    backward recompute."""
    from arctic import apply_activation_checkpointing
    from arctic.data.batch import prepare_sp_batch
    from arctic.train.fsdp import apply_fsdp
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss

    mesh = get_mesh(2, 2)
    model = apply_sequence_parallel(_model("qwen3", 4), mesh=mesh, head_chunk_size=2,
                                    fuse_projections=True)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2, averaged_over_sp=True)
    apply_activation_checkpointing(model)
    apply_fsdp(model, mesh=mesh)
    loss = model(**prepare_sp_batch({"input_ids": _tokens()}, mesh))
    loss.backward()
    return loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_fsdp2_fused_matches_single_device():
    ref_loss, ref_grads = _model_reference("qwen3", 4)
    for loss, grads in dist_pool.run(_rank_fsdp2, world_size=2):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")


# --- refused combinations ---------------------------------------------------------------------

def _rank_errors():
    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)
    apply = lambda model, **kw: apply_sequence_parallel(model, mesh=mesh, **kw)  # noqa: E731
    lora_like = _model("llama", 4)
    lora_like.model.layers[1].self_attn.q_proj = torch.nn.Sequential(
        lora_like.model.layers[1].self_attn.q_proj)
    # A subclass may override forward (as other families' attention does): not in FUSABLE.
    other = _model("llama", 4)
    attn = other.model.layers[0].self_attn
    attn.__class__ = type("SubclassedAttention", (type(attn),), {})
    fused = apply(_model("llama", 4), head_chunk_size=1, fuse_projections=True)
    ids, pos = _tokens()[:, :8], torch.arange(8)[None]
    x, cos, sin = torch.randn(1, 8, E), torch.ones(1, 8, D), torch.zeros(1, 8, D)
    p = _block_params(0, 4, 2, False, False)
    block = lambda **kw: fused_attention(  # noqa: E731
        **{"x": x, "cos": cos, "sin": sin, **p, "num_heads": 4, "num_kv_heads": 2,
           "mesh": mesh, "head_chunk_size": 1, **kw})
    errors = {
        "no_chunking": _error(lambda: apply(_model("llama", 4), fuse_projections=True)),
        "not_bool": _error(lambda: apply(_model("llama", 4), head_chunk_size=1,
                                         fuse_projections="yes")),
        "not_linear": _error(lambda: apply(lora_like, head_chunk_size=1, fuse_projections=True)),
        "other_class": _error(lambda: apply(other, head_chunk_size=1, fuse_projections=True)),
        "kv_cache": _error(lambda: fused(input_ids=ids, position_ids=pos, use_cache=True)),
        "block_no_chunking": _error(lambda: block(head_chunk_size=None)),
        "block_wq_shape": _error(lambda: block(wq=torch.randn(4 * D, E + 1))),
        "block_cos_shape": _error(lambda: block(cos=torch.ones(1, 8, D + 2))),
        "block_one_norm": _error(lambda: block(q_norm_weight=torch.ones(D))),
        "block_dtype": _error(lambda: block(x=x.double())),
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        errors["block_autocast"] = _error(lambda: block())
    # Nothing was changed by a refused apply; fused -> unfused restores the class forward.
    assert "forward" not in vars(lora_like.model.layers[0].self_attn)
    apply(fused, head_chunk_size=1)
    errors["unfused_again"] = "forward" in vars(fused.model.layers[0].self_attn)
    return errors


def test_bad_combinations_raise_value_error():
    errors = dist_pool.run(_rank_errors, world_size=2)[0]
    assert "needs head_chunk_size" in errors["no_chunking"]
    assert "must be True or False" in errors["not_bool"]
    assert "q_proj to be a torch.nn.Linear, got Sequential" in errors["not_linear"]
    assert "SubclassedAttention may compute something else" in errors["other_class"]
    assert "use_cache=False" in errors["kv_cache"]
    assert "needs head_chunk_size" in errors["block_no_chunking"]
    assert "wq must have shape (32, 32), got (32, 33)" in errors["block_wq_shape"]
    assert "cos and sin must both be" in errors["block_cos_shape"]
    assert "both q_norm_weight and k_norm_weight" in errors["block_one_norm"]
    assert "one dtype and device" in errors["block_dtype"]
    assert "torch.autocast" in errors["block_autocast"]
    assert errors["unfused_again"] is False


def test_config_key():
    from arctic.config import SequenceParallelConfig

    ds = {"sequence_parallel_size": 2, "ulysses": {"head_chunk_size": 1, "fuse_projections": True}}
    assert SequenceParallelConfig.from_ds_config(ds).fuse_projections is True
    assert SequenceParallelConfig().fuse_projections is False
    for block, needle in (({"fuse_projections": True}, "needs ulysses.head_chunk_size"),
                          ({"head_chunk_size": 1, "fuse_projections": 1}, "true or false")):
        with pytest.raises(ValueError, match=needle):
            SequenceParallelConfig.from_ds_config({"ulysses": block})
