"""arctic.config: DeepSpeed JSON -> SequenceParallelConfig, and DeepSpeed accepts the file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

import dist_pool
from arctic.config import SequenceParallelConfig, load_ds_config, zero_stage
from helpers import get_mesh
from helpers import value_error_of as _value_error
from ulysses import self_check
from ulysses.mesh import mesh_dims

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
WORLD = {"cpu_demo.json": 2, "cpu_trainer.json": 2, "llama3_8b_5m_8xh100.json": 8,
         "hybrid_2node.json": 16, "cpu_alst.json": 2, "cpu_trainer_fsdp.json": 2}
ALST = {"cpu_alst.json"}
"""Configs for HF's ALST settings: the SP size comes from TrainingArguments'
parallelism_config (arctic.train.parallelism), not from the JSON."""


def test_every_shipped_config_loads():
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(WORLD)
    for name, world in WORLD.items():
        ds = json.loads((CONFIGS / name).read_text())
        if name in ALST:
            assert "sequence_parallel_size" not in ds
            ds["sequence_parallel_size"] = world  # what parallelism_config's sp_size gives
        cfg = SequenceParallelConfig.from_ds_config(ds, world_size=world)
        assert cfg.dims(world).sp == ds["sequence_parallel_size"]
    big = SequenceParallelConfig.from_ds_config(CONFIGS / "llama3_8b_5m_8xh100.json")
    assert (big.ulysses_degree, big.head_chunk_size, big.communication_dtype) == (8, 1, "bf16")
    assert big.activation_checkpointing and big.offload_activations
    hybrid = SequenceParallelConfig.from_ds_config(CONFIGS / "hybrid_2node.json")
    assert (hybrid.ulysses_degree, hybrid.ring_degree) == (8, 2)
    for shipped in (big, hybrid):  # the kernel chosen by device, dtype and head dim
        assert shipped.attn_implementation == "ulysses_sdpa"
        assert shipped.attention_backend is None


def test_deepspeed_keys_are_read():
    cfg = SequenceParallelConfig.from_ds_config({
        "sequence_parallel_size": 4, "seq_parallel_communication_data_type": "BF16",
        "activation_checkpointing": {"cpu_checkpointing": True}})
    assert cfg.sequence_parallel_size == 4 and cfg.communication_dtype == "bf16"
    assert cfg.activation_checkpointing and cfg.offload_activations
    assert SequenceParallelConfig.from_ds_config({}) == SequenceParallelConfig()


@pytest.mark.parametrize("config,needles", [
    ({"ulysses": {"ring_degre": 2}}, ["ring_degre", "valid keys", "ring_degree", "tiled_mlp"]),
    ({"sequence_parallel_size": 3}, ["sequence_parallel_size (3)", "world size (4)",
                                     "[1, 2, 4]"]),
    ({"sequence_parallel_size": 4, "ulysses": {"ring_degree": 3}}, ["ring_degree (3)"]),
    ({"ulysses": {"ring_layout": "documents"}}, ["ring_layout", "per_document"]),
    ({"ulysses": {"head_chunk_size": 0}}, ["head_chunk_size", "0"]),
    ({"ulysses": {"tiled_mlp": "big"}}, ["tiled_mlp", "'big'"]),
    ({"ulysses": {"offload_activations": True}}, ["needs activation_checkpointing"]),
    ({"ulysses": {"attn_implementation": "sdpa"}}, ["ulysses_sdpa"]),
    ({"seq_parallel_communication_data_type": "int8"}, ["int8"]),
    ({"ulysses": []}, ["must be an object"]),
    ({"activation_checkpointing": {"partition_activations": True}},
     ["partition_activations=True", "not supported", "cpu_checkpointing"]),
    ({"activation_checkpointing": {"number_checkpoints": 4}}, ["number_checkpoints=4"]),
    ({"activation_checkpointing": {"cpu_checkpoint": True}}, ["cpu_checkpoint'", "only"]),
    ({"ulysses": {"activation_checkpointing": True, "offload_activations": True,
                  "offload_dir": tempfile.gettempdir(), "offload_io": "fast"}},
     ["ulysses.offload_io must be null or one of ('auto', 'aio', 'threads'), got 'fast'"]),
    ({"ulysses": {"activation_checkpointing": True, "offload_activations": True,
                  "offload_io": "aio"}},
     ["ulysses.offload_io='aio' needs ulysses.offload_dir"]),
])
def test_bad_configs_raise_value_error(config, needles):
    with pytest.raises(ValueError) as err:
        SequenceParallelConfig.from_ds_config(config, world_size=4)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_bad_files_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        SequenceParallelConfig.from_ds_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SequenceParallelConfig.from_ds_config(tmp_path / "bad.json")


def _rank_deepspeed_accepts(path):
    import deepspeed

    from helpers import init_deepspeed_comm
    from ulysses import DeepSpeedMPU

    init_deepspeed_comm()
    cfg = SequenceParallelConfig.from_ds_config(path, world_size=2)
    mesh = get_mesh(2, cfg.ulysses_degree, cfg.ring_degree)
    model = torch.nn.Linear(8, 8)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=str(path),
                                                   model_parameters=model.parameters(),
                                                   mpu=DeepSpeedMPU(mesh))
    loss = engine(torch.randn(1, 8)).sum()
    engine.backward(loss)
    engine.step()
    return engine.zero_optimization_stage(), engine.sequence_parallel_size


def test_deepspeed_initialize_accepts_the_cpu_demo_config():
    for stage, sp in dist_pool.run(_rank_deepspeed_accepts, str(CONFIGS / "cpu_demo.json"),
                                   world_size=2, timeout=180):
        assert (stage, sp) == (3, 2)


@pytest.mark.parametrize("config,stage", [
    ({}, 0),
    ({"zero_optimization": None}, 0),
    ({"zero_optimization": {}}, 0),
    ({"zero_optimization": {"stage": None}}, 0),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 2),
    ({"zero_optimization": {"stage": 3}}, 3),
    ({"zero_optimization": {"stage": False}}, 0),
    ({"zero_optimization": True}, 1),  # DeepSpeed's deprecated form
    ({"zero_optimization": 3}, 3),  # a bare stage in place of the block
])
def test_zero_stage_reads_the_stage_as_deepspeed_does(config, stage):
    assert zero_stage(config) == stage


@pytest.mark.parametrize("stage", ["3", 4, -1, 2.5, [3]])
def test_zero_stage_refuses_a_malformed_stage(stage):
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3, got"):
        zero_stage({"zero_optimization": {"stage": stage}})


def test_load_ds_config_reads_the_shipped_json_and_passes_a_dict_through(tmp_path):
    assert zero_stage(load_ds_config(CONFIGS / "cpu_demo.json")) == 3
    ds = {"zero_optimization": {"stage": 1}}
    assert load_ds_config(ds) is ds
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_ds_config(tmp_path / "list.json")


def _rank_fingerprint(ds):
    """What apply_sp_recipe made of ``ds``: one entry per config key."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic.recipe import apply_sp_recipe
    from arctic.tiling.layer import _tiled_layer_forward
    from arctic.tiling.tiles import TiledForward
    from offload.checkpoint import _CheckpointedForward

    config = SequenceParallelConfig.from_ds_config(ds, world_size=2)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    mesh = config.dims(2).build_mesh("cpu")
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True,
                    host_memory_limit=1 << 28)
    layer = model.model.layers[0]
    sp = layer.self_attn.sp_attention
    mlp, norm, ckpt = layer.mlp.forward, layer.input_layernorm.forward, layer.forward
    disk = (ckpt.session.pool.disk if isinstance(ckpt, _CheckpointedForward) and ckpt.session
            else None)
    return {
        "sequence_parallel_size": mesh.size(), "ring_degree": mesh["ring"].size(),
        "ring_layout": ("per_document" if mesh_dims(mesh).per_document else
                        "zigzag" if mesh_dims(mesh).zigzag else "contiguous"),
        "head_chunk_size": sp.head_chunk_size, "fuse_projections": sp.fuse_projections,
        "seq_chunk": sp.seq_chunk,
        "attn_implementation": sp.backend, "communication_dtype": sp.communication_dtype,
        "tiled_mlp": mlp.args[0] if isinstance(mlp, TiledForward) else None,
        "tiled_norms": isinstance(norm, TiledForward),
        "tiled_layer": getattr(getattr(ckpt, "forward", ckpt), "__func__", None) is
        _tiled_layer_forward,
        "loss_tiles": getattr(model.lm_head.forward, "tiles", None),  # None: no SP loss
        "activation_checkpointing": isinstance(ckpt, _CheckpointedForward),
        "offload_activations": isinstance(ckpt, _CheckpointedForward) and ckpt.session is not None,
        "offload_prefetch": not (isinstance(ckpt, _CheckpointedForward) and ckpt.session
                                 is not None and not ckpt.session.prefetch),
        "offload_dir": disk and disk.directory, "offload_io": disk and disk.io,
        "recompute_attention": not (isinstance(ckpt, _CheckpointedForward) and
                                    ckpt.keep is not None),
        "kernel_self_check": mesh_dims(mesh).kernel_self_check,
    }


