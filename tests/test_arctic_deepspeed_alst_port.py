"""DeepSpeed's own ALST test, ported onto this package's API.

DeepSpeed 0.19.8's ``tests/unit/ulysses_alst/test_ulysses_sp_hf.py`` trains a tiny Llama two
ways on 2 ranks: (A) plain DeepSpeed, each rank the whole sample; (B) Ulysses SP=2, each rank
half of it, with the loss of each half from ``model.loss_function(shift_labels=...)``
aggregated by the loop itself (``torch.distributed.nn.functional.all_gather`` of the per-rank
losses and valid-token counts, weighted sum over the total). It compares the loss and the
first layer's ``q_proj`` weight gradient.

The port keeps the test's config, data, expected pieces, loop and aggregation, and puts ours in
place of DeepSpeed's Ulysses pieces: ``arctic.apply_sequence_parallel`` for
``UlyssesSPAttentionHF.register_with_transformers``, ``ulysses.DeepSpeedMPU(mesh)`` for its
``mpu``, ``arctic.SequenceParallelDataLoader`` for ``UlyssesSPDataLoaderAdapter``. Beside the
test's own loop runs HF's (``transformers.integrations.deepspeed.deepspeed_sp_compute_loss``:
``labels=shift_labels`` into ``model(...)``, then the same aggregation with ranks of no valid
token masked).

Where DeepSpeed's test allows stages 1 and 2 ``atol=1e-3`` ("possibly some issue with z1/z2"),
this one asks every stage for fp32 gradients within 1e-6 of the largest entry: the SP loss's
backward is exact for any use of the returned loss, and follows the engine's reduction
(:mod:`arctic.loss.reduction`), which adds the SP ranks' gradients at stages 1-2 and averages
them at stage 3. bf16 keeps the test's own gradient tolerances; its losses, which the test
asks equal bit for bit, are held to what one bf16 rounding of the logits allows
(:func:`_bf16_loss_bound`): the two runs' matrix products have other shapes, which a CPU's
kernels may add in another order (issue 56).
"""

from __future__ import annotations

import pytest
import torch

import dist_pool

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")
pytest.importorskip("deepspeed", reason="the port runs DeepSpeed")

pytestmark = pytest.mark.hf_facing

# fp32: the two runs add the same products in another order (the tokens' gradients per rank,
# then over the ranks). Each entry is a sum of at most 2 x 6 token terms; 1e-6 of the largest
# entry is ~10 fp32 ulps of it, where a wrong weighting of the ranks (the bug this catches)
# moves entries by a few percent of it.
FP32_REL = 1e-6


def _model(dtype):
    # hf-internal-testing/tiny-random-LlamaForCausalLM's shape (built here: no hub), with a
    # smaller vocabulary.
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)
    torch.manual_seed(42)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)


def _config(zero_stage, dtype):
    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": zero_stage},
        # the test's "Adam", as torch's on CPU (DeepSpeed's fused Adam needs CUDA)
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "sequence_parallel_size": 2,
        "steps_per_print": 10**6,
    }
    if dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}
    return config_dict


def _collate_fn(batch):
    input_ids, position_ids = batch[0]
    return dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                labels=input_ids.unsqueeze(0))


def _dataset():
    from torch import tensor

    input_ids = tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    return torch.utils.data.TensorDataset(input_ids, position_ids)


def _aggregate(loss, shift_labels, sp_group, sp_world_size, masked):
    """The test's differentiable weighted aggregation (``masked``: HF's, which zeroes the
    loss of a rank with no valid token)."""
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
    good_tokens = sum((shift_labels != -100).view(-1))
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens,
                                                                      group=sp_group)
    if not masked:
        total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank]
                         for rank in range(sp_world_size))
        return total_loss / sum(good_tokens_per_rank)
    losses, goods = torch.stack(losses_per_rank), torch.stack(good_tokens_per_rank)
    safe = torch.where(goods > 0, losses, torch.zeros_like(losses))
    return (safe * goods).sum() / goods.sum().clamp(min=1)


