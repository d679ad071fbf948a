"""The machinery of ``gpu_acceptance.py``: the report's rows, the wall-clock budget, the runner
that kills a step with its process group at its limit, what the steps share, pytest's output
read as rows, and the markdown and JSON report."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # arctic and ulysses: the device tool's tree is not installed

Status = Literal["passed", "failed", "skipped", "timed out", "not run"]
RESERVE_S, MIN_STEP_S = 15.0, 20.0
"""Kept for writing the results; the least time worth starting a step with."""


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of the report."""

    group: str
    name: str
    status: Status
    reason: str = ""
    """Why it was skipped, failed, timed out or not run."""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    """The key figures, short strings or numbers by name."""
    command: str = ""
    tail: str = ""
    """The end of the subprocess's output when it failed or timed out."""


class Budget:
    """One wall-clock budget for every step: a step's timeout is its own cap or what is left
    less ``reserve_s`` (for writing the results), whichever is smaller."""

    def __init__(self, total_s: float, reserve_s: float = RESERVE_S):
        self.total_s, self.reserve_s = total_s, reserve_s
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def limit(self, cap_s: float) -> float:
        return min(cap_s, self.total_s - self.elapsed() - self.reserve_s)


@dataclass(kw_only=True, slots=True)
class Ran:
    """What one subprocess did. ``rc`` is None when it was killed at its limit or never ran."""

    command: str
    rc: int | None
    seconds: float
    output: str
    limit_s: float
    not_run: str = ""

    @property
    def timed_out(self) -> bool:
        return self.rc is None and not self.not_run

    def early_row(self, group: str, name: str) -> Row | None:
        """The row of a step that did not finish, or None when there is output to read."""
        if self.not_run:
            return Row(group=group, name=name, status="not run", reason=self.not_run,
                       command=self.command)
        if self.timed_out:
            return Row(group=group, name=name, status="timed out", seconds=self.seconds,
                       reason=f"killed at its {self.limit_s:.0f} s limit",
                       command=self.command, tail=self.output[-2000:])
        return None

    def failed_row(self, group: str, name: str, why: str) -> Row:
        return Row(group=group, name=name, status="failed", reason=why, seconds=self.seconds,
                   command=self.command, tail=self.output[-2000:])


class Runner:
    """Runs commands in the repository root under the budget; appends their output to ``log``."""

    def __init__(self, budget: Budget, env: dict[str, str], log: Path, min_s: float = MIN_STEP_S):
        self.budget, self.env, self.log, self.min_s = budget, env, log, min_s

    def run(self, cmd: list[str], cap_s: float) -> Ran:
        text = shlex.join(cmd)
        limit = self.budget.limit(cap_s)
        if limit < self.min_s:
            return Ran(command=text, rc=None, seconds=0.0, output="", limit_s=limit,
                       not_run=f"budget spent: {max(limit, 0):.0f} s left for it after "
                               f"{self.budget.elapsed():.0f} of {self.budget.total_s:.0f} s, "
                               f"under the {self.min_s:.0f} s a step needs")
        # Output to a file, not a pipe: a grandchild that outlives a killed child would hold
        # a pipe open. A new session, so the timeout kills the child's whole process group.
        with tempfile.TemporaryFile() as out:
            start = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                rc = None
            seconds = round(time.monotonic() - start, 1)
            out.seek(0)
            output = out.read().decode("utf-8", "replace")
        with self.log.open("a") as f:
            f.write(f"$ {text}\n[rc {rc}, {seconds:.1f} s of {limit:.0f}]\n{output}\n")
        return Ran(command=text, rc=rc, seconds=seconds, output=output, limit_s=limit)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this runner started, SIGKILL if it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(kw_only=True, slots=True)
class Context:
    """What the steps share."""

    args: argparse.Namespace
    runner: Runner
    tmp: Path
    gpu_memory: int
    """The card's memory in bytes (the planner's --gpu-memory)."""
    planners: object = None
    """The step group's planner runs, started before the checks (``_acceptance_step``)."""


# --- pytest output ----------------------------------------------------------------------------

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
_SUMMARY = re.compile(r"\bin \d+(\.\d+)?s\b")
_SKIP = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$")


def parse_pytest_summary(output: str) -> dict[str, int] | None:
    """The counts of pytest's last summary line ("1 failed, 2 passed in 1.00s"); None if the
    output has none (pytest crashed or was killed)."""
    for line in reversed(output.splitlines()):
        line = line.strip("= \t")
        if not _SUMMARY.search(line) or not (_COUNT.search(line) or "no tests ran" in line):
            continue
        counts = dict.fromkeys(("passed", "failed", "skipped", "error", "xfailed", "xpassed",
                                "deselected"), 0)
        for n, kind in _COUNT.findall(line):
            counts["error" if kind.startswith("error") else kind] = int(n)
        return counts
    return None


def skip_reasons(output: str) -> dict[str, int]:
    """pytest -rs's skip reasons, with how many tests each skipped."""
    reasons: dict[str, int] = {}
    for line in output.splitlines():
        m = _SKIP.match(line)
        if m:
            reasons[m.group(2)] = reasons.get(m.group(2), 0) + int(m.group(1))
    return reasons


def pytest_row(name: str, ran: Ran) -> Row:
    """A pytest run's row: failed on a failure or error, skipped when nothing but skips ran."""
    counts = parse_pytest_summary(ran.output)
    if counts is None:
        return ran.failed_row("tests", name, f"no pytest summary (rc {ran.rc})")
    reasons = skip_reasons(ran.output)
    figures = {k: v for k, v in counts.items() if v}
    if reasons:
        figures["skips"] = "; ".join(f"{n}x {r}" for r, n in reasons.items())
    if counts["failed"] or counts["error"] or ran.rc not in (0, 5):
        row = ran.failed_row("tests", name, f"{counts['failed']} failed, {counts['error']} "
                                            f"errors (rc {ran.rc})")
        row.figures = figures
        return row
    ran_any = counts["passed"] + counts["xfailed"] + counts["xpassed"]
    status: Status = "passed" if ran_any else "skipped"
    reason = "" if ran_any else ("; ".join(reasons) or "no tests collected")
    return Row(group="tests", name=name, status=status, reason=reason, seconds=ran.seconds,
               figures=figures, command=ran.command)


# --- report -----------------------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(header: dict, rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in get_args(Status)}
    lines = [f"# GPU acceptance: {header['device']}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k != "device"]
    lines += ["- " + ", ".join(f"{v} {k}" for k, v in counts.items()), "",
              "| group | item | status | s | key figures |", "|---|---|---|---|---|"]
    for r in rows:
        status = f"{r.status}: {r.reason}" if r.reason else r.status
        figures = "; ".join(f"{k} {v}" for k, v in r.figures.items())
        lines.append(f"| {r.group} | {_cell(r.name)} | {_cell(status)} | {r.seconds:.1f} | "
                     f"{_cell(figures)} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, header: dict, rows: list[Row]) -> list[Path]:
    """The JSON and the markdown table (same stem); copies under ``$OUT`` when it is set."""
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(r.status == s for r in rows) for s in get_args(Status)}
    out.write_text(json.dumps({"header": header, "summary": counts,
                               "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    table = out.with_suffix(".md")
    table.write_text(markdown(header, rows))
    written = [out, table] + [p for p in [out.with_suffix(".log")] if p.exists()]
    if os.environ.get("OUT"):
        for p in written:
            shutil.copy(p, Path(os.environ["OUT"]) / p.name)
    return written


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
