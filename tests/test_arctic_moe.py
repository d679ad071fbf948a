"""MoE models under sequence parallelism with the router's load-balancing loss on
(``output_router_logits=True``): the loss and gradients of one SP step against the unmodified
model on one process, whose forward adds ``router_aux_loss_coef`` times HF's loss of the
whole sequence; with the cut's padding and an attention mask's padding left out of it; under
ZeRO-3 (``arctic.initialize``) and FSDP2 (``examples/train_fsdp.py``) against single-device
training; and what is refused."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import TOL, get_mesh

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 128, 96
COEF = 0.5  # large enough that a router loss of the piece alone fails the checks
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
             router_aux_loss_coef=COEF)


def _config(family: str, router: bool = True):
    import transformers as tf

    experts = dict(num_experts_per_tok=2, output_router_logits=router)
    return {
        "mixtral": lambda: tf.MixtralConfig(**SMALL, num_local_experts=4, **experts),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32,
                                               **experts),
        "gpt_oss": lambda: tf.GptOssConfig(**SMALL, num_local_experts=4, **experts),
        # a hybrid: a gated delta net layer (arctic.hf.mixers), then an attention layer
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeTextConfig(
            **SMALL, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
            **experts),
    }[family]()


def _model(family: str, router: bool = True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family, router), attn_implementation="eager")


def _batch(length: int, masked: int):
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, length, dtype=torch.long)
    if masked:
        mask[:, -masked:] = 0
    return ids, mask


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(family: str, length: int, masked: int, router: bool = True):
    """HF's loss (LM + COEF x router loss) and gradients on one process."""
    model = _model(family, router)
    ids, mask = _batch(length, masked)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, labels=labels, attention_mask=mask if masked else None)
    out.loss.backward()
    return out.loss.item(), _grads(model)


def _rank_step(family: str, sp: int, length: int, masked: int):
    import torch.distributed as dist

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(sp, sp)
    model = apply_sequence_parallel(_model(family), mesh=mesh)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    ids, mask = _batch(length, masked)
    batch = prepare_sp_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, mesh)
    out = model(**batch, return_dict=True)
    out.loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= sp
    return out.loss.item(), _grads(model), float(out.aux_loss), "token_mask" in batch


CASES = {  # id -> (sequence length, masked tail)
    "even": (S, 0),
    "cut-padding": (S - 3, 0),      # 125 tokens: the cut pads 3 (sp 2) or 3 (sp 4)
    "attention-mask": (S, 10),      # the batch's own right padding
}


@pytest.mark.parametrize("family,sp,case", [
    pytest.param("mixtral", 2, "even", marks=pytest.mark.hf_facing),
    ("qwen3_moe", 2, "even"), ("gpt_oss", 2, "even"),
    pytest.param("mixtral", 4, "even", marks=pytest.mark.slow),
    ("qwen3_moe", 2, "cut-padding"), ("mixtral", 4, "attention-mask")])
def test_router_loss_over_the_group_matches_single_device(family, sp, case):
    length, masked = CASES[case]
    ref_loss, ref_grads = _reference(family, length, masked)
    off = _reference(family, length, masked, router=False)
    for loss, grads, aux, token_mask in dist_pool.run(_rank_step, family, sp, length, masked,
                                                      world_size=sp):
        assert token_mask == (case != "even")
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")
    # the router loss changes the result: a run without it would fail the checks above
    worst = max((ref_grads[n] - off[1][n]).abs().max().item() for n in ref_grads if n in off[1])
    assert worst > 100 * TOL[torch.float32]["atol"] and abs(ref_loss - off[0]) > 1e-3


def _rank_refusals():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralForCausalLM

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    mesh = get_mesh(2, 2)
    group = flat_mesh(mesh, "sp").get_group()
    ids, mask = _batch(S, 0)
    batch = prepare_sp_batch({"input_ids": ids}, mesh)
    got = {}

    def refused(name, call):
        try:
            call()
            got[name] = "no error"
        except ValueError as e:
            got[name] = str(e)

    # HF's own forward on the pieces would add the router loss of this rank's piece alone
    bare = apply_sequence_parallel(_model("mixtral"), mesh=mesh)
    refused("bare", lambda: bare(input_ids=batch["input_ids"],
                                 position_ids=batch["position_ids"], labels=batch["input_ids"]))

    class DoubledRouterLoss(MixtralForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.aux_loss is not None:
                out.aux_loss = out.aux_loss * 2
            return out

    torch.manual_seed(0)
    doubled = DoubledRouterLoss(_config("mixtral"))
    refused("another router loss",
            lambda: apply_sp_loss(apply_sequence_parallel(doubled, mesh=mesh), group=group))
    dense = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SMALL.items()
                                            if k != "router_aux_loss_coef"}))
    apply_sp_loss(apply_sequence_parallel(dense, mesh=mesh), group=group)
    # a model without a router: the flag adds nothing, as in HF's forward
    got["dense"] = (dense(**batch, output_router_logits=True).item(), dense(**batch).item())
    return got


