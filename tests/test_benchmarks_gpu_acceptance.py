"""``benchmarks/gpu_acceptance.py`` without a GPU: its dry run lists every step, it refuses to
run without CUDA, pytest's summaries and the backend grid's results become the right rows, the
report holds every status, the budget kills a step (with its children) at its limit, the step
group's planner runs, rows and verdicts, and the carried wheels fit the device tool."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30
# The command imports its siblings from benchmarks/, its directory when it runs as a script;
# appended, so that the other benchmarks' modules shadow nothing.
sys.path.append(str(REPO / "benchmarks"))

import gpu_acceptance as ga  # noqa: E402
from _acceptance_checks import (SOFTCAP_CASES, SYMMETRIC_CASE, WINDOW_CASE, caps,  # noqa: E402
                                cuda_test_files, grid_backends, grid_case, grid_cases,
                                grid_rows)
from _acceptance_step import (PlannerQueue, measurement_rows, mfu_verdict,  # noqa: E402
                              plan_jobs, plan_path, plan_workers, planner_rows, rates_of,
                              schedule, speed_verdict, step_record_rows)
from _acceptance_runner import (Budget, Ran, Row, Runner, parse_pytest_summary,  # noqa: E402
                                pytest_row, write_report)


def test_dry_run_lists_every_group_its_commands_and_the_grid(capsys, tmp_path):
    out = tmp_path / "report.json"
    assert ga.main(["--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for group in ga.GROUPS:
        assert f"\n== {group}\n" in text
    files = [str(p.relative_to(REPO)) for p in cuda_test_files()]
    assert "tests/test_ulysses_kernels_cuda.py" in files
    for name in files:
        assert f"-m pytest -q -rs {name}\n" in text
    for command in ("benchmarks/gpu_acceptance.py --grid-worker",
                    "benchmarks/offload_disk.py --device cuda",
                    "benchmarks/scale_gpu.py", "--seq-chunk 4", "--cap-gib CAP",
                    "-m arctic.plan --model llama3-8b --gpus 8 --seq-len 1048576 --gpu-memory "
                    "CARD_BYTES --rates RATES --quick --json",
                    "--seq-len 32768 --gpu-memory CARD_BYTES --rates RATES --quick --no-search "
                    "--stack ulysses --json",
                    "--seq-len 524288 --gpu-memory CARD_BYTES --rates RATES --quick --no-search "
                    "--stack alst --json",
                    "benchmarks/step_gpu.py --model llama3-8b --world 8 --depths 1 2 "
                    "--full-layers 32 --schedule", "--iters 3 --budget-s",
                    "    128K/rank: alst\n    16K/rank: ulysses + kernels alone\n"
                    "    8K/rank: ulysses\n    4K/rank: ulysses\n    128K/rank: ours\n"
                    "    16K/rank: ours\n    8K/rank: ours\n    4K/rank: ours\n"
                    "    64K/rank: alst\n    64K/rank: ours\n    64K/rank: ours (fa4)\n"
                    "    128K/rank: ours (fa4)\n    64K/rank: ulysses\n    128K/rank: ulysses\n"):
        assert command in text, command
    assert text.count("--rates RATES --quick") == 12  # ours at 5 lengths, the peers at 7
    # the step group (its verdict) before the long checks
    assert text.index("\n== backends") < text.index("\n== step") < text.index("\n== tests")
    backends = grid_backends()
    assert "math" not in backends and "cpu_flash" not in backends
    assert {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn"} <= set(backends)
    # backend x {bf16, fp16} x {64, 128} x (3 lengths x causal/full + the window with sinks
    # + softcap causal, full and windowed + the symmetric window)
    assert f"{len(backends) * 2 * 2 * 11} cases: {', '.join(backends)} x bf16, fp16" in text
    assert "lengths (45, 301, 1000)" in text and "window 37, sinks" in text
    assert "softcap 30 causal, full, windowed" in text and "symmetric window 37" in text
    assert not out.exists() and not out.with_suffix(".md").exists()


def test_only_leaves_the_other_groups_out(capsys):
    assert ga.main(["--dry-run", "--only", "fits"]) == 0
    text = capsys.readouterr().out
    assert "== tests: not chosen with --only" in text and "-m pytest" not in text
    assert "== fits\n" in text and "--cap-gib" in text


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ga.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--dry-run" in err


def test_cuda_test_files_are_the_ones_with_a_cuda_skip_marker(tmp_path):
    # Split in two, so that this file does not look like a CUDA test file itself.
    marker = "skip" "if(not torch.cuda.is_available(), reason='GPU')"
    (tmp_path / "test_gpu.py").write_text(f"@pytest.mark.{marker}\ndef test_x(): pass\n")
    (tmp_path / "test_module.py").write_text(f"pytestmark = pytest.mark.{marker}\n")
    (tmp_path / "test_cpu.py").write_text("device = 'cuda' if torch.cuda.is_available() else 0\n")
    (tmp_path / "helpers.py").write_text(f"@pytest.mark.{marker}\n")
    assert cuda_test_files(tmp_path) == [tmp_path / "test_gpu.py", tmp_path / "test_module.py"]
    assert REPO / "tests" / "test_benchmarks_gpu_acceptance.py" not in cuda_test_files()


@pytest.mark.parametrize("line,want", [
    ("12 passed, 3 skipped in 4.56s", dict(passed=12, skipped=3, failed=0)),
    ("1 failed, 2 passed in 1.00s", dict(passed=2, failed=1)),
    ("==== 1 failed, 2 passed, 1 warning in 1.00s ====", dict(passed=2, failed=1)),
    ("5 passed, 2 errors in 65.43s (0:01:05)", dict(passed=5, error=2)),
    ("no tests ran in 0.01s", dict(passed=0, failed=0, skipped=0)),
])
def test_pytest_summary_line(line, want):
    counts = parse_pytest_summary(f"tests/x.py ..F\nsome 3 passed words\n{line}\n")
    assert {k: counts[k] for k in want} == want


def test_no_summary_is_none():
    assert parse_pytest_summary("Traceback (most recent call last):\nImportError\n") is None


def _ran(output: str, rc: int | None = 0, **kw) -> Ran:
    return Ran(command="cmd", rc=rc, seconds=1.0, output=output, limit_s=60.0, **kw)


def test_pytest_rows_pass_fail_and_skip():
    skipped = pytest_row("f", _ran("SKIPPED [3] tests/f.py:20: needs a CUDA device\n"
                                   "3 skipped in 0.50s\n"))
    assert (skipped.status, skipped.reason) == ("skipped", "needs a CUDA device")
    passed = pytest_row("f", _ran("SKIPPED [1] tests/f.py:9: fa3 is not installed\n"
                                  "12 passed, 1 skipped in 4.56s\n"))
    assert passed.status == "passed" and passed.figures == {
        "passed": 12, "skipped": 1, "skips": "1x fa3 is not installed"}
    failed = pytest_row("f", _ran("1 failed, 2 passed in 1.00s\n", rc=1))
    assert failed.status == "failed" and failed.figures["failed"] == 1
    crashed = pytest_row("f", _ran("Segmentation fault\n", rc=-11))
    assert (crashed.status, crashed.reason) == ("failed", "no pytest summary (rc -11)")


def _results(key: tuple, status: str, **fields) -> list[dict]:
    return [dict(c, status=status, **fields) for c in grid_cases()
            if (c["backend"], c["dtype"], c["head_dim"]) == key]


def test_grid_rows_per_backend_dtype_and_head_dim():
    ok, bad, skip, cut = (("sdpa_flash", "bf16", 64), ("sdpa_flash", "bf16", 128),
                          ("sdpa_flash", "fp16", 64), ("sdpa_flash", "fp16", 128))
    errors = dict(out=1e-3, dq=2e-3)
    results = _results(ok, "passed", errors=errors, tolerance=3e-2, seconds=0.01)
    results[0]["errors"] = dict(out=1e-3, dq=9e-3)
    failing = _results(bad, "passed", errors=errors, tolerance=3e-2, seconds=0.01)
    failing[3].update(status="failed", errors=dict(out=1e-3, dq=5e-2))
    results += failing + _results(skip, "skipped", reason="no kernel")
    results += _results(cut, "passed", errors=errors, tolerance=1e-2, seconds=0.01)[:3]
    killed = _ran("", rc=None)
    rows = {r.name: r for r in grid_rows(results, killed)}
    assert len(rows) == len(grid_cases()) // 11
    good = rows["sdpa_flash bf16 d64"]
    assert good.status == "passed" and good.figures["cases"] == "11/11 passed"
    assert good.figures["worst rel. error"] == "out 1.00e-03, dq 9.00e-03"
    wrong = rows["sdpa_flash bf16 d128"]
    assert wrong.status == "failed" and wrong.reason == "dq 5.00e-02 > 0.03 (S=301 full)"
    assert rows["sdpa_flash fp16 d64"].status == "skipped"
    assert rows["sdpa_flash fp16 d64"].reason == "no kernel"
    partial = rows["sdpa_flash fp16 d128"]
    assert partial.status == "timed out" and partial.reason.startswith("8 of 11 cases not reached")
    assert rows["sdpa_efficient bf16 d64"].status == "timed out"
    crashed = grid_rows(results, _ran("CUDA error", rc=1))
    assert [r.status for r in crashed][-1] == "failed"


def test_grid_case_skips_fails_and_passes():
    device, case = torch.device("cpu"), dict(grid_cases()[0], backend="math")

    def answer(ok):
        return lambda *a, **kw: dict(ok=ok, errors=dict(out=0.5), tolerance=0.1, seconds=0.0)

    def raises(error):
        def compare(*a, **kw):
            raise error
        return compare

    assert grid_case(case, device, answer(True))["status"] == "passed"
    assert grid_case(case, device, answer(False))["errors"] == dict(out=0.5)
    assert grid_case(case, device, raises(ValueError("no window")))["status"] == "skipped"
    assert grid_case(case, device, raises(RuntimeError("boom"))) == {
        "status": "failed", "reason": "RuntimeError: boom"}
    unknown = grid_case(dict(case, backend="nope"), device, answer(True))
    assert unknown["status"] == "skipped" and "unknown attention backend" in unknown["reason"]


def test_grid_case_calls_self_check_as_its_contract_says():
    """The real ``compare_with_reference`` on the CPU kernel: the keywords the worker passes."""
    from ulysses.self_check import compare_with_reference

    base = dict(grid_cases()[0], backend="cpu_flash", head_dim=64)
    plain = grid_case(base, torch.device("cpu"), compare_with_reference)
    assert plain["status"] == "passed" and {"out", "dq", "dk", "dv"} <= set(plain["errors"])
    windowed = grid_case({**base, **WINDOW_CASE, "seq_len": 45}, torch.device("cpu"),
                         compare_with_reference)
    assert windowed["status"] == "passed" and "dsinks" in windowed["errors"]
    seen = {}

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return compare_with_reference(*args, **kwargs)

    capped = grid_case({**base, **SOFTCAP_CASES[-1], "seq_len": 45}, torch.device("cpu"),
                       recording)
    assert capped["status"] == "passed" and seen["softcap"] == 30.0 and seen["sinks"]
    symmetric = grid_case({**base, **SYMMETRIC_CASE, "seq_len": 45}, torch.device("cpu"),
                          recording)
    assert symmetric["status"] == "passed" and seen["causal"] is False and seen["window"] == 37


def test_report_has_a_row_per_status(tmp_path, monkeypatch):
    copies = tmp_path / "device_out"
    copies.mkdir()
    monkeypatch.setenv("OUT", str(copies))
    rows = [Row(group="tests", name="a", status="passed", seconds=1.25,
                figures={"passed": 3}),
            Row(group="backends", name="b", status="failed", reason="dq 5e-2 > 3e-2"),
            Row(group="backends", name="c", status="skipped", reason="fa3 | not installed"),
            Row(group="step", name="d", status="timed out", reason="killed at 300 s"),
            Row(group="step", name="e", status="not run", reason="budget spent")]
    out = tmp_path / "gpu_acceptance_x.json"
    written = write_report(out, {"device": "Fake GPU", "torch": "2.x"}, rows)
    record = json.loads(out.read_text())
    assert record["summary"] == {"passed": 1, "failed": 1, "skipped": 1, "timed out": 1,
                                 "not run": 1}
    assert [r["status"] for r in record["rows"]] == [r.status for r in rows]
    table = out.with_suffix(".md").read_text()
    assert "| tests | a | passed | 1.2 | passed 3 |" in table
    assert "| backends | b | failed: dq 5e-2 > 3e-2 |" in table
    assert "| backends | c | skipped: fa3 \\| not installed |" in table
    assert "| step | e | not run: budget spent |" in table
    assert sorted(p.name for p in copies.iterdir()) == sorted(p.name for p in written)


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path):
    """The child and the grandchild it leaves holding the output both go at the limit."""
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
              "time.sleep(60)")
    runner = Runner(Budget(60, reserve_s=0), dict(os.environ), tmp_path / "log", min_s=0.5)
    start = time.monotonic()
    ran = runner.run([sys.executable, "-c", script], cap_s=3.0)
    assert time.monotonic() - start < 20
    assert ran.timed_out and "started" in ran.output
    row = ran.early_row("step", "slow")
    assert (row.status, row.reason) == ("timed out", "killed at its 3 s limit")
    pid = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie waiting for init
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "zombie" in status.read_text():
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the grandchild {pid} outlived the timeout")
    assert "[rc None," in (tmp_path / "log").read_text()


def test_a_spent_budget_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    budget = Budget(100, reserve_s=10)
    assert budget.limit(30) == 30 and 89 < budget.limit(1000) <= 90
    ran = Runner(Budget(10, reserve_s=10), dict(os.environ), tmp_path / "log").run(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], cap_s=60)
    row = ran.early_row("fits", "cap")
    assert row.status == "not run" and row.reason.startswith("budget spent")
    assert not marker.exists()


def test_caps_bracket_the_planners_verdict():
    """The fit cap is the smallest quarter GiB whose planner budget (less 5%, over the 1.12
    headroom) holds the peak; the other is under the peak itself."""
    peak, gpu = int(11.49 * GiB), 80 * GiB
    budget = int(gpu * 0.95 / 1.12)
    fit, oom = caps(peak, gpu, budget)
    assert (fit, oom) == (13.75, 10.25)
    assert fit * GiB * 0.95 / 1.12 >= peak > (fit - 0.25) * GiB * 0.95 / 1.12
    assert oom * GiB < peak


def test_every_wheel_is_pinned():
    pins = ga.constraint_pins()
    assert all(ga._norm(name) in pins for name in ga.WHEELS)


def test_the_wheel_set_carries_flash_attention_4_but_not_cutlass():
    """FlashAttention-4 and its small needs travel; CUTLASS's DSL (92 MiB a wheel) cannot."""
    assert ga.WHEELS["flash-attn-4"] == "flash_attn.cute"  # what ulysses.cuda_kernels imports
    assert {"quack-kernels", "apache-tvm-ffi", "torch-c-dlpack-ext", "einops",
            "typing_extensions"} <= set(ga.WHEELS)
    assert "nvidia-cutlass-dsl" in ga.NOT_CARRIED and "nvidia-cutlass-dsl" not in ga.WHEELS
    assert ga.CARRY_MIB == 64
    MiB = 1 << 20
    assert ga.carry_problem(12 * MiB, 5 * MiB) == ""
    assert ga.carry_problem(59 * MiB, 5 * MiB) == ""
    assert "make 65.0 MiB, over the 64 MiB" in ga.carry_problem(60 * MiB, 5 * MiB)
    assert ga.importable("json") and not ga.importable("no_such_package.cute")


