"""flash-linear-attention's own context parallelism for the delta rules
(:mod:`arctic.hf.mixer_fla`), against a CPU stand-in for fla (``tests/fake_fla.py``) that
transformers resolves as it resolves fla: 256 packed documents take one kernel call per
layer and rank, with fla's layout and the global ``cu_seqlens``, and the step equals the
unmodified model on one process. Layouts fla does not have run the torch state passing, with
fla's kernel per piece.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

import dist_pool
from helpers import assert_step_matches, averaged_grads, get_mesh, grads_of
from test_arctic_hybrid_models import VOCAB, _skip_unless_supported
from test_arctic_state_passing import _model

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")

def _lengths() -> tuple[int, ...]:
    lengths = [3 - i % 2 for i in range(256)]
    lengths[0] += 1
    lengths[200] -= 1
    return tuple(lengths)


LENGTHS = _lengths()
"""256 documents of 2 to 4 tokens, 640 in all: the pieces' boundaries (320 at SP=2; 160,
320 and 480 on a zigzag ring of 2) fall inside documents."""
SEQ = sum(LENGTHS)
SCANS = {"qwen3_5": ("qwen3_5", "torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
         "kimi_linear": ("kimi_linear", "chunk_kimi_delta_attention", "chunk_kda")}


def _ids():
    return torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))


def _torch_scan(file, name):
    from arctic.hf.mixers import Dispatch

    current = getattr(file, name)
    return inspect.unwrap(current.original if isinstance(current, Dispatch) else current)


def _rank_fla(family: str, ulysses: int, ring: int, zigzag):
    """The SP step of ``family`` with the stand-in fla resolved by transformers for its file,
    and the kernel calls of the forward."""
    import importlib

    import fake_fla
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from arctic.data.batch import prepare_sp_batch
    from arctic.hf.attention import apply_sequence_parallel
    from arctic.loss.head import apply_sp_loss
    from ulysses import flat_mesh

    folder, attribute, fla_name = SCANS[family]
    file = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    saved = {n: getattr(file, n) for _, n, _ in SCANS.values() if hasattr(file, n)}
    q35 = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    fake_fla.install(_torch_scan(q35, "torch_chunk_gated_delta_rule"),
                     _torch_scan(kimi, "chunk_kimi_delta_attention"))
    # transformers 5.25 sends inputs on a device fla does not run on to the torch fallback;
    # the CPU stand-in runs where fla runs on the GPU
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})
    kept = devices.get("fla")
    try:
        if kept is not None:
            devices["fla"] = (*kept, "cpu")
        setattr(file, attribute, use_kernel_func_from_hub_with_fallback(fla_name, "fla")(
            _torch_scan(file, attribute)))
        if kept is not None:
            devices["fla"] = kept
        mesh = get_mesh(ulysses * ring, ulysses, ring, zigzag)
        model = apply_sequence_parallel(_model(family), mesh=mesh)
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group())
        ids = _ids()
        raw = {"input_ids": ids, "labels": ids,
               "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}
        fake_fla.CALLS.clear()
        loss = model(**prepare_sp_batch(raw, mesh))
        calls = list(fake_fla.CALLS)
        loss.backward()
        return loss.item(), averaged_grads(model, mesh.size()), calls
    finally:
        if kept is not None:
            devices["fla"] = kept
        for n, f in saved.items():
            setattr(file, n, f)
        fake_fla.uninstall()


_REFS: dict = {}


def _reference(family: str):
    """The unmodified model on each document alone: the documents of one length as the rows
    of one call (what ``helpers.causal_lm_loss`` computes one document at a time), the loss
    the mean over all their targets."""
    if family not in _REFS:
        model, ids = _model(family), _ids()
        cuts = [0, *itertools.accumulate(LENGTHS)]
        total, count = 0.0, 0
        for n in sorted(set(LENGTHS)):
            rows = torch.cat([ids[:, a:b] for a, b in zip(cuts, cuts[1:]) if b - a == n])
            total = total + model(input_ids=rows, labels=rows).loss * rows.shape[0] * (n - 1)
            count += rows.shape[0] * (n - 1)
        loss = total / count
        loss.backward()
        _REFS[family] = loss.item(), grads_of(model)
    return _REFS[family]


def _mixer_layers(family: str) -> int:
    from arctic.hf.mixers import token_mixers

    return len(token_mixers(_model(family)))


@pytest.mark.parametrize("family,ulysses,ring,zigzag,layout", [
    ("qwen3_5", 2, 1, True, "contiguous"),
    ("qwen3_5", 1, 2, True, "zigzag"),
    pytest.param("kimi_linear", 2, 1, True, "contiguous", marks=pytest.mark.slow),
    pytest.param("qwen3_5", 1, 2, False, "contiguous", marks=pytest.mark.slow)])
def test_256_documents_in_one_fla_call_per_layer(family, ulysses, ring, zigzag, layout):
    _skip_unless_supported(family)
    results = dist_pool.run(_rank_fla, family, ulysses, ring, zigzag,
                            world_size=ulysses * ring, timeout=240)
    layers = _mixer_layers(family)
    for _, _, calls in results:
        assert calls == [{"kernel": SCANS[family][2], "cp": True, "layout": layout,
                          "documents": 256}] * layers, calls
    assert_step_matches([r[:2] for r in results], _reference(family))


def test_layouts_fla_does_not_have_pass_the_state_here():
    """Ulysses 2 x a zigzag ring of 2 (sp rank r holds one chunk, not fla's pair): the torch
    state passing runs, fla's kernel scanning each document run of each piece."""
    _skip_unless_supported("qwen3_5")
    results = dist_pool.run(_rank_fla, "qwen3_5", 2, 2, True, world_size=4, timeout=240)
    for _, _, calls in results:
        assert calls and all(c == {"kernel": "chunk_gated_delta_rule", "cp": False}
                             for c in calls), calls[:3]
    assert_step_matches([r[:2] for r in results], _reference("qwen3_5"))


def test_the_resolved_kernel_is_read_through_the_kernels_module_of_a_function():
    """transformers 5.25 with the ``kernels`` package makes a module of each function its
    hub-kernel wrapper decorates; the kernel it resolved is read through that module (else
    fla's own context parallelism would never run there)."""
    from arctic.hf.mixer_fla import resolved_kernel

    def kernel(query, key, value):  # never called: what the wrapper resolved
        return value

    def hub_wrapper(implementation):  # the shape of use_kernel_func_from_hub_with_fallback's
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)
        return wrapped

    wrapped = hub_wrapper(kernel)

    class Func(torch.nn.Module):  # the kernels package's module of a function
        def forward(self, *args, **kwargs):
            return wrapped(*args, **kwargs)

    assert resolved_kernel(wrapped) is kernel
    assert resolved_kernel(Func()) is kernel