AUTO_IO = "<what offload_io='auto' resolves to on this machine>"


def _auto_io() -> str:
    """"aio" where DeepSpeed was installed with its aio op pre-built, else "threads"."""
    from offload.disk_aio import unusable

    with tempfile.TemporaryDirectory() as where:
        return "threads" if unusable(str(Path(where) / "probe"), build=False) else "aio"


# Each accepted key, a value other than its default, and what it must change (beyond itself).
KEY_EFFECTS = {
    "ring_degree": ({"ulysses": {"ring_degree": 2}}, {"ring_degree": 2}),
    "ring_layout": ({"ulysses": {"ring_degree": 2, "ring_layout": "per_document"}},
                    {"ring_degree": 2, "ring_layout": "per_document"}),
    "ring_layout (contiguous)": ({"ulysses": {"ring_degree": 2, "ring_layout": "contiguous"}},
                                 {"ring_degree": 2, "ring_layout": "contiguous"}),
    "head_chunk_size": ({"ulysses": {"head_chunk_size": 1}}, {"head_chunk_size": 1}),
    "fuse_projections": ({"ulysses": {"head_chunk_size": 1, "fuse_projections": True}},
                         {"head_chunk_size": 1, "fuse_projections": True}),
    "seq_chunk": ({"ulysses": {"head_chunk_size": 1, "seq_chunk": 2}},
                  {"head_chunk_size": 1, "seq_chunk": 2}),
    "tiled_mlp": ({"ulysses": {"tiled_mlp": 4}}, {"tiled_mlp": 4, "tiled_norms": True}),
    "tiled_norms": ({"ulysses": {"tiled_mlp": 4, "tiled_norms": False}}, {"tiled_mlp": 4}),
    "tiled_layer": ({"ulysses": {"tiled_mlp": 4, "tiled_layer": True}},
                    {"tiled_mlp": 4, "tiled_norms": True, "tiled_layer": True}),
    "loss_tiles": ({"ulysses": {"loss_tiles": 3}}, {"loss_tiles": 3}),
    "loss_tiles (null)": ({"ulysses": {"loss_tiles": None}}, {"loss_tiles": None}),
    "activation_checkpointing": ({"ulysses": {"activation_checkpointing": True}},
                                 {"activation_checkpointing": True}),
    "offload_activations": ({"ulysses": {"activation_checkpointing": True,
                                         "offload_activations": True}},
                            {"activation_checkpointing": True, "offload_activations": True}),
    "offload_prefetch": ({"ulysses": {"activation_checkpointing": True,
                                      "offload_activations": True, "offload_prefetch": False}},
                         {"activation_checkpointing": True, "offload_activations": True,
                          "offload_prefetch": False}),
    "offload_dir": ({"ulysses": {"activation_checkpointing": True, "offload_activations": True,
                                 "offload_dir": tempfile.gettempdir()}},
                    {"activation_checkpointing": True, "offload_activations": True,
                     "offload_dir": tempfile.gettempdir(), "offload_io": AUTO_IO}),
    "offload_io": ({"ulysses": {"activation_checkpointing": True, "offload_activations": True,
                                "offload_dir": tempfile.gettempdir(), "offload_io": "threads"}},
                   {"activation_checkpointing": True, "offload_activations": True,
                    "offload_dir": tempfile.gettempdir(), "offload_io": "threads"}),
    "recompute_attention": ({"ulysses": {"activation_checkpointing": True,
                                         "recompute_attention": False}},
                            {"activation_checkpointing": True, "recompute_attention": False}),
    "kernel_self_check": ({"ulysses": {"kernel_self_check": False}},
                          {"kernel_self_check": False}),
    "attention_backend": ({"ulysses": {"attention_backend": "math"}},
                          {"attn_implementation": "math"}),
    "cpu_checkpointing (DeepSpeed block)": ({"activation_checkpointing": {"cpu_checkpointing":
                                                                         True}},
                                            {"activation_checkpointing": True,
                                             "offload_activations": True}),
    "seq_parallel_communication_data_type": ({"seq_parallel_communication_data_type": "fp32"},
                                             {"communication_dtype": torch.float32}),
}


