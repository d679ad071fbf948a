"""A HF mixer's scan by state passing (:mod:`ulysses.state_passing`): the model's own scan
function runs on this rank's piece, every head, from the state the earlier pieces leave.

The scan is the one transformers resolved for the model's file (its torch fallback on CPU);
it takes an initial state and returns its final one (``initial_state`` /
``output_final_state`` for the delta rules, ``initial_states`` / ``return_final_states`` for
Mamba2's SSD, whose ``[B, H, P, N]`` state is the delta rules' ``[B, H, K, V]`` transposed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ulysses.mesh import flat_mesh
from ulysses.mixers import Documents, sp_runs, traced_scan
from ulysses.sharding import sp_rank_of
from ulysses.state_passing import state_scan
from ulysses.trace_shortcuts import is_traced


class _PieceScan:
    """:data:`ulysses.state_passing.Scan` over the model's scan function ``original``."""

    def __init__(self, kind, original: Callable, inputs: Mapping[str, Tensor],
                 params: Mapping[str, Tensor], options: Mapping[str, object]) -> None:
        self.kind, self.original = kind, original
        self.inputs, self.params, self.options = inputs, params, options
        self.key_dim = inputs[kind.state_key].shape[-1]

    def __call__(self, rows: slice, positions: slice, value: Tensor | None,
                 initial: Tensor | None) -> tuple[Tensor, Tensor]:
        kind = self.kind
        given = {n: t[rows, positions] for n, t in self.inputs.items()}
        if value is not None:
            given[kind.output] = value
        out_like = given[kind.output]
        if is_traced(out_like):  # the planner's trace: the GPU kernel's allocations
            out = traced_scan(given, out=kind.output, key=kind.state_key,
                              heads=out_like.shape[2])
            b, _, H, V = out_like.shape
            return out, out_like.new_empty(b, H, self.key_dim, V)
        if initial is not None and kind.value_first:
            initial = initial.transpose(-1, -2)
        given.update(self.params)
        out, final = self.original(*(given[n] for n in kind.positional),
                                   **{n: v for n, v in given.items()
                                      if n not in kind.positional},
                                   **self.options, **{kind.initial: initial, kind.final: True})
        return out, (final.transpose(-1, -2) if kind.value_first else final)


def passed_scan(kind, original: Callable, inputs: Mapping[str, Tensor],
                params: Mapping[str, Tensor], options: Mapping[str, object], *,
                mesh: DeviceMesh, documents: Documents) -> Tensor:
    """The scan of the whole sequence at this rank's positions: ``inputs`` (the scan's
    sequence inputs, this rank's piece, every head), ``params`` (its per-head parameters,
    whole), ``options`` (its other arguments), over the mesh's SP ranks (ring x Ulysses, in
    its sequence layout)."""
    scan = _PieceScan(kind, original, inputs, params, options)
    value = inputs[kind.output]
    runs = sp_runs(mesh, value.shape[1])
    return state_scan(scan, value, group=flat_mesh(mesh, "sp").get_group(),
                      rank=sp_rank_of(mesh), world=len(runs), runs=runs, documents=documents)


__all__ = ["passed_scan"]
