"""offload: checkpointing with host offload is bit-identical, moves what it says, and refuses
what does not fit. Single process; the SP runs with offload are in test_arctic_engine (ZeRO-3)
and test_fsdp (FSDP2)."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch import nn

import offload
from arctic import apply_activation_checkpointing
from arctic.order import record_apply
from offload import HostBufferPool, offload_saved_activations

pytest.importorskip("transformers", reason="the layer tests use HF models ([hf])")

LAYERS, B, S, E = 3, 2, 64, 128


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=E, intermediate_size=256,
                      num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _ids(seed=1):
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def _step(model, ids):
    """One forward/backward; returns the loss, the flat gradient, and whether each layer's
    input tensor was still alive when the forward ended."""
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])))
             for layer in model.model.layers]
    loss = model(input_ids=ids, labels=ids).loss
    alive = [r() is not None for r in inputs]
    loss.backward()
    for h in hooks:
        h.remove()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return loss.detach(), grad, alive


def _offloaded_model(**kw):
    kw.setdefault("host_memory_limit", 1 << 30)
    return apply_activation_checkpointing(_model(), offload_to_cpu=True, min_offload_bytes=0,
                                          **kw)


def test_offload_is_bit_identical_to_checkpointing_and_inputs_leave_the_device():
    plain_loss, plain_grad, plain_alive = _step(_model(), _ids())
    ckpt_loss, ckpt_grad, ckpt_alive = _step(apply_activation_checkpointing(_model()), _ids())
    model = _offloaded_model()
    off_loss, off_grad, off_alive = _step(model, _ids())
    assert torch.equal(off_loss, ckpt_loss) and torch.equal(off_grad, ckpt_grad)
    torch.testing.assert_close(ckpt_grad, plain_grad, atol=1e-6, rtol=1e-5)
    assert plain_loss == ckpt_loss
    # Checkpointing alone keeps every layer's input; with offload none stays on the device.
    assert plain_alive == ckpt_alive == [True] * LAYERS
    assert off_alive == [False] * LAYERS
    stats = model.activation_offload.pool.stats
    hidden = B * S * E * 4
    shared = 2 * (B * S * (E // 8) * 4 // B) + S * 8  # RoPE cos/sin [1, S, 16], position ids
    assert stats.bytes_offloaded == LAYERS * hidden + shared
    assert stats.peak_host_bytes == stats.bytes_offloaded  # all held at the end of forward
    assert stats.host_bytes == 0  # every buffer back in the pool after backward


def test_prefetch_runs_one_layer_ahead_and_buffers_are_reused():
    model = _offloaded_model()
    stats = lambda: model.activation_offload.pool.stats  # noqa: E731 (reset_stats replaces it)
    seen = []  # (layer, prefetches so far) at each attention call inside backward
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, stats().prefetches)) if in_backward else None)
    in_backward = False
    loss = model(input_ids=_ids(), labels=_ids()).loss
    in_backward = True
    loss.backward()
    # A group is a layer's 4 saved inputs (hidden, cos, sin, position ids). Layer i's
    # recompute finds layer i-1's copy back already started; layer 0 has none before it.
    per_group = 4
    assert seen == [(2, per_group), (1, 2 * per_group), (0, 2 * per_group)]
    reserved = stats().reserved_bytes
    model.activation_offload.pool.reset_stats()
    in_backward = False
    model(input_ids=_ids(2), labels=_ids(2)).loss.backward()
    assert stats().reserved_bytes == reserved  # the second step reused the first's buffers
    assert stats().bytes_offloaded > 0 and stats().host_bytes == 0


def test_without_prefetch_each_layer_comes_back_when_needed_and_bits_hold():
    """prefetch=False: no copy back starts a layer ahead (each layer's inputs come back as its
    recompute unpacks them), with the same bytes restored and bit-identical gradients."""
    ahead = _offloaded_model()
    ref_loss, ref_grad, _ = _step(ahead, _ids())
    model = _offloaded_model(prefetch=False)
    assert model.activation_offload.prefetch is False
    stats = lambda: model.activation_offload.pool.stats  # noqa: E731
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, a: seen.append(stats().prefetches) if torch.is_grad_enabled() else None)
    loss, grad, _ = _step(model, _ids())
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert len(seen) == 2 * LAYERS and set(seen) == {0}  # forward, then each recompute
    assert stats().prefetches == 0
    assert stats().bytes_restored == ahead.activation_offload.pool.stats.bytes_restored > 0
    for bad, match in [(dict(prefetch=False, offload_to_cpu=False), "needs offload_to_cpu"),
                       (dict(prefetch=0), "must be True or False")]:
        with pytest.raises(ValueError, match=match):
            apply_activation_checkpointing(_model(), **bad)


def test_host_limit_is_refused_before_the_first_layer_runs():
    model = _offloaded_model(host_memory_limit=B * S * E * 4 * 2)  # room for 2 of 3 layers
    ran = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: ran.append(1))
    with pytest.raises(ValueError, match=r"offloading the inputs of 3 checkpointed layers needs "
                                         r"0\.00 GiB of host memory per rank, more than"):
        model(input_ids=_ids(), labels=_ids())
    assert ran == []
    with torch.no_grad():  # nothing is saved in eval, so nothing is refused
        model(input_ids=_ids(), labels=_ids())


def test_pool_refuses_past_its_limit_and_reports():
    pool = HostBufferPool(limit_bytes=3000)
    x = torch.randn(500, requires_grad=True) * 1  # 2000 bytes, not a leaf
    with offload_saved_activations(pool, min_bytes=0):
        y = x.sin()
        with pytest.raises(ValueError, match="over its limit"):
            y.cos()
    assert pool.stats.bytes_offloaded == 2000 and pool.stats.reserved_bytes == 2000
    with pytest.raises(ValueError, match="limit_bytes must be positive"):
        HostBufferPool(limit_bytes=0)


def test_offload_context_matches_plain_autograd_for_any_block():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 32, 64, requires_grad=True)

    def grads(offload):
        with (offload_saved_activations(pool, min_bytes=4096) if offload else
              torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
            # a permuted (non-contiguous, dense) activation: its layout must come back as is
            out = net(x).transpose(0, 1).exp().sum()
        out.backward(retain_graph=True)
        first = [t.grad.clone() for t in (x, *net.parameters())]
        for t in (x, *net.parameters()):
            t.grad = None
        out.backward()  # retain_graph: host copies must survive the first backward
        second = [t.grad.clone() for t in (x, *net.parameters())]
        for t in (x, *net.parameters()):
            t.grad = None
        return first, second

    pool = HostBufferPool(limit_bytes=1 << 30)
    ref, _ = grads(False)
    first, second = grads(True)
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b)
    # Saved: the 256-wide hidden twice (GELU's input, Linear 2's input) and the exp output.
    # x and the weights (saved as weight.t()) are leaves that need a gradient and stay.
    assert pool.stats.bytes_offloaded == 8 * 32 * 256 * 4 * 2 + 8 * 32 * 64 * 4
    assert pool.stats.host_bytes == 0


def test_apply_order_and_double_checkpointing_are_refused():
    from arctic.tiling.mlp import apply_tiled_mlp

    model = apply_activation_checkpointing(_model())
    with pytest.raises(ValueError, match="tiling to LlamaForCausalLM: checkpointing is already "
                                         "applied"):
        apply_tiled_mlp(model, tiles=2)
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_checkpointing(model)
    hf = _model()
    hf.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="HF gradient checkpointing is already enabled"):
        apply_activation_checkpointing(hf)
    with pytest.raises(ValueError, match="stage must be one of"):
        record_apply(hf, "offload")
    with pytest.raises(ValueError, match="no decoder layer"):
        apply_activation_checkpointing(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layers is empty"):  # offload is given the layers
        offload.apply_activation_checkpointing(nn.Linear(2, 2), layers=[])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_is_bit_identical_and_lowers_max_memory_allocated():
    """On a GPU: the side-stream copies give the same loss and gradients bit for bit; the
    device memory held from forward to backward falls by the offloaded layer inputs, and so
    does the step's peak. Memory is counted from the step's start (``memory_allocated`` then),
    since models built earlier in the process may leave cached or cyclic garbage behind."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    ids = torch.randint(0, 256, (2, 4096), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))

    def run(offload: bool, deterministic: bool):
        # Deterministic kernels (the math SDPA kernel, embedding backward without atomics):
        # otherwise two runs of the same code differ in the last bits, and bit-identity would
        # test nothing. cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 for it (set if unset).
        if not deterministic:
            return step(offload)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        try:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                return step(offload)
        finally:
            torch.use_deterministic_algorithms(False)

    def step(offload: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda()
        apply_activation_checkpointing(model, offload_to_cpu=offload,
                                       host_memory_limit=1 << 32 if offload else None)
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up: kernels, host buffers
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        del model
        gc.collect()
        torch.cuda.empty_cache()
        return loss.detach(), grad, held, peak

    loss0, grad0, _, _ = run(False, deterministic=True)
    again = run(False, deterministic=True)
    loss1, grad1, _, _ = run(True, deterministic=True)
    assert torch.equal(loss0, again[0]) and torch.equal(grad0, again[1])  # deterministic
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    # Memory with the default (fused) kernels, as training runs.
    _, _, held0, peak0 = run(False, deterministic=False)
    _, _, held1, peak1 = run(True, deterministic=False)
    hidden = 2 * 4096 * 512 * 4  # one layer input, fp32
    print(f"\ncuda, above the step's start: held after forward {held0 / 2**20:.1f} -> "
          f"{held1 / 2**20:.1f} MiB, step peak {peak0 / 2**20:.1f} -> {peak1 / 2**20:.1f} MiB "
          f"with offload")
    # After forward every layer input is on the host (the last one is still the output's
    # input when the loss is computed from it, so at least L - 1 have left).
    assert held0 - held1 >= (cfg.num_hidden_layers - 1) * hidden
    # At the peak (the last layer's backward) the earlier layers' inputs are not on the device,
    # except the one prefetched.
    assert peak1 < peak0