def _rank_port(zero_stage, dtype, loop):
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_grad
    from torch import tensor

    import arctic
    from helpers import init_deepspeed_comm
    from ulysses import DeepSpeedMPU, SequenceParallelDims

    init_deepspeed_comm()
    # DeepSpeed's tests start each in fresh processes; this pool's are reused, and DeepSpeed
    # keeps the last engine's mpu process-wide, which the baseline's reduction would read.
    groups.mpu = None
    config_dict = _config(zero_stage, dtype)
    ds = _dataset()

    # Part 1. Baseline: plain DeepSpeed, the whole sample on each rank
    dl_a = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=_collate_fn)
    batch_a = next(iter(dl_a))
    model_a = _model(dtype)
    model_a, _, _, _ = deepspeed.initialize(config=config_dict, model=model_a,
                                            model_parameters=model_a.parameters(), mpu=None)
    loss_a = model_a(**batch_a).loss
    model_a.backward(loss_a)
    grad_a = safe_get_full_grad(model_a.module.model.layers[0].self_attn.q_proj.weight).clone()

    # Part 2. Ulysses: ours in place of register_with_transformers and its mpu
    mesh = SequenceParallelDims(world_size=2, ulysses_degree=2).build_mesh("cpu")
    model_b = _model(dtype)
    arctic.apply_sequence_parallel(model_b, mesh=mesh)
    model_b, _, _, _ = deepspeed.initialize(config=config_dict, model=model_b,
                                            model_parameters=model_b.parameters(),
                                            mpu=DeepSpeedMPU(mesh))

    # 3. the loader (ours in place of UlyssesSPDataLoaderAdapter)
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl_b = arctic.SequenceParallelDataLoader(ds, mesh, batch_size=1, collate_fn=_collate_fn)
    batch_b = next(iter(dl_b))
    expected_batch_b = [
        {"input_ids": tensor([[1, 10, 10]]), "position_ids": tensor([[0, 1, 2]]),
         "shift_labels": tensor([[10, 10, 10]])},
        {"input_ids": tensor([[10, 2, 2]]), "position_ids": tensor([[3, 4, 5]]),
         "shift_labels": tensor([[2, 2, -100]])},
    ]
    assert set(batch_b) == set(expected_batch_b[sp_rank]), sorted(batch_b)
    for k, v in expected_batch_b[sp_rank].items():
        assert torch.equal(batch_b[k], v), (k, batch_b[k], v)

    # 4. the test's loop (or HF's), as it is
    shift_labels = batch_b["shift_labels"]
    if loop == "deepspeed":
        outputs = model_b(**batch_b)
        loss_b = model_b.module.loss_function(logits=outputs.logits, labels=None,
                                              shift_labels=shift_labels,
                                              vocab_size=model_b.module.config.vocab_size)
    else:  # transformers' deepspeed_sp_compute_loss
        inputs = dict(batch_b)
        inputs["labels"] = inputs["shift_labels"]
        loss_b = model_b(**inputs).loss
    loss_b = _aggregate(loss_b, shift_labels, sp_group, sp_world_size,
                        masked=loop == "transformers")
    model_b.backward(loss_b)
    grad_b = safe_get_full_grad(model_b.module.model.layers[0].self_attn.q_proj.weight).clone()
    assert grad_a.dtype == grad_b.dtype == torch.float32  # DeepSpeed's full-precision grads
    return loss_a.detach().float(), loss_b.detach().float(), grad_a, grad_b


@pytest.mark.parametrize("loop", ["deepspeed", "transformers"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_ulysses_sp_hf_fp32(zero_stage, loop):
    for loss_a, loss_b, grad_a, grad_b in dist_pool.run(_rank_port, zero_stage, torch.float32,
                                                        loop, world_size=2, timeout=240):
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
        bound = FP32_REL * float(grad_a.abs().max())
        worst = float((grad_b - grad_a).abs().max())
        assert worst <= bound, (f"stage {zero_stage}: q_proj gradient differs by {worst:.3g} "
                                f"(bound {bound:.3g}); norm ratio "
                                f"{float(grad_b.norm() / grad_a.norm()):.6f}")


def _plain_bf16_logits():
    """The bf16 model's logits on the loader's first sample, on one process."""
    input_ids, position_ids = _dataset()[0]
    with torch.no_grad():
        return _model(torch.bfloat16)(input_ids=input_ids[None],
                                      position_ids=position_ids[None]).logits


def _bf16_loss_bound(logits) -> float:
    """How far apart two bf16 runs of this model may put the (float32) loss: the runs may
    round a bf16 logit z to neighbouring values, one ulp (eps |z|, eps = 2^-7) apart; a target's
    cross-entropy has gradient p - onehot in its logits, of l1 norm at most 2, so the mean
    loss moves by at most 2 eps max |z|. Roundings in earlier layers reach the logits through
    lm_head (weights of std 0.02 over 16 inputs), far below that."""
    return 2 * torch.finfo(torch.bfloat16).eps * logits.abs().max().item()


def _check_bf16_loss(loss_b, loss_a, bound: float) -> None:
    diff = abs(float(loss_b) - float(loss_a))
    assert diff <= bound, f"bf16 losses {float(loss_b)} and {float(loss_a)}: {diff:.3g} apart " \
                          f"(bound {bound:.3g})"


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_ulysses_sp_hf_bf16(zero_stage):
    # DeepSpeed's test for its preferred dtype: the gradients (the float32 ones
    # safe_get_full_grad returns) at stages 1-2 with rtol=1.6e-2, atol=1e-3, at stage 3 with
    # assert_close's float32 defaults, as it asks; the losses, which it asks equal, within
    # one bf16 rounding of the logits (the module docstring).
    bound = _bf16_loss_bound(_plain_bf16_logits())
    for loss_a, loss_b, grad_a, grad_b in dist_pool.run(_rank_port, zero_stage, torch.bfloat16,
                                                        "deepspeed", world_size=2, timeout=240):
        _check_bf16_loss(loss_b, loss_a, bound)
        if zero_stage in (1, 2):
            torch.testing.assert_close(grad_b, grad_a, rtol=1.6e-2, atol=1e-3)
        else:
            torch.testing.assert_close(grad_b, grad_a)


@pytest.mark.parametrize("wrong", ["ranks averaged unweighted", "rank 0's own loss",
                                   "rank 1's own loss"])
def test_bf16_loss_check_rejects_a_wrong_aggregation(wrong):
    """The bf16 check fails the per-rank losses put together wrongly, from the plain model's
    own per-target losses (rank 0: targets 1-3, rank 1: targets 4-5, as the loader cuts);
    their right, token-weighted mean passes it."""
    import torch.nn.functional as F

    logits = _plain_bf16_logits()
    input_ids, _ = _dataset()[0]
    per_target = F.cross_entropy(logits[0, :-1].float(), input_ids[1:], reduction="none")
    plain, (l0, l1) = per_target.mean(), (per_target[:3].mean(), per_target[3:].mean())
    bound = _bf16_loss_bound(logits)
    _check_bf16_loss((3 * l0 + 2 * l1) / 5, plain, bound)
    got = {"ranks averaged unweighted": (l0 + l1) / 2, "rank 0's own loss": l0,
           "rank 1's own loss": l1}[wrong]
    with pytest.raises(AssertionError, match="apart"):
        _check_bf16_loss(got, plain, bound)
