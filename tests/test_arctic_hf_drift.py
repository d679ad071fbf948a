"""Drift canary: what the installed transformers passes to our attention and to every HF
forward arctic wraps, classified.

transformers renames and adds the arguments its modules pass each other between releases
(5.24 renamed ``past_key_values`` to ``cache``). For every family of docs/models.md's Supported
models table, one training step of a tiny model runs with each wrapped forward on (fused
projections and the tiled layer where the family supports them, else the tiled MLP and norms;
the SP loss; checkpointing with offload), and every argument name that reaches a bound
forward (:mod:`arctic.hf.binding`) or the attention (:func:`arctic.hf.features.classify`) is
recorded. A name that is neither bound to a role nor classified fails the test with the
transformers version, the class that received it and where to classify it, so the next
rename is caught here, not by a user.
"""

from __future__ import annotations

import pytest
import torch

import dist_pool
from helpers import get_mesh

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")
pytestmark = pytest.mark.hf_facing

from test_arctic_hf_families import _config, _tokens  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "cohere", "cohere2",
            "gpt_oss", "granite", "stablelm", "nemotron", "llama4")
"""The Supported models table's families that train under SP with the whole stack."""
NO_TILED_MLP = {"gpt_oss": "its MoE MLP returns (hidden, router scores), not one tensor",
                "llama4": "its MoE block returns (hidden, router logits), not one tensor"}


class _Recorder:
    """Wraps :meth:`ForwardSignature.bind` and :func:`hf_features.classify` in this process
    and records what they see; ``restore()`` puts them back."""

    def __init__(self) -> None:
        from arctic.hf import features as hf_features
        from arctic.hf.binding import ForwardSignature

        self.binds: list[tuple[str, str, str]] = []  # (class, name, how it is bound)
        self.attention: list[tuple[str, str | None]] = []  # (name, classification)
        self._bind, self._classify = ForwardSignature.bind, hf_features.classify
        rec = self

        def bind(sig, args, kwargs):
            call = rec._bind(sig, args, kwargs)
            roled = {n: r for r, n in sig.roles.items()}
            passed = list(kwargs) + [n for n in list(sig.signature.parameters)[:len(args)]]
            for name in passed:
                name = sig.renames.get(name, name)
                how = ("input" if name == sig.first else
                       f"role {roled[name]}" if name in roled else
                       "named, no role" if name in sig.signature.parameters else "**kwargs")
                rec.binds.append((sig.owner, name, how))
            return call

        def classify(name, passed_over=frozenset()):
            kind = rec._classify(name, passed_over)
            rec.attention.append((name, kind))
            return kind

        ForwardSignature.bind, hf_features.classify = bind, classify

    def restore(self) -> None:
        from arctic.hf import features as hf_features
        from arctic.hf.binding import ForwardSignature

        ForwardSignature.bind, hf_features.classify = self._bind, self._classify


def _stack(family: str, mesh):
    """The family's tiny model with every wrapped forward it supports."""
    from transformers import AutoModelForCausalLM

    from arctic import apply_activation_checkpointing, apply_tiled_layers, apply_tiled_mlp
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.hf.fused import FUSABLE
    from arctic.loss.head import apply_sp_loss
    from arctic.tiling.layer import TILABLE
    from arctic.tiling.norms import apply_tiled_norms
    from ulysses import flat_mesh

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    attn = type(model.model.layers[0].self_attn).__name__
    layer = type(model.model.layers[0]).__name__
    apply_sequence_parallel(model, mesh=mesh, head_chunk_size=1, fuse_projections=attn in FUSABLE)
    if family not in NO_TILED_MLP:
        apply_tiled_mlp(model, tiles=2)
    apply_tiled_norms(model, tiles=2)
    if layer in TILABLE:
        apply_tiled_layers(model, tiles=2)
    apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
    apply_activation_checkpointing(model, offload_to_cpu=True)
    return model


def _rank_canary(family: str, extra: dict | None = None):
    """One training step under the recorder: ``(binds, attention names, error or None)``."""
    from arctic.data.batch import prepare_sp_batch

    mesh = get_mesh(2, 2)
    model = _stack(family, mesh)
    model.train()
    batch = prepare_sp_batch({"input_ids": _tokens(), "labels": _tokens()}, mesh)
    rec = _Recorder()
    error = None
    try:
        model(**batch, **(extra or {})).backward()
    except ValueError as e:  # an unclassified name is refused; report it with the rest
        error = str(e)
    finally:
        rec.restore()
    return rec.binds, rec.attention, error


def unclassified(family: str, binds, attention, error) -> list[str]:
    """The canary's verdict: one line per name nobody classified (empty: all classified)."""
    import transformers

    where = ("classify it: attention arguments in arctic/hf/features.py (HONOURED, REFUSED, "
             "INERT; the model's loss arguments come from its loss function), arguments of "
             "wrapped forwards by role in arctic/hf/binding.py (ROLE_NAMES)")
    lines = {f"transformers {transformers.__version__} passes {name!r} to {owner}.forward "
             f"({how}) in {family}; {where}"
             for owner, name, how in binds if how == "named, no role"}
    lines |= {f"transformers {transformers.__version__} passes {name!r} to the attention in "
              f"{family}; {where}" for name, kind in attention if kind is None}
    if error is not None and not lines:
        lines.add(f"{family}: the step was refused: {error}")
    return sorted(lines)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_argument_is_classified(family):
    binds, attention, error = dist_pool.run(_rank_canary, family, world_size=2)[0]
    assert not unclassified(family, binds, attention, error), \
        "\n".join(unclassified(family, binds, attention, error))
    # The canary saw the wrapped forwards and the attention (not a vacuous pass).
    owners = {owner for owner, _, _ in binds}
    assert any(o.endswith("Model") for o in owners), owners  # the batch hook
    assert any(not o.endswith("Model") for o in owners), owners  # a wrapped layer's module
    assert attention, "no argument reached the attention"


def test_canary_fails_on_an_unclassified_argument():
    """As a new transformers release would: a keyword nobody classified reaches every
    attention call (transformers passes the model's keywords down, TransformersKwargs)."""
    import transformers

    binds, attention, error = dist_pool.run(_rank_canary, "qwen3", {"fresh_argument": None},
                                            world_size=2)[0]
    lines = unclassified("qwen3", binds, attention, error)
    assert lines and all("'fresh_argument'" in line for line in lines), lines
    assert f"transformers {transformers.__version__}" in lines[0]
    assert "arctic/hf/features.py" in lines[0] and "Qwen3Attention" in error, (lines, error)


def test_transformers_kwargs_are_classified():
    """Every keyword the installed ``TransformersKwargs`` lets a model pass down to its
    attention has a classification (or is one of the model's loss arguments)."""
    import transformers
    from transformers.utils.generic import TransformersKwargs

    from arctic.hf.features import classify, loss_arguments

    loss = loss_arguments()
    missing = [n for n in TransformersKwargs.__annotations__ if classify(n, loss) is None]
    assert not missing, (f"transformers {transformers.__version__}: TransformersKwargs has "
                         f"{missing}, which arctic/hf/features.py does not classify")
    assert {"num_items_in_batch", "shift_labels", "labels", "ignore_index"} <= loss, loss