def test_a_step_that_raises_becomes_a_failed_row():
    def step_rows(ctx):
        return [{}["runs"]]

    (row,) = ga.run_step("step", step_rows, ctx=None)
    assert (row.group, row.name, row.status) == ("step", "step_rows", "failed")
    assert row.reason == "gpu_acceptance.py raised KeyError: 'runs'"


# --- the step group ---------------------------------------------------------------------------

def _depth(label, tokens_k, step_s, mfu=None, backend="auto", **kw):
    d = {"label": label, "stack": None if label == "ours" else label, "source": "planner",
         "backend": backend, "kernel": "sdpa_cudnn", "tokens_per_rank": tokens_k * 1024,
         "seq_len": 8 * tokens_k * 1024, "predicted": None, "plan_error": "",
         "layers": [1, 2], "full_layers": 32, "per_layer_s": step_s / 33, "fixed_s": step_s / 33,
         "step_s": step_s, "tokens_per_s_per_rank": tokens_k * 1024 / step_s}
    if mfu is not None:
        d.update(mfu=mfu, mfu_executed=mfu * 1.3)
    d.update(kw)
    return d


def _run(label, tokens_k, layers, status, reason="", backend="auto"):
    return {"label": label, "backend": backend, "seq_len": 8 * tokens_k * 1024,
            "tokens_per_rank": tokens_k * 1024, "layers": layers, "status": status,
            "reason": reason}


