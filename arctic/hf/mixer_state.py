"""A HF mixer's scan by state passing (:mod:`ulysses.state_passing`): the model's own scan
function runs on this rank's piece, every head, from the state the earlier pieces leave.

The scan is the one transformers resolved for the model's file (its torch fallback on CPU).
The delta rules and Mamba2's SSD take an initial state and return their final one
(``initial_state`` / ``output_final_state``; ``initial_states`` / ``return_final_states``,
whose ``[B, H, P, N]`` state is the delta rules' ``[B, H, K, V]`` transposed). Mamba1's
selective scan takes none: :class:`SelectiveStates` computes the incoming state's term beside
it. Where transformers resolved flash-linear-attention's delta-rule kernels, fla's own
context parallelism runs instead, in one call (:mod:`arctic.hf.mixer_fla`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from arctic.hf.mixer_fla import fla_cp_scan, fla_kernel, fla_layout
from ulysses.mesh import flat_mesh
from ulysses.mixers import Documents, row_runs, traced_scan
from ulysses.packing import Span, batched
from ulysses.sharding import sp_rank_of
from ulysses.state_passing import MatrixStates, Piece, state_scan
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
        given = {n: t[rows, positions] for n, t in self.inputs.items()}
        if value is not None:
            given[self.kind.output] = value
        if initial is not None and self.kind.value_first:
            initial = initial.transpose(-1, -2)
        return self._run(given, initial, True)

    def outputs(self, spans: Sequence[Span]) -> list[Tensor]:
        return batched(lambda **given: self._run(given, None, False)[0], self.inputs, spans)

    def _run(self, given: dict, initial: Tensor | None,
             final: bool) -> tuple[Tensor, Tensor | None]:
        kind = self.kind
        out_like = given[kind.output]
        if is_traced(out_like):  # the planner's trace: the GPU kernel's allocations
            b, _, H, V = out_like.shape
            if not final:
                return traced_scan(given, out=kind.output, key=kind.state_key, heads=H), None
            return traced_scan(given, out=kind.output, key=kind.state_key, heads=H,
                               initial=initial, final=(b, H, self.key_dim, V))
        given = {**given, **self.params}
        result = kind.call(self.original, given, **self.options,
                           **({kind.initial: initial, kind.final: True} if final else {}))
        if not final:
            return (result[0] if kind.returns_state else result), None
        out, state = result
        return out, (state.transpose(-1, -2) if kind.value_first else state)


FIX_ELEMENTS = 2**24
"""The most ``[b, C, t, N]`` elements :class:`SelectiveStates` holds at once for the incoming
state's term; longer runs go in position chunks, each recomputed in the backward."""


class SelectiveStates:
    """:class:`ulysses.state_passing.PieceStates` of Mamba1's selective scan (``original``, the
    model file's): per channel ``c`` and state entry ``n``, ``h(t) = exp(dt(t) A[c, n]) h(t-1)
    + dt(t) B_n(t) x_c(t)``, read out ``y_c(t) = sum_n C_n(t) h(t)`` (+ ``D x``). The
    transition is diagonal: a state ``S`` entering a run adds ``sum_n C_n(t) exp(A[c, n]
    T_c(t)) S[c, n]`` to its output, ``T`` the sum of the steps ``dt`` so far, and leaves
    ``exp(A T_c(end)) S`` beside the run's own final state. The scan runs as it is, from a
    zero state (it takes no other); that term is computed here in float32. Outputs come
    ``[b, n, C]``, before the gate ``z``, which the caller applies."""

    def __init__(self, kind, original: Callable, inputs: Mapping[str, Tensor],
                 params: Mapping[str, Tensor], options: Mapping[str, object]) -> None:
        self.kind, self.original, self.options = kind, original, options
        self.inputs, self.params = inputs, params
        C, N = params["A"].shape
        self.state_shape = self.phi_shape = (C, N)

    def piece(self, rows: slice, positions: slice, continues: bool) -> Piece:
        kind = self.kind
        given = {n: t[rows, :, positions] for n, t in self.inputs.items()}
        x = given[kind.output]
        b, C, n = x.shape
        if is_traced(x):  # the planner's trace: the GPU kernel's allocations
            out, final = self._traced(given, final=(b, *self.state_shape))
            given.update(self.params)
        else:
            given.update(self.params)
            out, final = kind.call(self.original, given, **self.options, **{kind.final: True})
            out = out.transpose(1, 2)
        if not continues:
            return Piece(out, None, final, None)
        dt = given["dt"].float()
        if given.get("delta_bias") is not None:
            dt = dt + given["delta_bias"].float()[:, None]
        if self.options.get("delta_softplus"):
            dt = F.softplus(dt)
        steps = dt.cumsum(-1)  # [b, C, n]
        A, read = given["A"].float(), given["C"]
        phi = torch.exp(A * steps[..., -1:])
        return Piece(out, lambda state: _incoming_term(A, steps, read, state).to(out.dtype),
                     final, phi)

    def outputs(self, spans: Sequence[Span]) -> list[Tensor]:
        kind = self.kind

        def scan(**given):
            if is_traced(given[kind.output]):
                return self._traced(given).transpose(1, 2)
            given.update(self.params)
            return kind.call(self.original, given, **self.options)

        return [o.transpose(1, 2) for o in batched(scan, self.inputs, spans, dim=-1)]

    def from_state(self, rows: slice, positions: slice, state: Tensor) -> tuple[Tensor, Tensor]:
        p = self.piece(rows, positions, True)
        return p.out + p.fix(state), self.carry(p.phi, state) + p.final.float()

    def _traced(self, given: Mapping[str, Tensor], final: tuple[int, ...] | None = None):
        """The planner's trace of the scan on ``given`` (channels first): the GPU kernel's
        allocations (:func:`ulysses.mixers.traced_scan`); the output ``[b, n, C]``, and with
        ``final`` (its shape) the final state, which depends on ``given``."""
        kind = self.kind
        traced = {k: t.transpose(1, 2).unsqueeze(2 if k in kind.grouped else -1)
                  for k, t in given.items()}
        out = traced_scan(traced, out=kind.output, key=kind.state_key,
                          heads=given[kind.output].shape[1], final=final)
        return out.squeeze(-1) if final is None else (out[0].squeeze(-1), out[1])

    @staticmethod
    def carry(phi: Tensor, state: Tensor) -> Tensor:
        return phi * state


