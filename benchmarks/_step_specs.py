"""What ``benchmarks/step_gpu.py`` runs, without torch: run specs (a named stack, fields, or the
planner's pick), phases (one length, its runs, timed in turn), the schedule file that lists
them, the planner's JSON read as settings and a predicted step, and the depth arithmetic.

The depth arithmetic: a step timed at ``a`` and ``b`` decoder layers (``t_a``, ``t_b``) is
``fixed + layers x per_layer``, so

    per_layer = (t_b - t_a) / (b - a),   fixed = t_a - a x per_layer,
    t_full = fixed + full x per_layer

(``fixed``: embedding, final norm, the head and loss, the optimizer on their parameters). The
work of the step (:class:`arctic.plan.work.Work`, per class) extends the same way.

The planner (``python -m arctic.plan ... --json F``) writes ``F["estimate"]["sp"]``, the
:class:`arctic.SequenceParallelConfig` fields of its pick, and ``F["estimate"]["predicted"]``:
``step_s``, ``tokens_per_s``, ``mfu`` and ``by_class_s`` (seconds per work class) of the
full-depth model on the real job.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORK_CLASSES = ("attention_fwd", "attention_bwd", "gemm", "memory", "host_copy", "host_restore",
                "collective", "ops")
"""The classes of :class:`arctic.plan.work.Work` (and of the planner's ``by_class_s``)."""
EXECUTED = ("attention_fwd", "attention_bwd", "gemm")
"""The classes whose sum is ``Work.flops``, the FLOPs a step executed."""


# --- the planner's JSON ---------------------------------------------------------------------

def planned_fields(record: dict) -> dict:
    """The SequenceParallelConfig fields of a planner JSON (``["estimate"]["sp"]``), or of a
    plain dict of fields (no ``"estimate"`` key). ``ValueError`` when neither."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "estimate" not in record:
        if not all(isinstance(k, str) for k in record) or any(
                isinstance(v, dict) for v in record.values()):
            raise ValueError(f"neither the planner's JSON (no 'estimate') nor a dict of "
                             f"SequenceParallelConfig fields: keys {sorted(record)}")
        return dict(record)
    sp = record["estimate"].get("sp") if isinstance(record["estimate"], dict) else None
    if not isinstance(sp, dict) or not sp:
        raise ValueError("the planner's JSON has no estimate.sp (the settings it picked)")
    return dict(sp)


def planned_prediction(record: dict) -> dict | None:
    """The planner's predicted full-depth step (``["estimate"]["predicted"]``), with
    ``less_collective_s``: the step without its communication (``step_s`` less
    ``by_class_s["collective"]``), what one rank on the fake process group can show. None
    when the JSON has no prediction; ``ValueError`` when it has a malformed one."""
    estimate = record.get("estimate") if isinstance(record, dict) else None
    predicted = estimate.get("predicted") if isinstance(estimate, dict) else None
    if predicted is None:
        return None
    try:
        step = float(predicted["step_s"])
        by_class = {k: float(v) for k, v in (predicted.get("by_class_s") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"the planner's estimate.predicted is malformed ({e!r}): "
                         f"{predicted!r}") from None
    if not step > 0:
        raise ValueError(f"the planner's predicted step_s must be > 0, got {step}")
    out = {"step_s": step, "by_class_s": by_class,
           "less_collective_s": step - by_class.get("collective", 0.0)}
    for key in ("tokens_per_s", "mfu"):
        if predicted.get(key) is not None:
            out[key] = float(predicted[key])
    return out


def read_plan(path: Path) -> tuple[dict, dict | None]:
    """(fields, prediction) of a planner JSON, or of a JSON of fields (no prediction)."""
    record = json.loads(Path(path).read_text())
    return planned_fields(record), planned_prediction(record)


# --- run specs, phases, the schedule ---------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class RunSpec:
    """One run of a phase: its settings come from ``stack`` (a name in ``arctic.plan.STACKS``),
    ``fields`` (SequenceParallelConfig fields), or ``plan`` (a planner JSON, read when the run
    is built; with ``plan_done``, after that file appears, and ``fallback``, a named stack,
    when the planner failed)."""

    label: str
    stack: str | None = None
    fields: dict | None = None
    plan: str | None = None
    plan_done: str | None = None
    """A file that appears when the planner has ended; its text is the planner's exit code."""
    fallback: str | None = None
    backend: str = "auto"
    """An attention backend, or "auto": the settings' own (the fastest for the device)."""

    def __post_init__(self) -> None:
        given = [k for k in ("stack", "fields", "plan") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"run {self.label!r}: give exactly one of stack, fields or plan, "
                             f"got {given or 'none'}")


@dataclass(kw_only=True, slots=True)
class Phase:
    """One length per rank; its runs are built, warmed and timed in turn."""

    tokens: str
    runs: list[RunSpec]
    kernels: bool = False
    """Also time each attention kernel alone at this length."""


def write_schedule(phases: list[Phase], path: Path) -> None:
    path.write_text(json.dumps([asdict(p) for p in phases], indent=1) + "\n")


def read_schedule(path: Path) -> list[Phase]:
    """The phases of a schedule file (a JSON list, as :func:`write_schedule` writes it)."""
    return [Phase(tokens=p["tokens"], kernels=p.get("kernels", False),
                  runs=[RunSpec(**r) for r in p["runs"]])
            for p in json.loads(Path(path).read_text())]


_LABEL = re.compile(r"^([A-Za-z][\w.-]*)=(.*)$", re.DOTALL)


def fields_spec(text: str, backend: str = "auto") -> RunSpec:
    """``--fields [LABEL=]JSON``: an inline JSON object, or the path of a JSON file (a dict of
    fields, or the planner's JSON: its ``estimate.sp``). Label: LABEL, else "planned" for a
    file and "fields" for an inline object."""
    m = _LABEL.match(text)
    label, value = (m.group(1), m.group(2)) if m else (None, text)
    if value.lstrip().startswith("{"):
        try:
            fields = planned_fields(json.loads(value))
        except json.JSONDecodeError as e:
            raise ValueError(f"--fields: not a JSON object: {e}") from None
        return RunSpec(label=label or "fields", fields=fields, backend=backend)
    if not Path(value).is_file():
        raise ValueError(f"--fields: {value!r} is neither a JSON object nor a file")
    return RunSpec(label=label or "planned", plan=value, backend=backend)


@dataclass(kw_only=True, slots=True)
class Settings:
    """A run spec resolved: the fields to build, where they came from, the planner's
    prediction when there is one."""

    fields: dict
    source: str
    predicted: dict | None = None
    plan_error: str = ""
    """Why the planner's pick could not be used (then ``source`` names the fallback)."""


def resolve(spec: RunSpec, stacks: dict[str, dict], *, deadline: float,
            poll_s: float = 1.0) -> Settings:
    """The settings of ``spec``: a named stack's fields, its own, or the planner's pick (after
    ``plan_done`` appears, until ``deadline``, a ``time.monotonic()``; then ``fallback``)."""
    if spec.stack is not None:
        return Settings(fields=dict(stacks[spec.stack]), source=f"stack {spec.stack}")
    if spec.fields is not None:
        return Settings(fields=dict(spec.fields), source="fields")
    problem = ""
    if spec.plan_done is not None:
        done = Path(spec.plan_done)
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(poll_s)
        if not done.exists():
            problem = "the planner had not ended by the deadline"
        elif done.read_text().strip() != "0":
            problem = f"the planner exited with {done.read_text().strip()}"
    if not problem:
        try:
            fields, predicted = read_plan(Path(spec.plan))
            return Settings(fields=fields, source="planner", predicted=predicted)
        except (OSError, ValueError) as e:
            problem = f"the planner's JSON: {e}"
    if spec.fallback is None:
        raise ValueError(f"run {spec.label!r}: {problem}")
    return Settings(fields=dict(stacks[spec.fallback]), source=f"stack {spec.fallback}",
                    plan_error=problem)


# --- depths ---------------------------------------------------------------------------------

def extrapolate(t_a: float, t_b: float, a: int, b: int, full: int) -> dict:
    """Per-layer and fixed time from steps at ``a`` and ``b`` layers, and the step at ``full``
    layers (see the module docstring)."""
    if not b > a >= 1:
        raise ValueError(f"depths must be 1 <= a < b, got a={a}, b={b}")
    per_layer = (t_b - t_a) / (b - a)
    fixed = t_a - a * per_layer
    return {"per_layer_s": per_layer, "fixed_s": fixed, "step_s": fixed + full * per_layer}


def extrapolate_work(w_a: dict, w_b: dict, a: int, b: int, full: int) -> dict:
    """Each work class at ``full`` layers, linear in the layer count as the time is."""
    return {k: w_a[k] + (w_b[k] - w_a[k]) / (b - a) * (full - a) for k in w_a}


def depth_entries(entries: list[dict], depths: list[int], full: int, full_model_flops,
                  peak_tflops) -> list[dict]:
    """Per (label, kernel) timed at both depths: per-layer, fixed and full-depth figures
    (:func:`extrapolate`); ``full_model_flops(entry)``: the full model's FLOPs."""
    a, b = depths
    out = []
    for e_a in (e for e in entries if e["layers"] == a):
        e_b = next((e for e in entries if e["layers"] == b and e["label"] == e_a["label"]
                    and e["backend"] == e_a["backend"]), None)
        if e_b is None or e_a["status"] != "timed" or e_b["status"] != "timed":
            continue
        d = {k: e_a[k] for k in ("label", "stack", "source", "backend", "kernel",
                                 "tokens_per_rank", "seq_len", "predicted", "plan_error")}
        d.update(layers=[a, b], full_layers=full,
                 **extrapolate(e_a["step_s"], e_b["step_s"], a, b, full))
        d["tokens_per_s_per_rank"] = e_a["tokens_per_rank"] / d["step_s"]
        d["model_flops"] = full_model_flops(e_a)
        if "max_memory_allocated" in e_b:
            d["max_memory_allocated"] = e_b["max_memory_allocated"]  # at the deeper depth
        if "work" in e_a and "work" in e_b:
            d["work"] = extrapolate_work(e_a["work"], e_b["work"], a, b, full)
            d["executed_flops"] = sum(d["work"][k] for k in EXECUTED)
        if peak_tflops and d["step_s"] > 0:
            d["mfu"] = d["model_flops"] / d["step_s"] / (peak_tflops * 1e12)
            if "executed_flops" in d:
                d["mfu_executed"] = d["executed_flops"] / d["step_s"] / (peak_tflops * 1e12)
        out.append(d)
    return out


@dataclass(kw_only=True, slots=True)
class Deadline:
    """A wall-clock budget from its creation."""

    budget_s: float
    start: float = field(default_factory=time.monotonic)

    @property
    def at(self) -> float:
        return self.start + self.budget_s

    def left(self) -> float:
        return self.at - time.monotonic()
