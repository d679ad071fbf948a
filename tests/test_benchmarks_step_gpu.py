"""``benchmarks/step_gpu.py`` runs end to end (here on CPU, one rank of two through the fake
process group, as it runs one rank of eight on a GPU) at two depths and extends them to the
full model; its work count is right (model FLOPs by the formula, attention by kernel call,
matrix products in place too, which torch's FlopCounterMode misses); the planner's JSON,
inline fields and schedules become the runs they name."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the benchmark builds HF models ([hf])")

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "benchmarks"))

from _step_specs import (Phase, RunSpec, depth_entries, extrapolate,  # noqa: E402
                         extrapolate_work, fields_spec, planned_fields, planned_prediction,
                         read_schedule, resolve, write_schedule)

OURS = {"sequence_parallel_size": 2, "head_chunk_size": 1, "fuse_projections": True,
        "tiled_mlp": "auto", "loss_tiles": "auto", "activation_checkpointing": True,
        "kernel_self_check": False}
"""The kernels' self-check at first use goes through the counted kernel calls (a 45-token
problem: nothing at a real length, 0.8% of this test's): off, so the counts are exact."""
KEPT = dict(OURS, tiled_layer=True, offload_activations=True, recompute_attention=False)
PREDICTED = {"step_s": 12.5, "tokens_per_s": 10486.0, "mfu": 0.41,
             "by_class_s": {"attention_fwd": 3.0, "attention_bwd": 6.0, "gemm": 2.0,
                            "memory": 0.5, "host_copy": 0.2, "collective": 0.75, "ops": 0.05}}


def _planner_json(path: Path, sp: dict = OURS, predicted: dict | None = PREDICTED) -> Path:
    estimate = {"seq_len": 1024, "sp": sp, "fits": True}
    if predicted is not None:
        estimate["predicted"] = predicted
    path.write_text(json.dumps({"model": "tiny-llama", "gpus": 2, "estimate": estimate}))
    return path


