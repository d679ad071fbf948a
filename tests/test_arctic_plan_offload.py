"""Placement's offload accounting against a real DeepSpeed ZeRO-3 offload step.

Two gloo ranks train a tiny Llama (random weights) for one step (forward, backward, step, so
that AdamW's lazily made moments exist) under ``zero_optimization.offload_optimizer`` and,
optionally, ``offload_param``. Then each rank counts the tensors DeepSpeed keeps (each storage
once), split by where DeepSpeed puts them on a GPU machine. Here both roles are the CPU, so
the split follows DeepSpeed 0.19.8's own placement in ``runtime/zero/stage3.py``:

- host (the optimizer's ``self.device``, "cpu" under offload_optimizer):
  ``fp32_partitioned_groups_flat`` (fp32 master partition), their ``.grad`` (its fp32
  gradient), ``optimizer.state`` of those (exp_avg, exp_avg_sq; torch's AdamW adds a 4-byte
  ``step``), ``grad_partitions_flat_buffer`` (the gradient partitions, in the gradient
  accumulation dtype), and with offload_param the parameters' ``ds_tensor`` partitions (in
  ``param_groups_fp16_flat_cpu_memory``);
- device: the parameters' ``ds_tensor`` partitions without offload_param (in
  ``lp_param_buffer``), and the gradient bucket ``ipg_buckets[dtype].buffer``.

These must equal ``Placement.device_bytes(shard)`` and ``host_bytes(shard)`` exactly, with
``shard`` DeepSpeed's own ``sum(p.partition_numel())`` (each parameter padded to a multiple
of the world size; this model's sizes are even, so it is half the model), torch AdamW's
4-byte ``step`` aside.

MemTracker ("on the device side") tracks every storage created while it is active; the model,
``deepspeed.initialize`` and the step all run inside it. On a CPU the device and the host are
the same torch device, so what it holds after the step (its "current" snapshot, after the
activations were freed) is compared with device + host from the Placement: it must exceed it
by no more than the model's buffers (the rotary ``inv_freq``) and ``_SLACK`` bytes (DeepSpeed's
scalar flags, ``inf_or_nan_tracker`` and the gradient norm, and a [1, S] int64 copy of the
tokens). Its peak is not compared: it adds the step's temporaries (torch's foreach AdamW
makes one the size of the moments), which are no state.
"""

from __future__ import annotations

import gc

import pytest
import torch

import dist_pool
from arctic.memory.placement import DS_REDUCE_BUCKET_SIZE, Placement, placement_from_ds_config
from helpers import value_error_of

BUCKET = 10_000  # elements; small so that a wrong bucket size shows against the model's state
S = 32
_SLACK = 512  # bytes; see the module docstring


def _ds_config(offload_param: bool, dtype: str, cpu_adam: bool) -> dict:
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": BUCKET,
            # Below this many elements a parameter stays gathered on the device (the planner
            # does not model it); 0 so that every parameter is partitioned.
            "stage3_param_persistence_threshold": 0}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype != "fp32":
        config["bf16"] = {"enabled": True}
    if dtype == "bf16-fp32-accum":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if not cpu_adam:
        # DeepSpeedCPUAdam is a C++ op that takes ~100 s to build on first use; torch's AdamW
        # keeps the same fp32 moments (plus a scalar step), so the accounting is the same.
        config["optimizer"]["params"]["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def _rank_offload_step(config: dict) -> dict:
    import deepspeed
    from ulysses.torch_internals import step_mem_tracker
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers import init_deepspeed_comm

    init_deepspeed_comm()
    from deepspeed.utils import groups

    # A pooled worker may hold an earlier job's SP mpu in DeepSpeed's module globals; with it
    # the engine would use seq_parallel_communication_data_type for the gradient bucket
    # (tested apart, in test_sp_config_buckets_in_the_sp_comm_dtype).
    groups.mpu = None
    groups.mesh_device = None
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    ids = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(1))
    with step_mem_tracker() as mt:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        del loss
    gc.collect()
    try:
        opt = engine.optimizer
        counted: set[int] = set()

        def storages(tensors) -> int:
            total = 0
            for t in tensors:
                st = t.untyped_storage()
                if st.data_ptr() not in counted:
                    counted.add(st.data_ptr())
                    total += st.nbytes()
            return total

        params = list(engine.module.parameters())
        fp32 = opt.fp32_partitioned_groups_flat
        states = [v for f in fp32 for v in opt.optimizer.state[f].values() if torch.is_tensor(v)]
        ds_tensors = storages(p.ds_tensor for p in params)
        host = {"fp32 master": storages(fp32), "fp32 grad": storages(f.grad for f in fp32),
                "optimizer state": storages(states),
                "grad partitions": storages([opt.grad_partitions_flat_buffer])}
        device = {"grad bucket": storages(b.buffer for b in opt.ipg_buckets.values())}
        (host if opt.offload_param else device)["param partitions"] = ds_tensors
        return {"offload": (opt.offload_optimizer, opt.offload_param, opt.device == "cpu"),
                "optimizer": type(opt.optimizer).__name__, "steps": engine.global_steps,
                "moments_set": all(bool(v.abs().sum()) for v in states if v.dim()),
                "step_scalars": sum(v.nbytes for v in states if v.dim() == 0),
                "shard": sum(p.partition_numel() for p in params),
                "model": sum(p.ds_numel for p in params), "host": host, "device": device,
                "tracked": mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"],
                "buffers": sum(b.nbytes for b in engine.module.buffers())}
    finally:
        engine.destroy()


