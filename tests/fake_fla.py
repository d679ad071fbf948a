"""A stand-in for flash-linear-attention 0.6 (fla-core) on CPU, for the tests of
:mod:`arctic.hf.mixer_fla`: the package layout transformers resolves the delta-rule kernels
from (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, ``fla.ops.kda.chunk_kda``), and
``fla.ops.cp.build_cp_context``, with fla's documented contract:

- the context holds the CP group, the global ``cu_seqlens`` and the layout (``contiguous``:
  rank r holds part r of W; ``zigzag``: parts r and 2W-1-r of 2W, front then back);
- a kernel given ``cp_context`` takes one row, no initial state and no final state, and
  returns this rank's output of the whole sequence's recurrence, each document alone.

The kernels compute it with transformers' torch scans on the gathered sequence, the
documents as the rows of a few calls (:func:`ulysses.packing.batched`; the gather's backward
returns each rank its gradients). Every call is recorded in
:data:`CALLS`.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

from ulysses.packing import batched
from ulysses.state_passing import Gathered

CALLS: list[dict] = []


class Context:
    """What ``build_cp_context`` returns here: its arguments."""

    def __init__(self, cu_seqlens, group, cu_seqlens_cpu, layout):
        self.group, self.layout = group, layout
        self.global_bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None
                              else cu_seqlens.cpu()).tolist()


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None,
                     use_tf32x3_affine_chain=True, layout="contiguous"):
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"`layout` must be 'contiguous' or 'zigzag', got {layout!r}.")
    return Context(cu_seqlens, group, cu_seqlens_cpu, layout)


def _parts(world: int, layout: str) -> list[tuple[int, int]]:
    """Per part of the sequence in order: ``(rank, index in its local buffer)``."""
    if layout == "contiguous":
        return [(r, 0) for r in range(world)]
    return [(m, 0) if m < world else (2 * world - 1 - m, 1) for m in range(2 * world)]


def _cp(torch_scan, context, inputs: list, l2norm: bool):
    group = context.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    every = [Gathered.apply(t.contiguous(), group, rank, world) for t in inputs]
    s = inputs[0].shape[1]
    parts = _parts(world, context.layout)
    size = s * world // len(parts)
    whole = [torch.cat([t[r][:, i * size:(i + 1) * size] for r, i in parts], dim=1)
             for t in every]
    bounds = context.global_bounds
    if bounds[-1] != whole[0].shape[1]:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, the sequence has {whole[0].shape[1]}")
    def scan(q, k, v, g, beta):
        return torch_scan(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=l2norm)[0]

    spans = [(0, a, b) for a, b in zip(bounds, bounds[1:])]  # each document alone
    out = torch.cat(batched(scan, dict(zip(("q", "k", "v", "g", "beta"), whole)), spans),
                    dim=1)
    mine = [m for m, (r, _) in enumerate(parts) if r == rank]
    return torch.cat([out[:, m * size:(m + 1) * size] for m in mine], dim=1)


def _kernel(name: str, torch_scan):
    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cp_context=None):
        if scale is not None or cu_seqlens is not None:
            raise NotImplementedError("the stand-in takes neither scale nor cu_seqlens")
        if cp_context is None:
            CALLS.append({"kernel": name, "cp": False})
            return torch_scan(q, k, v, g=g, beta=beta, initial_state=initial_state,
                              output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if q.shape[0] != 1 or initial_state is not None or output_final_state:
            raise ValueError("CP takes one row, no initial state and no final state")
        CALLS.append({"kernel": name, "cp": True, "layout": cp_context.layout,
                      "documents": len(cp_context.global_bounds) - 1})
        return _cp(torch_scan, cp_context, [q, k, v, g, beta], use_qk_l2norm_in_kernel), None

    kernel.__name__ = name
    kernel.__module__ = f"fla.ops.{'kda' if name == 'chunk_kda' else 'gated_delta_rule'}.chunk"
    return kernel


NAMES = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.kda", "fla.ops.cp")


def install(gated_delta_rule, kda) -> None:
    """Put the stand-in in ``sys.modules``, its kernels computing with the given torch scans
    (transformers' ``torch_chunk_gated_delta_rule`` and ``chunk_kimi_delta_attention``)."""
    modules = {n: types.ModuleType(n) for n in NAMES}
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = _kernel(
        "chunk_gated_delta_rule", gated_delta_rule)
    modules["fla.ops.kda"].chunk_kda = _kernel("chunk_kda", kda)
    modules["fla.ops.cp"].build_cp_context = build_cp_context
    modules["fla"].ops = modules["fla.ops"]
    for n in ("gated_delta_rule", "kda", "cp"):
        setattr(modules["fla.ops"], n, modules[f"fla.ops.{n}"])
    sys.modules.update(modules)


def uninstall() -> None:
    for n in NAMES:
        sys.modules.pop(n, None)
