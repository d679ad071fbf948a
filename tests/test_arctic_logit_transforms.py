"""The tiled SP loss honours what a causal-LM head does to its logits, or refuses the model.

Granite divides the logits by ``logits_scaling``, Cohere multiplies them by ``logit_scale``,
Gemma 2 caps them with ``final_logit_softcapping``. ``apply_sp_loss`` must train on the same
loss as HF's own ``model(labels=...)``, or raise ``ValueError`` for a head it cannot
reproduce. Single process (``group=None``), CPU, float32, tiny models from configs.

Tolerances (float32): the loss within 1e-5 relative, every parameter gradient within
atol 2e-5, rtol 1e-4 (``helpers.TOL``): HF takes log_softmax of the whole logits, the tiled
loss per tile, with the transform folded into one multiply.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from arctic.loss.transform import LogitTransform, find_logit_transform
from arctic.loss.head import apply_sp_loss
from arctic.loss.tiled import tiled_logits_loss
from helpers import TOL

transformers = pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB, HIDDEN = 64, 128, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             # Logits of a few units (0.02 gives ~0.1): the transforms change the loss a lot.
             initializer_range=0.3)
FAMILIES = {  # name: (config class, extra config, the transform the probe must find)
    "llama": ("LlamaConfig", {}, LogitTransform()),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0), LogitTransform(scale=0.25)),
    "cohere": ("CohereConfig", dict(logit_scale=0.25), LogitTransform(scale=0.25)),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=2.0, query_pre_attn_scalar=16),
               LogitTransform(softcap=2.0)),
    # hidden states divided by logits_scaling = hidden_size / dim_model_base before the head
    "minicpm3": ("MiniCPM3Config", dict(dim_model_base=16, num_key_value_heads=4, q_lora_rank=32,
                                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                       v_head_dim=16), LogitTransform(scale=0.25)),
}


def _model(name: str, **extra):
    from transformers import AutoModelForCausalLM

    cls, cfg_extra, _ = FAMILIES[name]
    cfg = getattr(transformers, cls)(**{**SMALL, **cfg_extra, **extra})
    torch.manual_seed(0)
    # Gemma 2's attention softcap needs eager; the others keep HF's default.
    attn = "eager" if name == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, S), generator=g)
    labels = ids.clone()
    labels[:, 5:9] = -100
    # arctic.data.prepare_sp_batch on one rank: labels moved left, -100 at the end.
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]
    return ids, labels, torch.arange(S).unsqueeze(0), shift


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.hf_facing
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sp_loss_equals_hf_loss(name):
    ids, labels, positions, shift = _batch()
    model = _model(name)
    ref_model = copy.deepcopy(model)
    ref = ref_model(input_ids=ids, labels=labels).loss
    ref.backward()

    apply_sp_loss(model, group=None, loss_tiles=3)
    head_forward = model.get_output_embeddings().forward
    assert head_forward.transform == FAMILIES[name][2]
    loss = model(input_ids=ids, position_ids=positions, shift_labels=shift)
    loss.backward()
    rel = abs(loss.item() - ref.item()) / abs(ref.item())
    print(f"\n{name}: loss {loss.item():.6f} vs HF {ref.item():.6f} (rel {rel:.1e})", end="")
    assert rel <= 1e-5
    want = _grads(ref_model)
    got = _grads(model)
    assert got.keys() == want.keys()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    largest = max(float(want[n].abs().max()) for n in want)
    print(f", max |grad diff| {worst:.1e} (max |grad| {largest:.1e})", end="")
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL[torch.float32], msg=n)

    if FAMILIES[name][2] != LogitTransform():
        # The transform matters here: without it the loss is not HF's (so this test can fail).
        head_forward.transform = LogitTransform()
        with torch.no_grad():
            off = model(input_ids=ids, position_ids=positions, shift_labels=shift)
        off_rel = abs(off.item() - ref.item()) / abs(ref.item())
        print(f", transform off: rel {off_rel:.1e}", end="")
        assert off_rel > 1e-3, (off, ref)


def _reference_loss(h, w, labels, scale, softcap):
    """float64 autograd through the same math: CE(softcap(scale * h @ w^T))."""
    z = (h.double() @ w.double().t()) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.25, None), (-3.0, None),
                                           (1.0, 2.0), (0.5, 1.5), (-2.0, 4.0)])
@pytest.mark.parametrize("tiles", [1, 4])
def test_tiled_loss_gradients_through_the_transform(scale, softcap, tiles):
    g = torch.Generator().manual_seed(0)
    N, E, V = 97, 16, 40
    h = torch.randn(N, E, generator=g, requires_grad=True)
    w = torch.randn(V, E, generator=g).requires_grad_()  # logits ~ 4: a cap of 1.5-4 bites
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _reference_loss(hd, wd, labels, scale, softcap)
    ref.backward()

    loss, n = tiled_logits_loss(h.unsqueeze(0), w, labels.unsqueeze(0), tiles=tiles,
                                logit_scale=scale, logit_softcap=softcap)
    (loss * 0.5).backward()  # a non-unit upstream gradient
    assert int(n) == int((labels != -100).sum())
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad.double(), 0.5 * hd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), 0.5 * wd.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale,softcap", [(0.0, None), (float("inf"), None),
                                           (float("nan"), None), (True, None), ("2", None),
                                           (1.0, 0.0), (1.0, -1.0), (1.0, float("inf"))])
def test_bad_transforms_are_refused(scale, softcap):
    with pytest.raises(ValueError, match="logit_s"):
        LogitTransform(scale=scale, softcap=softcap)
    h, w, y = torch.randn(1, 4, 8), torch.randn(10, 8), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="logit_s"):
        tiled_logits_loss(h, w, y, tiles=1, logit_scale=scale, logit_softcap=softcap)


def test_tiled_loss_with_a_softcap_traces_under_fake_tensors():
    """The memory planner traces the step under FakeTensorMode: no data-dependent op."""
    with FakeTensorMode():
        h = torch.randn(1, 64, 16, requires_grad=True)
        w = torch.randn(50, 16, requires_grad=True)
        loss, _ = tiled_logits_loss(h, w, torch.zeros(1, 64, dtype=torch.long), tiles=4,
                                    logit_scale=0.5, logit_softcap=3.0)
        loss.backward()
        assert h.grad.shape == h.shape and w.grad.shape == w.shape


# --- refusals --------------------------------------------------------------------------------

def _llama_subclass(forward):
    from transformers import LlamaConfig, LlamaForCausalLM

    cls = type("Custom", (LlamaForCausalLM,), {"forward": forward})
    torch.manual_seed(0)
    return cls(LlamaConfig(**SMALL))


def test_refuses_an_unknown_logit_transform():
    def forward(self, *args, **kwargs):  # doubles the logits, with no config key saying so
        out = super(type(self), self).forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model = _llama_subclass(forward)
    with pytest.raises(ValueError, match="Custom.forward transforms the lm_head's logits"):
        apply_sp_loss(model, group=None, loss_tiles=3)
    assert "forward" not in model.__dict__  # refused: the model is unchanged


def test_refuses_a_hidden_state_transform_before_the_head():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden * 0.5))

    with pytest.raises(ValueError, match="does not pass its base model's last_hidden_state"):
        apply_sp_loss(_llama_subclass(forward), group=None, loss_tiles=3)


def test_refuses_a_head_it_cannot_verify():
    def forward(self, *args, **kwargs):
        raise RuntimeError("custom head")

    with pytest.raises(ValueError, match="could not verify.*custom head"):
        apply_sp_loss(_llama_subclass(forward), group=None, loss_tiles=3)


def test_refuses_a_head_with_bias():
    model = _llama_subclass(transformers.LlamaForCausalLM.forward)
    model.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias"):
        apply_sp_loss(model, group=None, loss_tiles=3)


@pytest.mark.parametrize("cls", ["MixtralConfig", "Qwen3MoeConfig"])
def test_router_logits_are_honoured(cls):
    """output_router_logits=True: the SP loss adds the router loss, as the model's forward
    does (tests/test_arctic_moe.py); the probe reads its experts, top-k and weight from the
    class's forward on meta weights."""
    from transformers import AutoModelForCausalLM

    from arctic.loss.router import RouterLoss

    cfg = getattr(transformers, cls)(**SMALL, num_local_experts=4, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     output_router_logits=True, router_aux_loss_coef=0.25)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    apply_sp_loss(model, group=None, loss_tiles=3)
    assert model.forward.router == RouterLoss(num_experts=4, top_k=2, coef=0.25)
    assert find_logit_transform(model) == LogitTransform()