def test_router_loss_the_sp_loss_cannot_give_is_refused():
    for got in dist_pool.run(_rank_refusals, world_size=2):
        assert "Use arctic.apply_sp_loss" in got["bare"], got["bare"]
        assert "is not HF's load-balancing loss" in got["another router loss"], got
        with_flag, without = got["dense"]
        assert with_flag == without


# --- under ZeRO-3 (arctic.initialize) and FSDP2 (examples/train_fsdp.py) ---------------------

def _ds_config(extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
            "ulysses": {"loss_tiles": 3, **extra}}


def _rank_zero3(family: str, extra: dict):
    from deepspeed.utils import safe_get_full_grad

    import arctic.train.deepspeed
    from arctic.data.batch import prepare_sp_batch
    from helpers import init_deepspeed_comm

    init_deepspeed_comm()
    engine, _, _, _ = arctic.train.deepspeed.initialize(model=_model(family), config=_ds_config(extra))
    ids, _ = _batch(S, 0)
    loss = engine(**prepare_sp_batch({"input_ids": ids}, engine.sp_mesh))
    engine.backward(loss)
    return loss.item(), {n: safe_get_full_grad(p).clone()
                         for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("family,extra", [
    pytest.param("mixtral", {"activation_checkpointing": True}, marks=pytest.mark.hf_facing),
    ("qwen3_moe", {}),
    pytest.param("qwen3_5_moe", {"activation_checkpointing": True}, marks=pytest.mark.slow)],
    ids=["mixtral-checkpointed", "qwen3_moe", "qwen3_5_moe-checkpointed"])
def test_moe_under_zero3_matches_single_device(family, extra):
    """ZeRO-3 partitions the experts' stacked weights and the router; every rank calls every
    MoE block (the experts' weights are gathered whatever the routing), so no rank waits on a
    gather another never makes. The router loss is on."""
    ref_loss, ref_grads = _reference(family, S, 0)
    for loss, grads in dist_pool.run(_rank_zero3, family, extra, world_size=2):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")


def _rank_tiled_router():
    from arctic.data.batch import prepare_sp_batch
    from arctic.recipe import apply_sp_recipe
    from arctic.config import SequenceParallelConfig

    config = SequenceParallelConfig(sequence_parallel_size=2, tiled_mlp=2)
    mesh = config.dims(2).build_mesh("cpu")
    model = _model("mixtral")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    ids, _ = _batch(S, 0)
    try:
        model(**prepare_sp_batch({"input_ids": ids}, mesh))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_tiled_moe_mlp_with_the_router_loss_is_refused():
    """The tiled MLP runs its forward without autograd (and recomputes it in backward): the
    router logits it records carry no gradient, so the router loss would not train the
    router. Refused on every rank, before the router loss's collectives."""
    for message in dist_pool.run(_rank_tiled_router, world_size=2):
        assert "router logits carry no gradient" in message, message


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow),
                                    "qwen3_moe",
                                    pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_moe_under_fsdp2_job_matches_single_device(tmp_path, family):
    """examples/train_fsdp.py on 2 ranks (SP=2, FSDP2 over both, checkpointed layers) with a
    MoE config file and the router loss on: the step-1 gradients and the losses of 3 AdamW
    steps equal single-device training."""
    import json

    from test_arctic_fsdp import GRAD_TOL, LOSS_RTOL, _train
    from test_arctic_fsdp import _reference as _job_reference

    config = _config(family).to_dict()
    config.update(vocab_size=256, output_router_logits=True)  # the byte corpus
    model_path = tmp_path / "config.json"
    model_path.write_text(json.dumps(config))
    sp = tmp_path / "sp.json"
    sp.write_text(json.dumps({"sequence_parallel_size": 2,
                              "ulysses": {"activation_checkpointing": True}}))
    steps = 3
    records, _ = _train(tmp_path, 2, ["--model", str(model_path), "--config", str(sp),
                                      "--max-steps", str(steps),
                                      "--dump-grads", str(tmp_path / "grads.pt")])
    grads = torch.load(tmp_path / "grads.pt")
    # single-device training, whose loss is the LM loss + coef x router loss
    ref_losses, ref_grads = _job_reference(1, steps, 64, model_name=str(model_path))
    losses = [records[k]["loss"] for k in range(1, steps + 1)]
    print(f"\n{family} FSDP2 SP=2 {losses}\n{' ' * len(family)} single device {ref_losses}")
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **GRAD_TOL, msg=lambda m: f"{n}: {m}")