def test_every_config_key_has_its_effect():
    """Honour or refuse: each key of the ``ulysses`` block (and each DeepSpeed key we read)
    changes exactly what it names in the model apply_sp_recipe builds. attn_implementation's
    other choice (flash_attn) cannot run on CPU: test_arctic_models checks it is refused there
    and the CUDA test picks its kernel."""
    accepted = {f.name for f in __import__("dataclasses").fields(SequenceParallelConfig)}
    # mixer_parallelism and mixer_chunk act on hybrids' mixers only:
    # test_arctic_state_passing.py, test_arctic_mixer_chunks.py (through the config's key)
    covered = {k for k in KEY_EFFECTS if k in accepted} | {"sequence_parallel_size",
                                                             "attn_implementation",
                                                             "communication_dtype",
                                                             "mixer_parallelism",
                                                             "mixer_chunk"}
    assert accepted <= covered, accepted - covered
    base_ds = {"sequence_parallel_size": 2}
    base = dist_pool.run(_rank_fingerprint, base_ds, world_size=2)[0]
    for key, (extra, changes) in KEY_EFFECTS.items():
        ds = {**base_ds, **extra}
        got = dist_pool.run(_rank_fingerprint, ds, world_size=2)[0]
        want = {**base, **{k: _auto_io() if v == AUTO_IO else v for k, v in changes.items()}}
        assert got == want, (key, {k: (base[k], got[k]) for k in got if got[k] != want[k]})