@pytest.mark.slow  # 2 ranks x 2 depths of the real step; its parts: the tests below
def test_step_benchmark_at_two_depths_counts_work_and_reads_the_planner(tmp_path):
    """A schedule as gpu_acceptance.py writes it: ours from the planner's JSON once its end
    is marked, beside inline fields."""
    out, schedule = tmp_path / "step.json", tmp_path / "schedule.json"
    plan = _planner_json(tmp_path / "plan.json")
    (tmp_path / "plan.json.rc").write_text("0")
    write_schedule([Phase(tokens="512", runs=[
        RunSpec(label="kept", fields=KEPT),
        RunSpec(label="ours", plan=str(plan), plan_done=f"{plan}.rc", fallback="ours")])],
        schedule)
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_gpu.py", "--model", "tiny-llama", "--world", "2",
         "--schedule", str(schedule), "--iters", "1", "--depths", "1", "2", "--full-layers", "4",
         "--dtype", "fp32", "--peak-tflops", "1", "--budget-s", "600", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    runs = {(r["label"], r["layers"]): r for r in record["runs"]}
    assert sorted(runs) == [("kept", 1), ("kept", 2), ("ours", 1), ("ours", 2)]
    assert all(r["status"] == "timed" and r["kernel"] == "cpu_flash" for r in runs.values())
    ours = runs[("ours", 1)]
    assert ours["source"] == "planner" and ours["fields"] == OURS
    assert runs[("kept", 1)]["source"] == "fields" and runs[("kept", 1)]["fields"] == KEPT
    # tiny-llama: E=128, I=256, 8 heads of 16, vocab 256, untied; S=1024 on 2 ranks: each
    # attention call is causal over S, (S+1)/2 key rows per query on average.
    E, I, V, S, s = 128, 256, 256, 1024, 512

    def model_flops(layers):
        params = layers * (E * (E + 2 * E // 2 + E) + 3 * E * I + 2 * E) + E + V * E
        return 6 * params * s + 3 * layers * 2 * S * S * E / 2

    # one layer's causal forward on this rank's 4 heads: 2 x S(S+1)/2 pairs x 4 x (16 + 16)
    attention = S * (S + 1) * 4 * 32
    for layers in (1, 2):
        full, kept = runs[("ours", layers)], runs[("kept", layers)]
        assert full["model_flops"] == kept["model_flops"] == model_flops(layers)
        # forward + recompute + backward (2.5 forwards) against forward + backward
        assert full["work"]["attention_fwd"] == pytest.approx(2 * attention * layers)
        assert full["work"]["attention_bwd"] == pytest.approx(2.5 * attention * layers)
        assert kept["work"]["attention_fwd"] == pytest.approx(attention * layers)
        assert kept["executed_flops"] < full["executed_flops"]
        assert full["work"]["gemm"] > 0 and full["work"]["collective"] > 0
        assert full["executed_flops"] == pytest.approx(
            sum(full["work"][k] for k in ("attention_fwd", "attention_bwd", "gemm")))
        assert 0 < full["mfu"] <= full["mfu_executed"]
    depth = {d["label"]: d for d in record["depth"]}
    d = depth["ours"]
    t1, t2 = runs[("ours", 1)]["step_s"], runs[("ours", 2)]["step_s"]
    assert d["per_layer_s"] == pytest.approx(t2 - t1)
    assert d["step_s"] == pytest.approx(t1 + 3 * (t2 - t1))
    assert d["model_flops"] == model_flops(4)
    assert d["work"]["attention_fwd"] == pytest.approx(2 * attention * 4)
    assert d["predicted"]["step_s"] == 12.5 and d["predicted"]["less_collective_s"] == 11.75
    assert depth["kept"]["predicted"] is None


def test_inplace_matrix_products_are_counted():
    """``addmm_`` (the fused projections' gradient accumulation): torch's FlopCounterMode
    counts nothing for it, ``count_work`` counts its 2 M N K."""
    from torch.utils.flop_counter import FlopCounterMode

    from arctic.plan.work import count_work

    M, N, K = 6, 5, 7
    acc, a, b = torch.zeros(M, N), torch.randn(M, K), torch.randn(K, N)
    with count_work() as work:
        acc.addmm_(a, b)
        torch.baddbmm(torch.zeros(2, M, N), a.expand(2, M, K), b.expand(2, K, N)).sum()
    assert work.gemm == 2 * M * N * K + 2 * 2 * M * N * K
    with FlopCounterMode(display=False) as counter:
        acc.addmm_(a, b)
    assert counter.get_total_flops() == 0


def test_a_fused_step_counts_the_inplace_products_flop_counter_misses():
    """One step of the ``ours`` stack (fused projections): the work's matrix products are
    FlopCounterMode's plus the in-place ones it skips, and those are not nothing."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from arctic.plan import (build, fake_world, init_optimizer_state, make_batch, model_config,
                             stack_config, train_step)
    from arctic.plan.work import count_work

    inplace = {torch.ops.aten.addmm_.default, torch.ops.aten.baddbmm_.default}

    class InPlace(TorchDispatchMode):
        flops = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in inplace:
                out, m1, m2 = args[:3]
                self.flops += 2 * m1.shape[-2] * m1.shape[-1] * m2.shape[-1] * (
                    m1.shape[0] if m1.dim() == 3 else 1)
            return func(*args, **(kwargs or {}))

    fake_world(2)
    try:
        sp = stack_config("ours", world=2)
        config = model_config("tiny-llama", layers=1, max_positions=512)
        mesh = sp.dims(2).build_mesh("cpu")
        model, optimizer = build(config, sp, mesh, device="cpu", compute_dtype=torch.float32,
                                 host_memory_limit=1 << 30)
        init_optimizer_state(model, optimizer)
        batch = make_batch(512, config.vocab_size, mesh, "cpu")
        recorder = InPlace()
        with count_work() as work, recorder:
            train_step(model, optimizer, batch)
        with FlopCounterMode(display=False) as counter:
            train_step(model, optimizer, batch)
    finally:
        dist.destroy_process_group()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    gemm = sum(n for op, n in counted.items() if "attention" not in op)
    assert recorder.flops > 0
    assert work.gemm == pytest.approx(gemm + recorder.flops)


def test_extrapolate_is_fixed_plus_layers_times_per_layer():
    got = extrapolate(10.0, 18.0, 1, 2, 32)
    assert got == {"per_layer_s": 8.0, "fixed_s": 2.0, "step_s": 2.0 + 32 * 8.0}
    got = extrapolate(5.0, 9.0, 2, 4, 32)
    assert (got["per_layer_s"], got["fixed_s"], got["step_s"]) == (2.0, 1.0, 65.0)
    with pytest.raises(ValueError, match="1 <= a < b"):
        extrapolate(1.0, 2.0, 2, 2, 32)
    w = extrapolate_work({"gemm": 10.0, "ops": 100}, {"gemm": 16.0, "ops": 150}, 1, 2, 32)
    assert w == {"gemm": 10.0 + 31 * 6.0, "ops": 100 + 31 * 50}


def _entry(label, layers, step_s, status="timed", **kw):
    e = {"label": label, "stack": None, "source": "planner", "backend": "auto",
         "kernel": "sdpa_cudnn", "tokens_per_rank": 131072, "seq_len": 8 * 131072,
         "predicted": None, "plan_error": "", "layers": layers, "status": status,
         "step_s": step_s, "work": {"attention_fwd": 2e15 * layers, "attention_bwd": 5e15 *
                                    layers, "gemm": 1e15 + 1e14 * layers, "memory": 0.0}}
    e.update(kw)
    return e


def test_depth_entries_extend_to_the_full_model_and_give_its_mfu():
    entries = [_entry("ours", 1, 11.0), _entry("ours", 2, 20.0, max_memory_allocated=7),
               _entry("alst", 1, 12.0), _entry("alst", 2, 1.0, status="oom")]
    (d,) = depth_entries(entries, [1, 2], 32, lambda e: 3.0e17, peak_tflops=1000.0)
    assert d["label"] == "ours" and d["layers"] == [1, 2] and d["full_layers"] == 32
    assert (d["per_layer_s"], d["fixed_s"], d["step_s"]) == (9.0, 2.0, 2.0 + 32 * 9.0)
    assert d["mfu"] == pytest.approx(3.0e17 / 290.0 / 1e15)
    assert d["work"]["attention_fwd"] == pytest.approx(2e15 * 32)
    assert d["executed_flops"] == pytest.approx(7e15 * 32 + 1e15 + 32e14)
    assert d["tokens_per_s_per_rank"] == pytest.approx(131072 / 290.0)
    assert d["max_memory_allocated"] == 7


def test_the_command_line_runs_every_stack_and_fields_with_every_kernel(tmp_path):
    import step_gpu

    plan = _planner_json(tmp_path / "plan.json")
    phases = step_gpu.phases_from_args(step_gpu.parse_args(
        ["--tokens-per-rank", "4K", "128K", "--stack", "alst", "--fields", f"ours={plan}",
         "--backend", "auto", "--backend", "fa4", "--kernels"]))
    assert [p.tokens for p in phases] == ["4K", "128K"] and all(p.kernels for p in phases)
    assert [(r.label, r.stack, r.plan, r.backend) for r in phases[0].runs] == [
        ("alst", "alst", None, "auto"), ("alst", "alst", None, "fa4"),
        ("ours", None, str(plan), "auto"), ("ours", None, str(plan), "fa4")]
    default = step_gpu.phases_from_args(step_gpu.parse_args([]))
    assert [r.label for r in default[0].runs] == ["alst", "ours", "ours-keep-attention"]


def test_fields_come_inline_from_a_file_or_from_the_planner(tmp_path):
    inline = fields_spec('{"head_chunk_size": 2, "fuse_projections": true}')
    assert (inline.label, inline.fields) == ("fields", {"head_chunk_size": 2,
                                                        "fuse_projections": True})
    assert fields_spec('mine={"ring_degree": 2}').label == "mine"
    plan = _planner_json(tmp_path / "plan.json")
    spec = fields_spec(f"ours={plan}", backend="fa4")
    assert (spec.label, spec.plan, spec.backend) == ("ours", str(plan), "fa4")
    assert fields_spec(str(plan)).label == "planned"
    with pytest.raises(ValueError, match="neither a JSON object nor a file"):
        fields_spec("ours=missing.json")
    with pytest.raises(ValueError, match="not a JSON object"):
        fields_spec("{head_chunk_size: 2}")
    record = json.loads(plan.read_text())
    assert planned_fields(record) == OURS
    assert planned_fields({"head_chunk_size": 1}) == {"head_chunk_size": 1}
    with pytest.raises(ValueError, match="no estimate.sp"):
        planned_fields({"estimate": {"fits": True}})
    with pytest.raises(ValueError, match="neither the planner's JSON"):
        planned_fields({"model": "x", "nested": {"a": 1}})


def test_the_planners_prediction_less_its_communication():
    got = planned_prediction({"estimate": {"sp": OURS, "predicted": PREDICTED}})
    assert got["step_s"] == 12.5 and got["less_collective_s"] == 12.5 - 0.75
    assert got["mfu"] == 0.41 and got["by_class_s"]["gemm"] == 2.0
    assert planned_prediction({"estimate": {"sp": OURS}}) is None
    with pytest.raises(ValueError, match="malformed"):
        planned_prediction({"estimate": {"predicted": {"mfu": 0.4}}})
    with pytest.raises(ValueError, match="must be > 0"):
        planned_prediction({"estimate": {"predicted": {"step_s": 0}}})


def test_a_planned_run_waits_for_the_planner_then_falls_back(tmp_path):
    stacks = {"ours": {"head_chunk_size": 1}}
    plan = _planner_json(tmp_path / "plan.json")
    done = tmp_path / "plan.json.rc"
    spec = RunSpec(label="ours", plan=str(plan), plan_done=str(done), fallback="ours")
    late = resolve(spec, stacks, deadline=time.monotonic() + 0.2, poll_s=0.05)
    assert late.source == "stack ours" and "had not ended" in late.plan_error
    done.write_text("2")
    failed = resolve(spec, stacks, deadline=time.monotonic())
    assert failed.fields == {"head_chunk_size": 1} and failed.plan_error == \
        "the planner exited with 2"
    done.write_text("0")
    got = resolve(spec, stacks, deadline=time.monotonic())
    assert (got.source, got.fields, got.plan_error) == ("planner", OURS, "")
    assert got.predicted["less_collective_s"] == 11.75
    _planner_json(plan, sp={})
    with pytest.raises(ValueError, match="no estimate.sp"):
        resolve(RunSpec(label="ours", plan=str(plan), plan_done=str(done)), stacks,
                deadline=time.monotonic())
    with pytest.raises(ValueError, match="exactly one of"):
        RunSpec(label="x", stack="ours", plan=str(plan))


def test_a_schedule_round_trips(tmp_path):
    phases = [Phase(tokens="128K", runs=[RunSpec(label="ours", plan="p.json", plan_done="p.rc",
                                                 fallback="ours"),
                                         RunSpec(label="alst", stack="alst")]),
              Phase(tokens="16K", kernels=True,
                    runs=[RunSpec(label="ours", fields={"head_chunk_size": 1}, backend="fa4")])]
    write_schedule(phases, tmp_path / "s.json")
    assert read_schedule(tmp_path / "s.json") == phases


@pytest.mark.slow  # 11 s; the counts themselves: test_step_benchmark_at_two_depths_... (slow)
def test_flops_only_traces_on_fake_tensors(tmp_path):
    """--flops-only counts the same executed attention FLOPs without running anything."""
    out = tmp_path / "flops.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_gpu.py", "--flops-only", "--model", "tiny-llama",
         "--world", "2", "--tokens-per-rank", "512", "--stack", "ours",
         "--stack", "ours-keep-attention", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["stack"]: r for r in json.loads(out.read_text())["flops_only"]}
    attention = 2 * 1024 * 1025 * 4 * 32  # 2 layers, see the test above
    assert rows["ours"]["attention_flops"] == pytest.approx(attention * 4.5)
    assert rows["ours-keep-attention"]["attention_flops"] == pytest.approx(attention * 3.5)
    assert rows["ours-keep-attention"]["implied_mfu"] > rows["ours"]["implied_mfu"]