def test_the_mfu_verdict():
    passed = mfu_verdict({"runs": [], "depth": [_depth("ours", 128, 300.0, mfu=0.412)]})
    assert passed.status == "passed" and passed.figures["MFU"] == "41.2%"
    assert passed.name == "verdict: ours' MFU at 128K/rank, 32 layers >= 40%"
    failed = mfu_verdict({"runs": [], "depth": [_depth("ours", 128, 330.0, mfu=0.38)]})
    assert (failed.status, failed.reason) == ("failed", "MFU 38.0% < 40%")
    other_length = mfu_verdict({"runs": [], "depth": [_depth("ours", 64, 80.0, mfu=0.5)]})
    assert other_length.status == "not run"
    oom = mfu_verdict({"runs": [_run("ours", 128, 1, "oom", "CUDA out of memory")],
                       "depth": []})
    assert oom.status == "failed" and oom.reason.startswith("out of memory at 1 layer")
    budget = mfu_verdict({"runs": [_run("ours", 128, 1, "not run", "--budget-s")], "depth": []})
    assert budget.status == "not run"


def test_the_speed_verdicts():
    record = {"runs": [], "depth": [_depth("ours", 128, 300.0), _depth("alst", 128, 310.0),
                                    _depth("ours", 4, 2.0), _depth("ulysses", 4, 1.97),
                                    _depth("ours", 8, 4.0), _depth("ulysses", 8, 3.8)]}
    faster = speed_verdict(record, "128K", "alst")
    assert faster.status == "passed" and faster.figures["ours / peer"] == round(310 / 300, 3)
    within_noise = speed_verdict(record, "4K", "ulysses")
    assert within_noise.status == "passed"  # 1.5% slower: inside the 2% allowance
    slower = speed_verdict(record, "8K", "ulysses")
    assert slower.status == "failed" and "1.053x slower than ulysses" in slower.reason
    record["runs"] = [_run("alst", 64, 1, "oom", "CUDA out of memory"),
                      _run("ours", 16, 1, "oom", "CUDA out of memory"),
                      _run("ulysses", 16, 1, "timed"), _run("ulysses", 16, 2, "timed")]
    record["depth"] += [_depth("ours", 64, 80.0), _depth("ulysses", 16, 9.0)]
    peer_oom = speed_verdict(record, "64K", "alst")
    assert peer_oom.status == "passed" and "out of memory" in peer_oom.reason
    ours_oom = speed_verdict(record, "16K", "ulysses")
    assert ours_oom.status == "failed" and "out of memory" in ours_oom.reason
    assert speed_verdict(record, "32K", "alst").status == "not run"


