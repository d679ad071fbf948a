"""Sequence-parallel token mixers of HF hybrid models: the layers beside the attention layers
that mix tokens otherwise (gated delta nets: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid;
Kimi Linear's KDA; Mamba2: Nemotron-H, Bamba, GraniteMoeHybrid; gated short convolutions:
LFM2).

A mixer's forward is the model's own. Its per-token work (projections, gates, norms) runs on
this rank's piece of the sequence; its calls that mix tokens along the sequence, the causal
convolution and (gated delta nets) the chunked scan, are module-level functions of the
model's file (transformers resolves them at import to flash-linear-attention's and causal-conv1d's
kernels where installed, else to its torch fallback), called by the forward itself (5.24) or
by the file's helpers it calls (5.25's ``causal_conv1d_forward``, ``mamba2_scan_forward``),
which look them up in the file when called. Each is replaced in that file, once,
by a :class:`Dispatch`: outside a sequence-parallel mixer's forward it calls the function
as before; inside one (a ContextVar set by the forward, scoped to the call) it runs the
function through :func:`ulysses.mixers.causal_conv` (the previous rank's tail, each document
alone) or :func:`ulysses.mixers.head_scan` (head-sharded over the whole sequence).

:data:`FAMILIES` lists the mixer classes, by name, with the functions their forward calls.
A mixer whose forward did not make exactly those calls through us (another transformers
release, a kernel swapped in later) is refused after its forward, never used.
"""

from __future__ import annotations

import contextvars
import dis
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from arctic.hf.anatomy import is_recurrent, language_model, text_config
from arctic.hf.batch import BatchState
from arctic.hf.binding import module_function, of_module
from arctic.hf.features import classify, unknown_arguments_error
from arctic.hf.fused import INPUT_NORM
from arctic.hf.mixer_kinds import (FAMILIES, GATED_DELTA_NET, KIMI_DELTA_ATTENTION, MAMBA1,
                                   MAMBA2, SCAN_OPTIONS, SHORT_CONVOLUTION, MixerKind)
from arctic.hf.mixer_chunks import Chunk, chunk_conv, chunk_scan, chunked_forward
from arctic.hf.mixer_fla import fla_kernel, fla_layout
from arctic.hf.mixer_state import passed_scan
from ulysses.mesh import axis_size
from ulysses.mixers import causal_conv, check_mixer_heads, head_scan, traced_scan
from ulysses.patching import replace_method
from ulysses.sharding import valid_degrees
from ulysses.state_passing import MODES
from ulysses.trace_shortcuts import is_traced

MIXER_INERT = ("position_embeddings",)
"""Arguments a forward passes on to its mixing calls that they do not read: RoPE's cos/sin
(Zamba2's hybrid layers hand them to their Mamba2 mixer, whose ``**kwargs`` reach the
convolution; transformers' torch convolution swallows them, and so does ours)."""


@dataclass(slots=True)
class MixerSettings:
    """What one mixer module needs to run sequence-parallel."""

    mesh: DeviceMesh
    kind: MixerKind
    batch: BatchState
    loss_arguments: frozenset[str] = frozenset()
    passing: bool = False
    """The scan passes its state between the ranks' pieces; False: an all-to-all over
    heads."""
    chunk: int | None = None
    """``mixer_chunk``: the forward runs in sequence chunks of at most this many positions
    (:mod:`arctic.hf.mixer_chunks`); None: on the whole piece."""


@dataclass(slots=True)
class _Call:
    """One forward of a mixer: its settings, its documents, the calls made through us."""

    module: nn.Module
    sp: MixerSettings
    documents: object
    made: list[str] = field(default_factory=list)
    chunk: Chunk | None = None
    """The sequence chunk this forward runs on, and its pass (``mixer_chunk``)."""


_ACTIVE: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("sp_mixer", default=None)


class Dispatch:
    """A module-level function of a model's file: the original outside a sequence-parallel
    mixer's forward, the sequence-parallel form inside one."""

    def __init__(self, original: Callable, role: str) -> None:
        self.original, self.role = original, role

    def __call__(self, *args, **kwargs):
        call = _ACTIVE.get()
        if call is None:
            return self.original(*args, **kwargs)
        if self.role == "fused":  # the forward falls back to its convolution and scan
            return None
        call.made.append(self.role)
        run = _conv if self.role == "conv" else _scan
        return run(call, self.original, args, kwargs)


