"""A script of one's own around deepspeed.initialize.

A user's own loss (a plain mean over this rank's tokens, backpropagated as it is) gets the
same gradients at ZeRO 0, 1, 2 and 3: single-device training's when the ranks hold equal
numbers of labels: on docs/engine.md's path (apply_sequence_parallel, then
deepspeed.initialize with DeepSpeedMPU), where the model returns its logits, and under
arctic.initialize with "loss_tiles": null (no SP loss; by default the forward is the SP loss,
whose gradients are single-device training's at every stage: tests/test_arctic_engine.py).

HF's gradient_checkpointing_enable() before arctic.initialize is refused, naming the call and
the config key that replaces it."""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh, value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

S, VOCAB = 32, 128


def _model():
    from test_arctic_engine import _model as model

    return model()


def _labels(dp: int) -> torch.Tensor:
    """dp replica ``dp``'s tokens; the label of position 1 is masked, so that with the end of
    the sequence masked too each half holds S/2 - 1 targets (equal counts on SP=2)."""
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(10 + dp))
    labels = ids.clone()
    labels[0, 1] = -100
    return ids, labels


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "sequence_parallel_size": 2}


def _reference(dps: int) -> dict:
    """Single-device gradients: the mean over the dp replicas of HF's own token-mean loss."""
    model = _model()
    for dp in range(dps):
        ids, labels = _labels(dp)
        (model(input_ids=ids, labels=labels).loss / dps).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rank_own_loss(stage: int, world: int, path: str = "engine_md"):
    import deepspeed
    import torch.nn.functional as F
    from deepspeed.utils import safe_get_full_grad

    import arctic
    from helpers import init_deepspeed_comm
    from ulysses import DeepSpeedMPU

    init_deepspeed_comm()
    model = _model()
    if path == "initialize":  # "loss_tiles": null: the forward returns the logits
        engine, *_ = arctic.initialize(model=model, config=dict(
            _config(stage), ulysses={"loss_tiles": None}))
        mesh = engine.sp_mesh
    else:
        mesh = get_mesh(world, 2)
        arctic.apply_sequence_parallel(model, mesh=mesh)
        engine, *_ = deepspeed.initialize(model=model, config=_config(stage),
                                          model_parameters=model.parameters(),
                                          mpu=DeepSpeedMPU(mesh))
    ids, labels = _labels(mesh.get_local_rank("dp"))
    batch = arctic.prepare_sp_batch({"input_ids": ids, "labels": labels}, mesh)
    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    targets = batch["shift_labels"].reshape(-1)
    assert int(targets.ne(-100).sum()) == S // 2 - 1  # equal counts on both SP ranks
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets, ignore_index=-100)
    engine.backward(loss)
    return {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}


def _cases():
    """Every stage on both paths and at dp2 x SP2; the default run keeps each path at a stage
    that adds the SP ranks' gradients (2) and one that averages them (3 on the engine path;
    arctic.initialize pins stage 3 to adding)."""
    default = {("engine_md", 2, 2), ("engine_md", 3, 2), ("initialize", 2, 2),
               ("initialize", 3, 2)}
    for path in ("engine_md", "initialize"):
        for stage, world in ((0, 2), (1, 2), (2, 2), (3, 2), (0, 4), (1, 4), (2, 4), (3, 4)):
            yield pytest.param(stage, world, path, id=f"{path}-zero{stage}-w{world}",
                               marks=[] if (path, stage, world) in default else
                               [pytest.mark.slow])


@pytest.mark.parametrize("stage,world,path", list(_cases()))
def test_a_plain_local_mean_gets_single_device_gradients(stage, world, path):
    reference = _reference(world // 2)
    for grads in dist_pool.run(_rank_own_loss, stage, world, path, world_size=world):
        num = sum(float((grads[n] - r).pow(2).sum()) for n, r in reference.items()) ** 0.5
        norm = sum(float(r.pow(2).sum()) for r in reference.values()) ** 0.5
        got = sum(float(grads[n].pow(2).sum()) for n in reference) ** 0.5
        assert abs(got / norm - 1) < 1e-5, (got, norm)  # not sp times too large
        assert num <= 1e-5 * norm, (num, norm)


def _rank_hf_checkpointing():
    import arctic.train.deepspeed
    from helpers import init_deepspeed_comm
    from test_arctic_engine import _config, _model

    init_deepspeed_comm()
    model = _model()
    model.gradient_checkpointing_enable()
    return value_error_of(lambda: arctic.train.deepspeed.initialize(
        model=model, config=_config(0, {"activation_checkpointing": True})))


def test_hf_gradient_checkpointing_before_initialize_is_refused_naming_both():
    """A hand-written script's model.gradient_checkpointing_enable() before arctic.initialize:
    refused on every rank, naming the call and the config key that replaces it."""
    for msg in dist_pool.run(_rank_hf_checkpointing, world_size=2):
        assert "gradient_checkpointing_enable()" in msg and "gradient_checkpointing_disable()" \
            in msg and '"activation_checkpointing": true' in msg, msg


def _rank_meter():
    import time

    import torch.distributed as dist

    import arctic
    from arctic.memory import peak_memory_mib

    meter = arctic.StepMeter(tokens_per_step=1000, device="cpu")
    early = value_error_of(meter.stats)
    with meter:
        time.sleep(0.05 * (1 + dist.get_rank()))
    stats = meter.stats()
    return early, stats, peak_memory_mib("cpu"), value_error_of(
        lambda: arctic.StepMeter(tokens_per_step=0, device="cpu"))


def test_step_meter_gives_tokens_per_second_and_every_rank_s_peak():
    """The public helper behind the examples' progress line: the step's time and tokens/s,
    and each rank's peak in rank order."""
    results = dist_pool.run(_rank_meter, world_size=2)
    for rank, (early, stats, own_peak, bad) in enumerate(results):
        assert "before any step" in early and "positive int" in bad
        assert 0.05 * (1 + rank) <= stats["step_s"] < 5
        assert stats["tokens_per_s"] == pytest.approx(1000 / stats["step_s"])
        assert len(stats["peak_mib"]) == 2 and all(p > 0 for p in stats["peak_mib"])
        assert stats["peak_mib"][rank] <= round(own_peak, 1) + 0.1  # this rank's own