def test_measurement_rows_show_the_full_model_and_the_planners_prediction():
    predicted = {"step_s": 280.0, "less_collective_s": 262.5, "by_class_s": {}}
    record = {"depth": [_depth("ours", 128, 290.0, mfu=0.42, predicted=predicted,
                               max_memory_allocated=20 * GiB)],
              "runs": [_run("ours", 128, 1, "timed"), _run("ours", 128, 2, "timed"),
                       _run("ours", 128, 1, "skipped", "cannot import flash_attn.cute",
                            backend="fa4"),
                       _run("ulysses", 128, 1, "oom", "CUDA out of memory"),
                       _run("ulysses", 128, 2, "oom", "CUDA out of memory")]}
    ours, fa4, ulysses = measurement_rows(record)
    assert ours.name == "ours (sdpa_cudnn), 128K/rank, 32 layers" and ours.status == "passed"
    assert ours.figures["32-layer step s"] == 290.0 and ours.figures["MFU"] == "42.0%"
    assert ours.figures["predicted s"] == 280.0
    assert ours.figures["predicted less collective s"] == 262.5
    assert ours.figures["max alloc GiB at 2 layers"] == 20.0
    assert (fa4.name, fa4.status) == ("ours fa4, 128K/rank", "skipped")
    assert "flash_attn.cute" in fa4.reason
    assert ulysses.status == "skipped" and ulysses.reason.startswith("out of memory")
    rows = step_record_rows({**record, "kernels": [
        {"backend": "fa3", "skipped": "not installed", "seq_len": 131072},
        {"backend": "sdpa_cudnn", "seconds": 0.05, "tflops": 540.04, "seq_len": 131072}]})
    assert rows[0].name.startswith("verdict: ours' MFU") and rows[0].status == "passed"
    assert rows[-1].name == "kernel sdpa_cudnn alone, S=128K causal fwd+bwd"
    assert rows[-1].figures == {"TFLOP/s": 540.0}