def _check_extra(call: _Call, kwargs: dict, where: str) -> None:
    """Keyword arguments the forward passed on (transformers' ``**kwargs``) that reach a
    mixing call: honoured (the documents: flash-attn's varlen arguments, which the batch
    state reads), inert, the loss's; refused when they ask for something, or unknown."""
    unknown = []
    for name, value in kwargs.items():
        if name in MIXER_INERT:
            continue
        kind = classify(name, call.sp.loss_arguments)
        if kind == "refused" and value is not None and value is not False:
            raise ValueError(f"{type(call.module).__name__}: {name}={value!r} reaches its "
                             f"{where}, which sequence parallelism does not implement")
        if kind is None:
            unknown.append(name)
    if unknown:
        raise unknown_arguments_error(type(call.module).__name__, unknown, f"its {where}")


def _conv(call: _Call, original, args, kwargs):
    x, weight = args[0], args[1] if len(args) > 1 else kwargs.pop("weight")
    rest = dict(kwargs)
    bias = args[2] if len(args) > 2 else rest.pop("bias", None)
    activation = args[3] if len(args) > 3 else rest.pop("activation", None)
    _check_extra(call, rest, "causal convolution")
    if call.chunk is not None:
        return chunk_conv(call.chunk, lambda t: original(t, weight, bias, activation=activation),
                          x, weight.shape[-1], call.documents)
    return causal_conv(lambda t: original(t, weight, bias, activation=activation), x,
                       weight.shape[-1], mesh=call.sp.mesh, documents=call.documents)


def _scan(call: _Call, original, args, kwargs):
    kind, kw = call.sp.kind, dict(kwargs)
    values = dict(zip(kind.positional, args))
    for n in kind.positional[len(args):]:
        values[n] = kw.pop(n)
    states = {n: kw.pop(n) for n in ("initial_state", "initial_states", "output_final_state",
                                      "return_final_states", "return_last_state") if n in kw}
    if any(v is not None and v is not False for v in states.values()):
        raise ValueError(f"{type(call.module).__name__}: a recurrent state in or out (a cache) "
                         f"is not supported under sequence parallelism; train with "
                         f"use_cache=False")
    per_head = {n: values[n] for n in kind.per_head}
    gate = kw.pop(kind.gate, None) if kind.gate else None
    if gate is not None:
        per_head[kind.gate] = gate
    if kw.pop("z", None) is not None:
        raise ValueError(f"{type(call.module).__name__}: a gate inside the scan (z) is not "
                         f"implemented under sequence parallelism")
    kw.pop("cu_seqlens", None)  # the documents, as the batch state has them
    options = {n: kw.pop(n) for n in SCAN_OPTIONS if n in kw}
    params = {n: kw.pop(n) for n in kind.head_params if n in kw}
    params.update({n: values.pop(n) for n in kind.head_params if n in values})
    _check_extra(call, kw, "scan")

    grouped = {n: values[n] for n in kind.grouped}
    if call.chunk is not None:
        return chunk_scan(call.chunk, kind, original, {**grouped, **per_head}, params, options,
                          call.documents)
    if call.sp.passing:
        out = passed_scan(kind, original, {**grouped, **per_head}, params, options,
                          mesh=call.sp.mesh, documents=call.documents)
        return (out, None) if kind.returns_state else out
    if kind.channels_first:  # [B, C, s] -> [B, s, C, 1]; [B, N, s] -> [B, s, 1, N]
        per_head = {n: t.transpose(1, 2).unsqueeze(-1) for n, t in per_head.items()}
        grouped = {n: t.transpose(1, 2).unsqueeze(2) for n, t in grouped.items()}

    def scan(*, heads: dict, **inputs):
        first = next(iter(inputs.values()))
        if is_traced(first):  # the planner's trace: the GPU kernel's allocations
            return traced_scan({**inputs, **heads}, out=kind.output, key=kind.state_key,
                               heads=inputs[kind.output].shape[2])
        if kind.channels_first:  # back to the scan's own layout, this rank's channels
            inputs = {n: t.squeeze(2 if n in kind.grouped else -1).transpose(1, 2)
                      for n, t in inputs.items()}
        result = kind.call(original, {**inputs, **heads}, **options)
        result = result[0] if kind.returns_state else result
        return result.transpose(1, 2).unsqueeze(-1) if kind.channels_first else result

    out = head_scan(scan, grouped, per_head, mesh=call.sp.mesh, documents=call.documents,
                    head_params={n: v for n, v in params.items() if v is not None})
    if kind.channels_first:
        out = out.squeeze(-1).transpose(1, 2)
    return (out, None) if kind.returns_state else out