def _rank_wrong_kernel_through_the_model(check: bool):
    """A model set up from a config, its ``cpu_flash`` swapped for one whose output is 5%
    off: refused at the first forward with ``kernel_self_check``, run without it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from arctic.recipe import apply_sp_recipe
    from ulysses import kernels

    config = SequenceParallelConfig.from_ds_config(
        {"sequence_parallel_size": 2,
         "ulysses": {"attention_backend": "cpu_flash", "kernel_self_check": check}},
        world_size=2)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    apply_sp_recipe(model, config=config, mesh=config.dims(2).build_mesh("cpu"),
                    averaged_over_sp=True)
    good = kernels._FORWARD["cpu_flash"]
    kernels._FORWARD["cpu_flash"] = lambda *a: (good(*a)[0] * 1.05, good(*a)[1])
    self_check.forget()
    try:
        model.model(input_ids=torch.arange(16)[None], position_ids=torch.arange(16)[None])
        return None
    except ValueError as e:
        return str(e)
    finally:
        kernels._FORWARD["cpu_flash"] = good
        self_check.forget()


def test_kernel_self_check_key_decides_whether_a_wrong_kernel_is_refused():
    checked = dist_pool.run(_rank_wrong_kernel_through_the_model, True, world_size=2)
    assert all("'cpu_flash' disagrees with the float64 reference" in m for m in checked), checked
    assert dist_pool.run(_rank_wrong_kernel_through_the_model, False, world_size=2) == [None] * 2


def _rank_backend_refusals():
    from arctic import apply_sequence_parallel
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    mesh = get_mesh(2, 2)
    errors = {}
    for name, kwargs in {
        "conflict": dict(attn_implementation="ulysses_flash_attention_2",
                         attention_backend="math"),
        "wrong device": dict(attention_backend="sdpa_flash"),
    }.items():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        errors[name] = _value_error(lambda: apply_sequence_parallel(model, mesh=mesh, **kwargs))
    return errors


def test_attention_backend_is_checked_when_applied():
    errors = dist_pool.run(_rank_backend_refusals, world_size=2)[0]
    assert "runs the 'flash_attn' kernel, but attention_backend='math'" in errors["conflict"]
    assert "'sdpa_flash' needs a CUDA tensor" in errors["wrong device"], errors
    err = _value_error(lambda: SequenceParallelConfig.from_ds_config(
        {"ulysses": {"attention_backend": "fast"}}))
    assert "ulysses.attention_backend must be null or one of" in err, err


@pytest.mark.parametrize("key,meant", [
    ("sequence_paralel_size", "sequence_parallel_size"),
    ("seq_parallel_size", "sequence_parallel_size"),
    ("Sequence-Parallel-Size", "sequence_parallel_size"),
    ("seq_parallel_communication_dtype", "seq_parallel_communication_data_type"),
    ("ulyses", "ulysses"),
    ("Ulysses", "ulysses"),
    ("ulysses_degree", "ulysses"),
])
def test_a_mistyped_sequence_parallel_key_is_refused_by_name(tmp_path, key, meant):
    """DeepSpeed ignores a key it does not know: "sequence_paralel_size": 2 would train as
    plain data parallelism. Every entry point loads the config through load_ds_config."""
    ds = {"zero_optimization": {"stage": 3}, key: 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for given in (ds, path):
        with pytest.raises(ValueError, match=f"unknown top-level key '{key}' .* did you mean "
                                             f"'{meant}'"):
            SequenceParallelConfig.from_ds_config(given, world_size=2)


def test_no_key_deepspeed_knows_is_taken_for_a_typo():
    """Each top-level key DeepSpeed's runtime names (its constants modules) passes, with ours:
    the check cannot refuse a config that DeepSpeed reads."""
    import re

    import deepspeed

    root = Path(deepspeed.__file__).parent / "runtime"
    keys = {m.group(1) for f in root.rglob("*.py")
            for m in re.finditer(r'^[A-Z][A-Z_0-9]* = "([a-z][a-z_0-9]*)"$',
                                 f.read_text(errors="ignore"), re.M)}
    assert {"communication_data_type", "zero_optimization",
            "train_micro_batch_size_per_gpu"} <= keys  # the scan finds DeepSpeed's keys
    # read by deepspeed.initialize itself (beside sequence_parallel_size, for its mesh)
    keys.add("data_parallel_size")
    assert len(keys) > 100
    load_ds_config(dict.fromkeys(keys, None))