def test_planner_rows_read_each_lengths_pick(tmp_path):
    ours = plan_path(tmp_path, "ours", "128K")
    ours.write_text(json.dumps({"estimate": {
        "sp": {"sequence_parallel_size": 8, "head_chunk_size": 1, "recompute_attention": False},
        "fits": True, "predicted": {"step_s": 280.0, "by_class_s": {"collective": 17.5}}}}))
    (tmp_path / f"{ours.name}.rc").write_text("0")
    alst = plan_path(tmp_path, "alst", "128K")
    (tmp_path / f"{alst.name}.rc").write_text("2")
    (tmp_path / f"{alst.name}.log").write_text("usage: ...\nerror: unrecognized arguments: "
                                              "--rates h100\n")
    no_prediction = plan_path(tmp_path, "ours", "16K")
    no_prediction.write_text(json.dumps({"estimate": {"sp": {}, "fits": True}}))
    (tmp_path / f"{no_prediction.name}.rc").write_text("0")
    rows = {r.name: r for r in planner_rows(tmp_path, {ours: 31.5})}
    first = rows["planner: ours at 128K/rank on 8 GPUs"]
    assert first.status == "passed" and first.seconds == 31.5
    assert first.figures["settings"] == ("sequence_parallel_size=8, head_chunk_size=1, "
                                         "recompute_attention=False")
    assert first.figures["predicted ours"] == "280.00 s (262.50 s without communication)"
    assert first.figures["predicted alst"] == ("planner rc 2: error: unrecognized arguments: "
                                               "--rates h100")
    short = rows["planner: ours at 16K/rank on 8 GPUs"]
    assert (short.status, short.reason) == ("failed", "the planner's JSON has no "
                                                      "estimate.predicted")
    late = rows["planner: ours at 64K/rank on 8 GPUs"]
    assert late.status == "failed" and "had not ended" in late.reason