def unreached_calls(cls: type) -> list[str]:
    """The sequence-mixing functions of ``cls``'s kind (:data:`FAMILIES`) that its installed
    forward does not call as module-level functions of its file, itself or through the
    file's own helper functions it calls (read off the bytecode: the names each loads as
    globals). transformers 5.24 calls both from the forward; 5.25 from helpers of the file
    (``causal_conv1d_forward``, ``mamba2_scan_forward``) that look them up there when called;
    older releases keep them on the instance or run an ``nn.Conv1d`` module instead, which
    sequence parallelism cannot reach. What a forward calls at run time is checked again
    after each call (:func:`_sp_mixer_forward`)."""
    kind = FAMILIES[cls.__name__]
    loaded = _globals_reached(cls.forward, sys.modules[cls.__module__], set())
    return [name for name in (kind.conv, kind.scan) if name and name not in loaded]


def _globals_reached(fn: Callable, file, seen: set[str]) -> set[str]:
    """The global names ``fn`` loads, with those of the functions of ``file`` it loads, and
    theirs (``seen``: the helpers already read)."""
    code = _function(fn)
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"} \
        if code is not None else set()
    reached = set(loaded)
    for name in sorted(loaded - seen):
        helper = _function(getattr(file, name, None))
        if helper is not None and helper.__module__ == file.__name__:
            seen.add(name)
            reached |= _globals_reached(helper, file, seen)
    return reached


def _function(value) -> Callable | None:
    """The plain function ``value`` runs: itself, under its declared wrappers
    (``functools.wraps``), or the one the ``kernels`` package's module of a function (what
    ``use_kernel_forward_from_hub`` makes of one, as transformers 5.25 does of its helpers)
    calls until it is kernelized; None for anything else (a class, a :class:`Dispatch`)."""
    for _ in range(8):  # wrappers around modules around wrappers
        value = module_function(value)
        if not (inspect.isfunction(value) and hasattr(value, "__wrapped__")):
            break
        value = value.__wrapped__
    return value if inspect.isfunction(value) else None


def _install_dispatch(module: nn.Module, kind: MixerKind) -> None:
    file = sys.modules[type(module).__module__]
    for role, name in (("conv", kind.conv), ("scan", kind.scan), ("fused", kind.fused)):
        if name is None:
            continue
        current = getattr(file, name, None)
        if current is None and role == "fused":
            continue  # no fused kernel in this file: nothing to pass over
        if current is None:
            raise ValueError(f"{type(module).__name__}: its file {file.__name__} has no "
                             f"{name!r} (transformers changed it); sequence parallelism "
                             f"cannot reach its {role}")
        if not isinstance(current, Dispatch):
            setattr(file, name, Dispatch(current, role))


def takes_input_norm(module: nn.Module) -> bool:
    """Whether ``module`` runs in sequence chunks (``mixer_chunk``), and so can norm its
    input a chunk at a time: the tiled layer (:mod:`arctic.tiling.layer`) then hands it the
    layer's input and its norm (:data:`arctic.hf.fused.INPUT_NORM`)."""
    sp = getattr(module, "sp_mixer", None)
    return isinstance(sp, MixerSettings) and sp.chunk is not None


