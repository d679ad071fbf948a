"""accelerate's ParallelismConfig read as sequence-parallel settings
(:func:`arctic.train.parallelism.merge_parallelism_config`): what is honoured, and each refusal,
on one process. The Trainer run with HF's ALST settings is
``tests/test_arctic_hf_trainer.py::test_sp_trainer_matches_plain_trainer`` (its AdamW
case)."""

from __future__ import annotations

import pytest

from arctic.config import SequenceParallelConfig
from arctic.train.parallelism import merge_parallelism_config

pytest.importorskip("accelerate.parallelism_config",
                    reason="ParallelismConfig is accelerate's from 1.10 on")


def _pc(attn="sdpa", variable=True, **sizes):
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    sizes = {"sp_backend": "deepspeed", "sp_size": 2, **sizes}
    return ParallelismConfig(**sizes, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=variable, sp_attn_implementation=attn,
        **({} if variable else {"sp_seq_length": 64})))


DS = {"zero_optimization": {"stage": 3}, "ulysses": {"tiled_mlp": "auto"}}


@pytest.mark.parametrize("attn,keys", [
    ("sdpa", {"attn_implementation": "ulysses_sdpa"}),
    ("flash_attention_2", {"attn_implementation": "ulysses_flash_attention_2"}),
    ("flash_attention_3", {"attn_implementation": "ulysses_sdpa", "attention_backend": "fa3"}),
])
def test_sp_size_and_the_kernel_are_read(attn, keys):
    ds = merge_parallelism_config(_pc(attn, dp_replicate_size=2), DS, world_size=4)
    assert ds["sequence_parallel_size"] == 2
    assert ds["ulysses"] == {"tiled_mlp": "auto", **keys}
    sp = SequenceParallelConfig.from_ds_config(ds, world_size=4)
    assert (sp.sequence_parallel_size, sp.dims(4).dp) == (2, 2)
    assert DS == {"zero_optimization": {"stage": 3}, "ulysses": {"tiled_mlp": "auto"}}
    assert merge_parallelism_config(None, DS, world_size=4) is DS


@pytest.mark.parametrize("pc,ds,needle", [
    (lambda: _pc(sp_size=1, cp_size=2), DS, "cp_size=2"),
    (lambda: _pc(tp_size=2), DS, "tp_size=2"),
    (lambda: _pc(dp_replicate_size=3), DS, "world / sp_size = 2"),
    (lambda: _pc(sp_size=1), DS, "sp_size=1"),
    (lambda: _pc(variable=False), DS, "sp_seq_length_is_variable=False"),
    (lambda: _pc("kernels-community/flash-attn2"), DS,
     "sp_attn_implementation='kernels-community/flash-attn2'"),
    (lambda: _pc(), {**DS, "sequence_parallel_size": 4}, "sequence_parallel_size=4"),
    (lambda: _pc("flash_attention_2"), {"ulysses": {"attn_implementation": "ulysses_sdpa"}},
     "ulysses.attn_implementation='ulysses_flash_attention_2'"),
])
def test_what_cannot_be_honoured_is_refused(pc, ds, needle):
    with pytest.raises(ValueError, match="parallelism_config") as e:
        merge_parallelism_config(pc(), ds, world_size=4)
    assert needle in str(e.value)