def test_the_planner_queue_runs_in_order_and_marks_each_end(tmp_path):
    write = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'ok': 1}))"
    jobs = [([sys.executable, "-c", write, str(tmp_path / "a.json")], tmp_path / "a.json"),
            ([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "b.json"),
            ([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "c.json")]
    queue = PlannerQueue(jobs, dict(os.environ), REPO, cap_s=2.0).start()
    for _ in range(200):
        if (tmp_path / "c.json.rc").exists():
            break
        time.sleep(0.1)
    queue.stop()
    assert json.loads((tmp_path / "a.json").read_text()) == {"ok": 1}
    assert [(tmp_path / f"{n}.json.rc").read_text() for n in "abc"] == ["0", "3", "timeout"]
    assert set(queue.seconds) == {p for _, p in jobs}


def test_the_schedule_puts_the_verdicts_first_and_waits_for_the_planner(tmp_path):
    phases = schedule(tmp_path)
    verdicts = [(p.tokens, r.label) for p in phases[:10] for r in p.runs]
    assert verdicts == [("128K", "alst"), ("16K", "ulysses"), ("8K", "ulysses"),
                        ("4K", "ulysses"), ("128K", "ours"), ("16K", "ours"), ("8K", "ours"),
                        ("4K", "ours"), ("64K", "alst"), ("64K", "ours")]
    ours = phases[4].runs[0]
    assert ours.plan == str(plan_path(tmp_path, "ours", "128K"))
    assert (ours.plan_done, ours.fallback) == (f"{ours.plan}.rc", "ours")
    assert [p.tokens for p in phases if p.kernels] == ["16K"]
    assert {(p.tokens, r.backend) for p in phases for r in p.runs if r.backend != "auto"} == {
        ("64K", "fa4"), ("128K", "fa4")}
    jobs = [json for _, json in plan_jobs(tmp_path, "85899345920", "h100")]
    ours_order = [p.tokens for p in phases if p.runs[0].label == "ours"][:5]
    assert jobs[:5] == [plan_path(tmp_path, "ours", t) for t in ours_order]
    assert len(set(jobs)) == len(jobs) == 12
    assert rates_of("NVIDIA H200") == "h200" and rates_of("NVIDIA H100 80GB HBM3") == "h100"
    assert (plan_workers(16), plan_workers(2), plan_workers(None)) == (12, 2, 2)


@pytest.mark.slow  # the planner's CPU calibration measures for real (20-30 s)
def test_the_calibration_row_runs_the_planners_calibration_and_reports_its_rates(tmp_path):
    """The step group's last row runs ``python -m arctic.plan --calibrate`` (here on the CPU,
    one rank) and puts the measured rates in the report."""
    from types import SimpleNamespace

    from _acceptance_checks import calibrate_rows

    env = dict(os.environ, PYTHONPATH=str(REPO))
    ctx = SimpleNamespace(tmp=tmp_path, runner=Runner(Budget(300, reserve_s=0), env,
                                                      tmp_path / "log"))
    (row,) = calibrate_rows(ctx)
    assert row.status == "passed", (row.reason, row.tail)
    assert row.figures["backend"] == "cpu_flash"
    assert row.figures["GEMM TFLOP/s"] >= 0 and row.figures["us per op"] > 0
    rates = json.loads(row.figures["rates"])
    assert rates["gemm_flops"] > 0 and rates["name"] == "cpu"