# --- the probe reads no weight, runs no hook, leaves the RNG alone ---------------------------

def test_probe_skips_hooks_and_keeps_the_rng():
    """apply_sequence_parallel's batch hook on the base model all-gathers position ids: the
    probe must not run it (nor FSDP/ZeRO-3 hooks), and must restore it."""
    model = _model("granite")
    calls = []
    handle = model.base_model.register_forward_pre_hook(lambda m, a: calls.append(1))
    rng = torch.get_rng_state()
    assert find_logit_transform(model) == LogitTransform(scale=0.25)
    assert calls == [] and torch.equal(torch.get_rng_state(), rng)
    assert "forward" not in model.base_model.__dict__
    assert "forward" not in model.lm_head.__dict__
    model.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    assert calls == [1]  # the hook is back
    handle.remove()


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_probe_on_meta_and_fake_weights(where):
    """ZeRO-3, meta-device and FakeTensorMode (the planner, arctic/plan) models hold no
    weight values; the probe runs on real CPU tensors and still finds the softcap."""
    from transformers import AutoModelForCausalLM

    cfg = transformers.Gemma2Config(**SMALL, final_logit_softcapping=2.0)
    if where == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        assert find_logit_transform(model) == LogitTransform(softcap=2.0)
        return
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        apply_sp_loss(model, group=None, loss_tiles=2)
        assert model.lm_head.forward.transform == LogitTransform(softcap=2.0)
