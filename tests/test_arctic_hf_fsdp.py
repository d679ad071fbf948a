"""SequenceParallelTrainer under FSDP2 (``TrainingArguments(fsdp=..., fsdp_config={"version":
2})``, the SP settings as ``sp_config=``) on 2 ranks, launched with torchrun, against the
plain single-process Trainer on the same data; and every FSDP setting honoured or refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

from test_arctic_hf_trainer import (ACCUMULATE, REPO, SCRIPT, _check_metrics,  # noqa: E402
                                    _check_parameters, _check_the_trained_models,
                                    _sp_and_plain)

SP_JSON = str(REPO / "configs" / "cpu_trainer_fsdp.json")
NO_CHECKPOINTING = {"sequence_parallel_size": 2, "ulysses": {"tiled_mlp": "auto"}}
CASES = {  # id -> (the run's arguments, the plain run's, loss tolerance)
    # AdamW with clipping at 1.0 (on the sharded gradients), batches of 2, metrics; SP
    # settings without checkpointing, which fsdp_config's activation_checkpointing turns on
    "adamw-metrics": (["--optim", "adamw_torch", "--metrics", "--batch-size", "2",
                       "--fsdp-config", '{"activation_checkpointing": true}'],
                      ["--optim", "adamw_torch", "--metrics", "--batch-size", "2"], 1e-5),
    # uneven micro-batches, reduce-scatter deferred over them, layers kept gathered between
    # forward and backward, state on the host; checkpointing from fsdp_config as well
    "accumulation-shard_grad_op-offload": (ACCUMULATE + [
        "--fsdp-options", "shard_grad_op offload",
        "--fsdp-config", '{"activation_checkpointing": true}'], ACCUMULATE, 1e-6),
    # FSDP2's mixed precision against the plain Trainer's autocast: bf16 rounding apart; the
    # SP settings given as a SequenceParallelConfig; 512 tokens, so that a layer input in bf16
    # (256 x 128 x 2 bytes per rank) is large enough to be offloaded
    "bf16": (["--bf16", "--sp-config-object", "--seq-len", "512"], ["--bf16", "--seq-len", "512"],
             2e-3),
}


def _torchrun(*args: str, sp_json: str = SP_JSON) -> list[str]:
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", SCRIPT,
            "--fsdp", sp_json, *args]


@pytest.mark.parametrize("case", [
    pytest.param("adamw-metrics", marks=pytest.mark.slow),
    pytest.param("accumulation-shard_grad_op-offload", marks=pytest.mark.hf_facing),
    pytest.param("bf16", marks=pytest.mark.slow)])
def test_fsdp2_trainer_matches_plain_trainer(tmp_path, case):
    args, plain_args, rel = CASES[case]
    sp_json = SP_JSON
    if "--fsdp-config" in args:
        sp_json = str(tmp_path / "sp.json")
        Path(sp_json).write_text(json.dumps(NO_CHECKPOINTING))
    sp, plain = _sp_and_plain(tmp_path, _torchrun(*args, sp_json=sp_json), plain_args)
    print(f"\n{case}: plain {plain['loss']} eval {plain['eval_loss']}\n"
          f"{' ' * len(case)}  FSDP2 SP=2 {sp['loss']} eval {sp['eval_loss']}")
    # sharded by FSDP2 (two decoder layers, the embedding, the lm_head, the final norm and the
    # root), trained
    # through the wrapper that
    # keeps accelerate from wrapping it in DDP; accelerate installed nothing of DeepSpeed's
    assert sp["fsdp_units"] == 6 and sp["trained_through"] == "ShardedModel"
    assert plain["fsdp_units"] == 0 and sp["deepspeed_sp_installed"] is False
    assert sp["tiled_mlp"] and sp["checkpointed"]  # the SP settings' ulysses block
    assert (sp["offloaded_bytes"] > 0) == (sp_json == SP_JSON)  # offload where it says so
    assert sp["global_step"] == plain["global_step"]
    assert sp["loss"] == pytest.approx(plain["loss"], rel=rel, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=rel, abs=0)
    if case == "bf16":
        assert sp["fsdp_param_dtype"] == "torch.bfloat16"
        return
    assert sp["fsdp_param_dtype"] == "torch.float32"
    reshard = "shard_grad_op" not in " ".join(args)
    assert sp["fsdp_reshard"] is reshard
    assert sp["fsdp_offload"] == ("CPUOffloadPolicy" if "--fsdp-options" in args
                                  else "OffloadPolicy")
    if "--metrics" in args:
        _check_metrics(sp, plain)
    # after train() the model runs whole sequences and generates; save_model gathered the
    # full state, which from_pretrained loads
    _check_the_trained_models(sp, plain)
    _check_parameters(sp, plain, 1e-5)


def _args(tmp_path, **fields):
    from transformers import TrainingArguments

    fields = {"save_strategy": "no", "fsdp": "full_shard", "fsdp_config": {"version": 2},
              **fields}
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)


def _refusal(args, model=None, **kwargs) -> str:
    from arctic.train.trainer import SequenceParallelTrainer

    with pytest.raises(ValueError) as e:
        SequenceParallelTrainer(model=model, args=args, **kwargs)
    return str(e.value)


REFUSED = {  # TrainingArguments fields (or, after construction, attributes) -> the message
    "version 1": ({"fsdp_config": {"version": 1}}, "only FSDP2"),
    "size policy": ({"fsdp_config": {"version": 2, "auto_wrap_policy": "SIZE_BASED_WRAP",
                                     "min_num_params": 10}}, "each decoder layer is one"),
    "sharded state dict": ({"fsdp_config": {"version": 2,
                                            "state_dict_type": "SHARDED_STATE_DICT"}},
                           "FULL_STATE_DICT"),
    "ram-efficient loading": ({"fsdp_config": {"version": 2,
                                               "cpu_ram_efficient_loading": True}},
                              "cpu_ram_efficient_loading"),
    "checkpoints on each node": ({"save_strategy": "steps", "save_on_each_node": True},
                                 "save_on_each_node"),
    "best model from weights only": ({"save_strategy": "steps", "eval_strategy": "steps",
                                      "save_only_model": True, "load_best_model_at_end": True},
                                     "save_only_model=True with load_best_model_at_end"),
    "xla": ({"fsdp_config": {"version": 2, "xla": True}}, "XLA"),
}
SET_AFTER = {  # fields TrainingArguments checks itself on this machine: set afterwards
    "fp16": (True, "sharded gradient scaler"), "bf16_full_eval": (True, "bf16_full_eval"),
    "deepspeed": (str(REPO / "configs" / "cpu_trainer.json"), "give one of them"),
    "fsdp_plugin_args": ({"fsdp_version": 2, "sync_module_states": True},
                         "['sync_module_states']"),
}


def test_fsdp_settings_are_honoured_or_refused(tmp_path, monkeypatch):
    """Each FSDP setting the trainer cannot give is refused at construction, naming it (the
    honoured ones run in test_fsdp2_trainer_matches_plain_trainer)."""
    for name, (fields, needle) in REFUSED.items():
        message = _refusal(_args(tmp_path, **fields), sp_config=SP_JSON)
        assert needle in message and "FSDP2" in message, (name, message)
    for field, (value, needle) in SET_AFTER.items():
        args = _args(tmp_path)
        setattr(args, field, value)
        assert needle in _refusal(args, sp_config=SP_JSON), field
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "accelerate would shard the model again" in _refusal(_args(tmp_path),
                                                                 sp_config=SP_JSON)


def test_sp_config_is_read_once_and_only_its_sp_keys(tmp_path):
    from arctic.config import SequenceParallelConfig

    plain = _args(tmp_path, fsdp="", fsdp_config=None)
    assert "or trains under FSDP2" in _refusal(plain)
    ds = _args(tmp_path, fsdp="", fsdp_config=None)
    ds.deepspeed = str(REPO / "configs" / "cpu_trainer.json")
    assert "not both" in _refusal(ds, sp_config=SP_JSON, model=torch.nn.Linear(1, 1))
    message = _refusal(_args(tmp_path), model=torch.nn.Linear(1, 1),
                       sp_config={"sequence_parallel_size": 2, "zero_optimization": {}})
    assert "['zero_optimization']" in message
    # a SequenceParallelConfig whose size does not divide the world (1 process here)
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        from arctic.train.trainer import SequenceParallelTrainer
        SequenceParallelTrainer(model=torch.nn.Linear(1, 1), args=_args(tmp_path),
                                sp_config=SequenceParallelConfig(sequence_parallel_size=2))


def test_the_wrapped_layer_class_must_be_the_decoder_layer():
    """fsdp_config's transformer_layer_cls_to_wrap names the FSDP units: only the model's
    decoder layer class is honoured (the units are its layers), anything else is refused
    before any sharding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from arctic.train.hf_fsdp import FsdpSettings, shard

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    settings = FsdpSettings(reshard_after_forward=True, cpu_offload=False,
                            activation_checkpointing=False, layer_classes=("MistralDecoderLayer",),
                            bf16=False)
    with pytest.raises(ValueError, match=r"\['LlamaDecoderLayer'\]; name those"):
        shard(model, None, settings)


@pytest.mark.slow
def test_accelerate_launch_with_the_fsdp2_yaml_runs_the_trainer(tmp_path):
    """``accelerate launch --config_file configs/accelerate_fsdp2_cpu_2proc.yaml
    examples/hf_trainer.py --fsdp ...``: accelerate only launches (its YAML sets no FSDP
    plugin, which would shard again), the trainer shards; the plain Trainer's losses."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    config = str(REPO / "configs" / "accelerate_fsdp2_cpu_2proc.yaml")
    sp, plain = _sp_and_plain(tmp_path, [accelerate, "launch", "--config_file", config, SCRIPT,
                                         "--fsdp", SP_JSON], [])
    assert sp["fsdp_units"] == 6 and sp["trained_through"] == "ShardedModel"
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