def _sp_mixer_forward(module: nn.Module, *args, **kwargs):
    sp: MixerSettings = module.sp_mixer
    # The layer's input norm (an InputNorm), with the layer's input as the hidden states: each
    # chunk is normed inside its checkpoint, so the normed piece is never held whole.
    input_norm = kwargs.pop(INPUT_NORM, None)
    if input_norm is not None and sp.chunk is None:
        raise ValueError(f"{type(module).__name__} got {INPUT_NORM} without mixer_chunk: "
                         f"only a chunked mixer norms its input")
    bound = of_module(module).bind(args, kwargs)
    if bound.role("cache") is not None:
        raise ValueError(f"{type(module).__name__}: a cache is not supported under sequence "
                         f"parallelism (its state would be this rank's piece's); train with "
                         f"use_cache=False (or model.config.use_cache = False: with "
                         f"use_cache=True the model creates one)")
    if bound.role("attention_mask") is not None:
        raise ValueError(f"{type(module).__name__} got a padding mask; under sequence "
                         f"parallelism mark padding with labels=-100 and documents with "
                         f"position_ids (arctic.data does both)")
    documents = sp.batch.segments()

    def run(chunk: Chunk | None, *args, **kwargs):
        call = _Call(module, sp, documents, chunk=chunk)
        token = _ACTIVE.set(call)
        try:
            out = type(module).forward(module, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        if call.made != sp.kind.calls:
            raise ValueError(f"{type(module).__name__}'s forward made {call.made or 'none'} of "
                             f"its sequence-mixing calls through sequence parallelism, not its "
                             f"convolution then its scan (another transformers release, or a "
                             f"kernel installed after arctic.apply_sequence_parallel); its "
                             f"result would be this rank's piece alone")
        return out

    hidden = bound.first
    if input_norm is None and (sp.chunk is None or hidden.shape[1] <= sp.chunk):
        return run(None, *args, **kwargs)
    rest = {**bound.named, **bound.extra}
    normed = (lambda x: x) if input_norm is None else input_norm.fn
    if hidden.shape[1] <= sp.chunk:
        return run(None, normed(hidden), **rest)
    return chunked_forward(lambda x, chunk: run(chunk, normed(x), **rest), hidden,
                           kind=sp.kind, mesh=sp.mesh, documents=documents, size=sp.chunk)


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention",
                         "attention", "dense", "sparse", "moe", "mlp")
"""``config.layer_types`` entries whose layers mix tokens only through attention the SP
attention implements (global, sliding, Llama4's chunks) or not at all (MLP and MoE kinds)."""
MIXER_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid")
"""``config.layer_types`` entries whose layers hold a mixer of :data:`FAMILIES`."""


def check_token_mixers(model: nn.Module) -> None:
    """``ValueError`` when ``model`` mixes tokens along the sequence outside its attention in
    a layer that is not one of :data:`FAMILIES` (state-space, other linear-attention or
    convolution layers: Jamba, FalconH1, Bamba, LFM2, ...): sequence parallelism cuts the
    sequence for every layer, and such a layer would see only this rank's piece."""
    name = type(model).__name__
    supported = token_mixers(model)
    known = ATTENTION_LAYER_TYPES + (MIXER_LAYER_TYPES if supported else ())
    types = [t for t in getattr(text_config(model), "layer_types", None) or () if t not in known]
    if types:
        raise ValueError(f"{name}: config.layer_types has {sorted(set(types))} layers, which mix "
                         f"tokens outside attention in a way sequence parallelism does not "
                         f"implement (supported: {sorted(FAMILIES)}); under it they would see "
                         f"only this rank's piece of the sequence. Train it without sequence "
                         f"parallelism")
    inside = {id(p) for m in supported for p in m.modules()}
    named = list(language_model(model).named_modules())
    held = [path for path, m in named if id(m) in inside and type(m).__name__ in FAMILIES]
    for path, m in named:
        if id(m) in inside or any(h.startswith(path + ".") or not path for h in held):
            continue  # a supported mixer, a part of one, or a layer (a model) that holds one
        if isinstance(m, nn.Conv1d) or is_recurrent(m):
            raise ValueError(f"{name}: {path} ({type(m).__name__}) mixes tokens along the "
                             f"sequence outside attention (a state-space, linear-attention or "
                             f"convolution layer) and is not one sequence parallelism "
                             f"implements (supported: {sorted(FAMILIES)}); under it it would "
                             f"see only this rank's piece. Train it without sequence "
                             f"parallelism")


def token_mixers(model: nn.Module) -> list[nn.Module]:
    """The mixer modules of :data:`FAMILIES` in the model's text decoder."""
    return [m for m in language_model(model).modules() if type(m).__name__ in FAMILIES]


