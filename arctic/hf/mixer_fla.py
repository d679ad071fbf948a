"""flash-linear-attention's own context parallelism (``fla.ops.cp``, fla-core 0.6) for the
delta rules, where transformers resolved fla's kernel for the model's file.

fla's ``chunk_gated_delta_rule`` and ``chunk_kda`` take ``cp_context=`` (from
``fla.ops.cp.build_cp_context``: the CP group, the global ``cu_seqlens`` and the layout) and
then pass the state between the ranks themselves, packed documents included, in one kernel
call per rank. That call replaces :func:`ulysses.state_passing.state_scan` where fla's layout
is the mesh's:

- ``"contiguous"``: SP rank ``r`` holds positions ``[r s, (r + 1) s)`` (no ring, or a
  contiguous ring);
- ``"zigzag"``: SP rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` of ``2W`` (a zigzag ring
  without Ulysses).

Elsewhere (Ulysses x a zigzag ring, per-document rings, more than one row: fla's varlen
kernels take one row) the torch state passing runs, still with fla's kernel for each piece.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from arctic.hf.binding import module_function
from ulysses.mesh import flat_mesh, mesh_dims

FLA_SCANS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")
"""The model files' scans whose fla kernel (``chunk_gated_delta_rule``, ``chunk_kda``) takes a
``cp_context``."""


def resolved_kernel(function: Callable) -> Callable | None:
    """The implementation that transformers' hub-kernel wrapper
    (``use_kernel_func_from_hub_with_fallback``) resolved when the model's file was imported:
    the original package's function, or the torch fallback; None where ``function`` is not
    such a wrapper (or the ``kernels`` package's module of one: transformers 5.25)."""
    function = module_function(function)
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or closure is None:
        return None
    cell = dict(zip(code.co_freevars, closure)).get("implementation")
    try:
        return None if cell is None else cell.cell_contents
    except ValueError:  # an empty cell
        return None


def fla_kernel(scan_name: str, original: Callable) -> Callable | None:
    """fla's kernel behind the model file's scan ``original`` (named ``scan_name`` there),
    where it takes a ``cp_context``; None otherwise."""
    if scan_name not in FLA_SCANS:
        return None
    kernel = resolved_kernel(original)
    if kernel is None or not (getattr(kernel, "__module__", None) or "").startswith("fla."):
        return None
    try:
        takes = "cp_context" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return None
    return kernel if takes else None


def fla_layout(mesh: DeviceMesh) -> str | None:
    """fla's CP layout that the mesh's sequence layout is (over its flat SP group), or None:
    ``"contiguous"`` without a ring or on a contiguous one, ``"zigzag"`` on a zigzag ring
    without Ulysses (Ulysses splits each ring rank's chunk pair, which fla does not)."""
    dims = mesh_dims(mesh)
    if dims.per_document_ring:
        return None
    if dims.ring_degree == 1 or not dims.zigzag_ring:
        return "contiguous"
    return "zigzag" if dims.ulysses_degree == 1 else None


def fla_cp_scan(kernel: Callable, kind, inputs: Mapping[str, Tensor],
                params: Mapping[str, Tensor], options: Mapping[str, object], *,
                mesh: DeviceMesh, starts: Sequence[int], layout: str) -> Tensor:
    """The scan of the whole sequence at this rank's positions by fla's CP: one call of
    ``kernel`` on this rank's piece (``inputs``, one row, every head), the documents
    ``starts`` (the row's, whole sequence) as its global ``cu_seqlens``."""
    from fla.ops.cp import build_cp_context

    value = inputs[kind.output]
    group = flat_mesh(mesh, "sp").get_group()
    total = value.shape[1] * group.size()
    bounds = torch.tensor([*starts, total], dtype=torch.long)
    context = build_cp_context(bounds.to(value.device), group=group, cu_seqlens_cpu=bounds,
                               layout=layout)
    given = {**inputs, **params}
    out, _ = kind.call(kernel, given, **options, cp_context=context)
    return out


__all__ = ["FLA_SCANS", "fla_cp_scan", "fla_kernel", "fla_layout", "resolved_kernel"]