CASES = [("optimizer", "bf16"), ("optimizer+params", "bf16"), ("optimizer", "fp32"),
         ("optimizer+params", "bf16-fp32-accum")]


def _check_against_placement(offload_param: bool, dtype: str, cpu_adam: bool) -> None:
    pytest.importorskip("transformers", reason="the tiny Llama is a transformers model ([hf])")
    config = _ds_config(offload_param, dtype, cpu_adam)
    placement = placement_from_ds_config(config)
    assert placement.mode == ("optimizer+params" if offload_param else "optimizer")
    results = dist_pool.run(_rank_offload_step, config, world_size=2, timeout=240)
    for r in results:
        assert r["offload"] == (True, offload_param, True), r
        assert r["optimizer"] == ("DeepSpeedCPUAdam" if cpu_adam else "AdamW")
        assert r["steps"] == 1 and r["moments_set"], r  # the step ran and made the state
        shard = r["shard"]
        assert shard == r["model"] // 2  # every parameter's size is even: no padding
        device, host = sum(r["device"].values()), sum(r["host"].values()) - r["step_scalars"]
        assert (device, host) == (placement.device_bytes(shard), placement.host_bytes(shard)), (
            r["device"], r["host"], shard)
        extra = r["tracked"] - device - host - r["step_scalars"] - r["buffers"]
        assert 0 <= extra <= _SLACK, (r["tracked"], device, host, r["buffers"])


@pytest.mark.parametrize("mode,dtype", CASES, ids=[f"{m}-{d}" for m, d in CASES])
def test_offload_state_matches_deepspeed(mode, dtype):
    _check_against_placement(mode == "optimizer+params", dtype, cpu_adam=False)


@pytest.mark.slow
@pytest.mark.parametrize("offload_param", [False, True], ids=["optimizer", "optimizer+params"])
def test_offload_state_matches_deepspeed_cpu_adam(offload_param):
    """The same with DeepSpeedCPUAdam, the optimizer DeepSpeed uses by default (its C++ op is
    built on first use, about 100 s on two cores)."""
    _check_against_placement(offload_param, "bf16", cpu_adam=True)


# --- placement_from_ds_config -------------------------------------------------------------


def _zero(**zero) -> dict:
    return {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **zero}}


CPU = {"device": "cpu"}


def test_no_offload_is_none():
    for ds in ({}, _zero(), _zero(offload_optimizer={"device": "none"}),
               {"zero_optimization": None}):
        assert placement_from_ds_config(ds) == Placement("none")


def test_offload_param_without_offload_optimizer_is_refused():
    msg = value_error_of(lambda: placement_from_ds_config(_zero(offload_param=CPU)))
    assert "offload_param without offload_optimizer" in msg


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_nvme_is_refused(key):
    ds = _zero(**{"offload_optimizer": CPU, key: {"device": "nvme", "nvme_path": "/tmp"}})
    assert f"{key}.device='nvme'" in value_error_of(lambda: placement_from_ds_config(ds))


def test_bucket_from_the_config():
    assert placement_from_ds_config(_zero(offload_optimizer=CPU, reduce_bucket_size=1000)
                                    ).device_fixed == 2000  # bf16
    fp32 = {"zero_optimization": {"offload_optimizer": CPU, "reduce_bucket_size": 1000}}
    assert placement_from_ds_config(fp32).device_fixed == 4000
    comm = dict(_zero(offload_optimizer=CPU, reduce_bucket_size=1000),
                communication_data_type="fp32")
    assert placement_from_ds_config(comm).device_fixed == 4000
    assert placement_from_ds_config(_zero(offload_optimizer=CPU)
                                    ).device_fixed == 2 * DS_REDUCE_BUCKET_SIZE
    assert placement_from_ds_config(_zero(offload_optimizer=CPU, contiguous_gradients=False)
                                    ).device_fixed == 0


def test_per_param_bytes():
    bf16 = placement_from_ds_config(_zero(offload_optimizer=CPU, offload_param=CPU))
    assert (bf16.device_per_param, bf16.host_per_param) == (0, 20)
    opt = placement_from_ds_config(_zero(offload_optimizer=CPU))
    assert (opt.device_per_param, opt.host_per_param) == (2, 18)
    fp32 = placement_from_ds_config({"zero_optimization": {"offload_optimizer": CPU}})
    assert (fp32.device_per_param, fp32.host_per_param) == (4, 20)
    accum = dict(_zero(offload_optimizer=CPU), data_types={"grad_accum_dtype": "fp32"})
    assert placement_from_ds_config(accum).host_per_param == 20
    bad = dict(_zero(offload_optimizer=CPU), data_types={"grad_accum_dtype": "int8"})
    assert "grad_accum_dtype='int8'" in value_error_of(lambda: placement_from_ds_config(bad))
    assert "offload mode must be one of" in value_error_of(lambda: Placement("disk"))


def test_sp_config_buckets_in_the_sp_comm_dtype():
    """With sequence_parallel_size > 1 DeepSpeed's engine takes its communication dtype from
    seq_parallel_communication_data_type (default fp32): the bucket is sized in it."""
    base = {"bf16": {"enabled": True}, "sequence_parallel_size": 8,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                  "offload_optimizer": {"device": "cpu"}}}
    assert placement_from_ds_config(base).device_fixed == 4000
    bf16 = dict(base, seq_parallel_communication_data_type="bf16")
    assert placement_from_ds_config(bf16).device_fixed == 2000
    assert placement_from_ds_config(dict(base, sequence_parallel_size=1)).device_fixed == 2000
