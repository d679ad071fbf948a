"""The README's HF Trainer snippet, as printed, run under ``torchrun --nproc-per-node 2`` on CPU.

The snippet is read from README.md when the test runs. The test fills in only what the
README leaves open: the ``...`` of ``TrainingArguments(...)`` (an output directory, two
steps, ``use_cpu=True`` as the README says for a machine without GPUs, no reporting), and
the names the snippet uses without defining them (``TrainingArguments``, a tiny Llama of
random weights as ``model``, byte-level token datasets as ``ds`` and ``ev``). Anything else
the snippet does runs as printed, so a README change that does not run fails here."""

from __future__ import annotations

import ast
import builtins
import json
import math
import re
from pathlib import Path

import launch_pool
import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer plugin needs transformers ([hf])")

REPO = Path(__file__).resolve().parent.parent

FILLED_ARGUMENTS = {"TrainingArguments": "_README_TRAINING_ARGUMENTS"}
"""The calls whose ``...`` the test fills, and the name of the dict it fills them with."""

PRELUDE = """\
import json
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    attn_implementation="sdpa")
_bytes = torch.Generator().manual_seed(0)
ds = [{"input_ids": torch.randint(0, 256, (64,), generator=_bytes)} for _ in range(8)]
ev = [{"input_ids": torch.randint(0, 256, (64,), generator=_bytes)} for _ in range(2)]
_README_TRAINING_ARGUMENTS = dict(output_dir=sys.argv[1], max_steps=2, logging_steps=1,
                                  per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                  save_strategy="no", use_cpu=True, report_to="none")
"""
PROVIDED = {"TrainingArguments", "model", "ds", "ev"}
"""The names the prelude defines for the snippet."""

EPILOGUE = """
import ulysses

_metrics = trainer.evaluate()
_dims = ulysses.mesh_dims(trainer.sp_mesh)
if trainer.is_world_process_zero():
    with open(sys.argv[2], "w") as _f:
        json.dump({"log_history": trainer.state.log_history, "eval": _metrics,
                   "global_step": trainer.state.global_step,
                   "sp_size": _dims.ulysses_degree * _dims.ring_degree,
                   "world_size": trainer.args.world_size}, _f)
"""


def readme_trainer_snippet(readme: str) -> str:
    """The one python block of ``readme`` that builds a ``SequenceParallelTrainer``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
              if "SequenceParallelTrainer(" in b]
    assert len(blocks) == 1, f"expected one README block with the Trainer, found {len(blocks)}"
    return blocks[0]


class _FillEllipsis(ast.NodeTransformer):
    """``TrainingArguments(..., k=v)`` -> ``TrainingArguments(**_README_TRAINING_ARGUMENTS,
    k=v)``: the ``...`` of a call in :data:`FILLED_ARGUMENTS`, as its dict."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        dots = [a for a in node.args if isinstance(a, ast.Constant) and a.value is Ellipsis]
        if dots:
            assert name in FILLED_ARGUMENTS, f"the README's {name}(...) is not one the test fills"
            node.args = [a for a in node.args if a not in dots]
            node.keywords.insert(0, ast.keyword(arg=None,
                                                value=ast.Name(FILLED_ARGUMENTS[name], ast.Load())))
        return node


def _undefined_names(tree: ast.Module) -> set[str]:
    """The names ``tree`` reads without binding them (builtins aside)."""
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return read - bound - set(dir(builtins))


def runnable_snippet(snippet: str) -> str:
    """The snippet with the ``...`` filled in, between the prelude and the epilogue."""
    tree = ast.parse(snippet)
    missing = _undefined_names(tree) - PROVIDED
    assert not missing, f"the README snippet uses names the test does not fill: {missing}"
    assert "trainer" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and
                         isinstance(n.ctx, ast.Store)}, "the epilogue reads the snippet's trainer"
    filled = ast.unparse(ast.fix_missing_locations(_FillEllipsis().visit(tree)))
    return PRELUDE + "\n# The README's snippet, its ... filled in:\n" + filled + "\n" + EPILOGUE


def test_the_readme_trainer_snippet_runs_on_two_cpu_ranks(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the README's CPU case (use_cpu=True)")
    readme = (REPO / "README.md").read_text()
    # The fill's use_cpu=True is what the README tells a machine without GPUs to add.
    assert "add `use_cpu=True` to `TrainingArguments`" in readme
    script = tmp_path / "readme_trainer.py"
    script.write_text(runnable_snippet(readme_trainer_snippet(readme)))
    out = tmp_path / "record.json"
    # cwd: the README's paths (configs/cpu_alst.json) are the checkout's.
    proc = launch_pool.launch(str(script), str(tmp_path / "out"), str(out), nproc=2, cwd=REPO,
                              timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    record = json.loads(out.read_text())
    losses = [h["loss"] for h in record["log_history"] if "loss" in h]
    print(f"\nREADME snippet on 2 ranks: losses {losses}, eval {record['eval']['eval_loss']}")
    assert record["world_size"] == 2 and record["sp_size"] == 2  # the snippet's sp_size=2
    assert record["global_step"] == 2 and len(losses) == 2
    assert all(math.isfinite(x) and x > 0 for x in losses)
    assert math.isfinite(record["eval"]["eval_loss"])