def mixer_passing(model: nn.Module, mesh: DeviceMesh, mode: str = "auto",
                  chunk: int | None = None) -> dict[nn.Module, bool]:
    """Per :func:`token_mixers` module of ``model``, whether its scan passes its state
    (``mode``: :data:`ulysses.state_passing.MODES`; ``chunk``, ``mixer_chunk``, needs it);
    ``ValueError`` (before any collective) for a mesh, head counts or a mode they cannot run
    on."""
    if mode not in MODES:
        raise ValueError(f"mixer_parallelism must be one of {list(MODES)}, got "
                         f"{mode!r}")
    mixers = token_mixers(model)
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"mixer_chunk must be a positive number of positions or None, "
                             f"got {chunk!r}")
        if not mixers:
            raise ValueError(f"mixer_chunk={chunk} would have no effect: "
                             f"{type(model).__name__} has no convolution or scan mixer (a "
                             f"gated delta net, KDA, Mamba or short-convolution layer); leave "
                             f"it None")
        if mode == "all_to_all":
            raise ValueError(f"mixer_chunk={chunk} runs the mixers' scans in chunks by passing "
                             f"their state; mixer_parallelism='all_to_all' scans each head "
                             f"over the whole sequence: use 'auto' or 'state_passing'")
    if mode != "auto" and not any(FAMILIES[type(m).__name__].scan for m in mixers):
        raise ValueError(f"mixer_parallelism={mode!r} would have no effect: "
                         f"{type(model).__name__} has no mixer with a scan (a gated delta "
                         f"net, KDA, Mamba2 or Mamba1 layer); leave it 'auto'")
    if not mixers:
        return {}
    degree, ring = axis_size(mesh, "ulysses"), axis_size(mesh, "ring")
    if ring > 1 and mode == "all_to_all":
        raise ValueError(f"{type(mixers[0]).__name__}: mixer_parallelism='all_to_all' runs "
                         f"under Ulysses only; on a ring (ring_degree={ring}) the mixers pass "
                         f"their state: use 'auto' or 'state_passing'")
    passing = {}
    for m in mixers:
        kind = FAMILIES[type(m).__name__]
        missing = unreached_calls(type(m))
        if missing:
            import transformers

            raise ValueError(f"{type(m).__name__}'s forward in transformers "
                             f"{transformers.__version__} does not call {missing} from its "
                             f"module (itself or through the module's own functions), as "
                             f"the releases whose {type(m).__name__} runs under sequence "
                             f"parallelism do (5.24, the tested release, and 5.25); install "
                             f"transformers 5.24.0, or train it without sequence parallelism")
        passing[m] = False
        if kind.scan is None:
            continue
        heads = (getattr(m, kind.num_heads),
                 getattr(m, kind.num_grouped) if kind.num_grouped else 1)
        auto_passes = kind.passes_state and (degree not in valid_degrees(*heads) or
                                             chunk is not None or _fla_cp_runs(m, kind, mesh))
        if mode == "state_passing" or ring > 1 or (mode == "auto" and auto_passes):
            if not kind.passes_state:
                raise ValueError(f"{type(m).__name__}: state passing (mixer_parallelism="
                                 f"'state_passing', or any ring) is not implemented for its "
                                 f"scan ({kind.scan}); use 'all_to_all' and ring_degree=1")
            passing[m] = True
        else:
            check_mixer_heads(type(m).__name__, *heads, degree)
    return passing


def _fla_cp_runs(module: nn.Module, kind: MixerKind, mesh: DeviceMesh) -> bool:
    """Whether ``module``'s scan would run by flash-linear-attention's own context
    parallelism (transformers resolved fla's kernel for its file, and the mesh's layout is
    one of fla's; :mod:`arctic.hf.mixer_fla`)."""
    current = getattr(sys.modules[type(module).__module__], kind.scan, None)
    current = current.original if isinstance(current, Dispatch) else current
    return current is not None and fla_kernel(kind.scan, current) is not None and \
        fla_layout(mesh) is not None


def install_mixers(model: nn.Module, mesh: DeviceMesh, batch: BatchState,
                   loss_arguments: frozenset[str], passing: dict[nn.Module, bool],
                   chunk: int | None = None) -> None:
    """Make every :func:`token_mixers` module of ``model`` sequence-parallel over ``mesh``,
    reading the documents from ``batch`` (the attention's); ``passing``: from
    :func:`mixer_passing`, called first; ``chunk``: ``mixer_chunk``."""
    for m in token_mixers(model):
        kind = FAMILIES[type(m).__name__]
        _install_dispatch(m, kind)
        m.sp_mixer = MixerSettings(mesh, kind, batch, loss_arguments, passing[m], chunk)
        replace_method(m, _sp_mixer_forward, bind=True)


__all__ = ["ATTENTION_LAYER_TYPES", "FAMILIES", "GATED_DELTA_NET", "KIMI_DELTA_ATTENTION",
           "MAMBA1", "MAMBA2", "MIXER_LAYER_TYPES", "SCAN_OPTIONS",
           "SHORT_CONVOLUTION", "Dispatch", "MixerKind", "MixerSettings", "check_token_mixers",
           "install_mixers", "mixer_passing", "token_mixers", "unreached_calls"]