def _incoming_term(A: Tensor, steps: Tensor, read: Tensor, state: Tensor) -> Tensor:
    """``sum_n read_n(t) exp(A[c, n] steps_c(t)) state[c, n]``, ``[b, t, C]``, in position
    chunks of at most :data:`FIX_ELEMENTS` (each recomputed in the backward)."""
    def term(steps_t, read_t, state):
        decay = torch.exp(A[None, :, None, :] * steps_t[..., None])  # [b, C, t, N]
        return torch.einsum("bnt,bctn->btc", read_t.float(), decay * state[:, :, None, :])

    b, C, n = steps.shape
    chunk = max(1, FIX_ELEMENTS // (b * C * A.shape[-1]))
    if chunk >= n:
        return term(steps, read, state)
    return torch.cat([checkpoint(term, steps[..., i:i + chunk], read[..., i:i + chunk], state,
                                 use_reentrant=False) for i in range(0, n, chunk)], dim=1)


def passed_scan(kind, original: Callable, inputs: Mapping[str, Tensor],
                params: Mapping[str, Tensor], options: Mapping[str, object], *,
                mesh: DeviceMesh, documents: Documents) -> Tensor:
    """The scan of the whole sequence at this rank's positions: ``inputs`` (the scan's
    sequence inputs, this rank's piece, every head; Mamba1's gate ``z`` among them),
    ``params`` (its per-head parameters, whole), ``options`` (its other arguments), over the
    mesh's SP ranks (ring x Ulysses, in its sequence layout): by fla's own context
    parallelism where transformers resolved fla's kernel and the layout is one of fla's
    (:mod:`arctic.hf.mixer_fla`), else by :func:`ulysses.state_passing.state_scan`."""
    value = inputs[kind.output]
    B, s = value.shape[0], value.shape[-1 if kind.channels_first else 1]
    runs = row_runs(mesh, s, B, documents)
    kernel = fla_kernel(kind.scan, original) if B == 1 and not is_traced(value) else None
    layout = fla_layout(mesh) if kernel is not None else None
    if layout is not None:  # fla's own CP: one call, its documents as cu_seqlens
        return fla_cp_scan(kernel, kind, inputs, params, options, mesh=mesh,
                           starts=(0,) if documents is None else documents[0], layout=layout)
    states, finish = piece_states(kind, original, inputs, params, options)
    return finish(state_scan(states, B, group=flat_mesh(mesh, "sp").get_group(),
                             rank=sp_rank_of(mesh), world=len(runs[0]), runs=runs,
                             documents=documents))


def piece_states(kind, original: Callable, inputs: Mapping[str, Tensor],
                 params: Mapping[str, Tensor], options: Mapping[str, object]):
    """The :class:`ulysses.state_passing.PieceStates` of the scan ``original`` on ``inputs``
    (this rank's piece, or a chunk of it), and what makes its ``[B, s, ...]`` outputs the
    scan's own (Mamba1: channels first, its gate ``z`` applied)."""
    if not kind.diagonal:
        return MatrixStates(_PieceScan(kind, original, inputs, params, options),
                            inputs[kind.output]), lambda out: out
    inputs = dict(inputs)
    gate = inputs.pop(kind.gate, None)

    def finish(out: Tensor) -> Tensor:
        out = out.transpose(1, 2)
        return out if gate is None else out * F.silu(gate)

    return SelectiveStates(kind, original, inputs, params, options), finish


__all__ = ["FIX_ELEMENTS", "SelectiveStates", "passed_scan", "piece_states"]
