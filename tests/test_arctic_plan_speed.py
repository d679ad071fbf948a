"""The planner's speed model: the work a step does, counted by class (arctic.plan.work), the
rates that turn it into time (arctic.plan.speed), the length and depth extensions of the
count, the search for the fastest settings that fit, and the command line that prints and
writes them.

Traces that initialize torch's fake process group run in the planner's own process
(tests/plan_server.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import plan_server
import pytest
import torch
from torch import nn

from arctic.plan.speed import DEVICES, Prediction, Rates, predict, rates_from
from arctic.plan.traces import Tracer
from arctic.plan.work import BACKWARD_FACTOR, Work, attention_flops, count_work

pytest.importorskip("transformers", reason="the planner builds HF models ([hf])")

REPO = Path(__file__).resolve().parent.parent
_ENV = plan_server.ENV  # the traces the planner's other tests made, and one planner process


def _rates(**change) -> Rates:
    base = dict(name="test", attention_fwd_flops=1e12, attention_bwd_flops=5e11,
                gemm_flops=2e12, memory_bytes=1e11, host_copy_bytes=1e10,
                collective_bytes=5e10, op_seconds=1e-5, peak_flops=2e12)
    return Rates(**{**base, **change})


# --- counting ---------------------------------------------------------------------------------

def test_matrix_products_are_counted_in_place_too():
    """A Linear's forward and backward are 6 x batch x in x out FLOPs; an in-place addmm_ (the
    tiled loss head accumulates its weight gradient so) counts as its out-of-place form, which
    torch's FlopCounterMode leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    lin = nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    with count_work() as work:
        lin(x).sum().backward()
    assert work.gemm == 6 * 8 * 32 * 16

    acc, g, h = torch.zeros(16, 32), torch.randn(8, 16), torch.randn(8, 32)
    with count_work() as work:
        acc.addmm_(g.t(), h)
    with FlopCounterMode(display=False) as torch_count:
        acc.addmm_(g.t(), h)
    assert work.gemm == 2 * 8 * 16 * 32
    assert torch_count.get_total_flops() == 0  # why we count our own
    assert work.ops == 1 and work.memory == 0


def test_attention_is_counted_at_the_kernel_call_whatever_computes_it():
    """The "math" backend computes attention with matrix products; they are attention's
    FLOPs (causal: half the square and the diagonal), counted once, not as GEMMs."""
    from ulysses.kernels import attention_backward, attention_forward

    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64) for _ in range(3))
    with count_work() as work:
        out, lse = attention_forward(q, k, v, causal=True, softmax_scale=0.3, backend="math")
        attention_backward(out, q, k, v, out, lse, causal=True, softmax_scale=0.3,
                           backend="math")
    forward = 2 * (16 * 17 / 2) * 2 * (8 + 8)
    assert attention_flops(q, k, v, True) == forward
    assert work.attention_fwd == forward
    assert work.attention_bwd == BACKWARD_FACTOR * forward
    assert work.gemm == 0 and work.memory == 0 and work.ops == 2


def _collectives(world: int) -> dict:
    import torch.distributed as dist

    from arctic.plan.tracing import fake_world
    from ulysses.torch_internals import FakeTensorMode

    fake_world(world)
    out = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1024, dtype=torch.bfloat16)  # 2 KiB
        for name, run in (
                ("all_to_all", lambda: dist.all_to_all_single(torch.empty_like(x), x)),
                ("all_gather", lambda: dist.all_gather_into_tensor(
                    torch.empty(world * 1024, dtype=x.dtype), x)),
                ("reduce_scatter", lambda: dist.reduce_scatter_tensor(
                    torch.empty(1024 // world, dtype=x.dtype), x)),
                ("all_reduce", lambda: dist.all_reduce(x))):
            with count_work() as work:
                run()
            out[name] = (work.collective, work.ops, work.memory)
    return out


def test_collectives_count_the_bytes_each_rank_sends():
    got = plan_server.call(_collectives, 4, env=_ENV)
    share = 3 / 4
    assert got["all_to_all"] == (share * 2048, 1, 0)
    assert got["all_gather"] == (3 * 2048, 1, 0)  # its own block to each of 3 peers
    assert got["reduce_scatter"] == (share * 2048, 1, 0)
    assert got["all_reduce"] == (2 * share * 2048, 1, 0)


# --- rates ------------------------------------------------------------------------------------

def test_step_time_adds_the_classes_on_a_cpu_and_overlaps_them_on_a_gpu():
    work = Work(attention_fwd=1e12, attention_bwd=1e12, gemm=2e12, memory=1e11,
                host_copy=3e10, collective=5e10, ops=1000)
    r = _rates()
    s = r.seconds(work)
    assert s == {"attention_fwd": 1.0, "attention_bwd": 2.0, "gemm": 1.0, "memory": 1.0,
                 "host_copy": 3.0, "host_restore": 0.0, "collective": 1.0, "ops": 0.01}
    assert r.step_seconds(work) == pytest.approx(9.01)
    gpu = _rates(asynchronous=True)
    assert gpu.step_seconds(work) == pytest.approx(6.0)  # copies beside compute, launches hidden
    # copies back the step waits for (no offload_prefetch): on the compute's path
    assert r.step_seconds(Work(host_restore=2e10, gemm=2e12)) == pytest.approx(3.0)
    assert gpu.step_seconds(Work(host_restore=2e10, gemm=2e12, host_copy=3e10)) == \
        pytest.approx(3.0)
    assert gpu.step_seconds(Work(host_copy=2e10, gemm=2e12)) == pytest.approx(2.0)
    assert gpu.step_seconds(Work(ops=1e6, host_copy=1e12)) == pytest.approx(100.0)
    assert gpu.step_seconds(Work(ops=1e6, gemm=2e12)) == pytest.approx(10.0)  # launch-bound
    p = predict(work, r, seq_len=9010, model_flops_per_rank=9.01e12)
    assert isinstance(p, Prediction)
    assert p.tokens_per_s == pytest.approx(1000)
    assert p.mfu == pytest.approx(9.01e12 / 9.01 / 2e12)


def test_rates_files_round_trip_and_bad_ones_are_refused(tmp_path):
    r = _rates(measured={"gemm_s": 0.1})
    r.save(tmp_path / "r.json")
    assert rates_from(tmp_path / "r.json") == r
    assert rates_from("H200") is DEVICES["h200"]
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "gemm": 1}))
    with pytest.raises(ValueError, match="not a rates file"):
        rates_from(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="neither one of h200, h100 nor a file"):
        rates_from("a100")


def test_calibration_measures_every_rate_on_one_rank():
    from arctic.plan.speed import calibrate

    r = calibrate("cpu", world=1, threads=1, seq=256, hidden=128, heads=2, head_dim=32,
                  log=lambda *a: None)
    for name in ("attention_fwd_flops", "attention_bwd_flops", "gemm_flops", "memory_bytes",
                 "host_copy_bytes", "op_seconds"):
        assert 0 < getattr(r, name) < math.inf, name
    assert r.measured["attention_backend"] == "cpu_flash"
    assert not r.asynchronous and r.peak_flops == r.gemm_flops


# --- the step's work, extended in length and depth --------------------------------------------

def _extended_against_counted(tokens: int, layers: int) -> tuple[dict, dict]:
    from arctic.plan import counts, model_config, stack_config

    config = model_config("tiny-llama", layers=layers)
    sp = stack_config("ours", world=2)
    # past it: read off counts at 2048 and 4096 tokens per rank (lengths where every saved
    # tensor of tiny-llama, RoPE's cos and sin too, passes the offload's 64 KiB threshold)
    counts.WORK_TOKENS = 4096
    extended = counts.step_work(config, sp, 2, tokens)
    tracer = Tracer(config, sp, 2, shard=True, work=True)
    counted = tracer.at(tokens, layers)
    return extended.as_dict(), counted.as_dict()


def test_work_read_off_shorter_and_shallower_counts_matches_the_counted_step():
    """4 layers from 1 and 2; 8192 tokens per rank from 2048 and 4096: attention exactly
    (quadratic), matrix products exactly (affine), the rest within a few per cent (the "auto"
    tiles' count and their per-tile work)."""
    extended, counted = plan_server.call(_extended_against_counted, 16384, 4, env=_ENV)
    for k in ("attention_fwd", "attention_bwd", "gemm", "collective"):
        assert extended[k] == pytest.approx(counted[k], rel=1e-6), k
    for k in ("memory", "host_copy", "ops"):
        assert extended[k] == pytest.approx(counted[k], rel=0.05), k
    assert counted["attention_bwd"] > 0 and counted["host_copy"] > 0


def _composed_against_extended(config, base: dict, changes: list[dict], tokens: int,
                               world: int = 2) -> list[tuple[dict, dict, bool]]:
    """For each change of ``base``: its work counted as the search counts a neighbour (its
    layers at one depth against ``base``'s outside), its work counted alone, and whether the
    first took the outside from ``base``."""
    from arctic.plan import counts, stack_config

    ref = stack_config(base, world=world)
    out = []
    for change in changes:
        sp = stack_config(dict(base, **change), world=world)
        composed = counts.step_work(config, sp, world, tokens, outside=ref)
        alone = counts.step_work(config, sp, world, tokens)
        used = counts._outside_jobs(config, sp, world, tokens, ref, shard=True,
                                    compute_dtype=None) is not None
        out.append((composed.as_dict(), alone.as_dict(), used))
    return out


def _tiny_hybrid(layers: int):
    import transformers as tf

    return tf.Qwen3_5TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                                linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, tie_word_embeddings=False)


def _composed_cases() -> list:
    from arctic.plan import model_config
    from arctic.plan.step import STACKS

    llama = model_config("tiny-llama", layers=4)
    inside = [{"head_chunk_size": 2}, {"fuse_projections": False}, {"seq_chunk": "auto"},
              {"recompute_attention": False}, {"tiled_layer": False}]
    outside = [{"loss_tiles": 1}, {"ring_degree": 2}, {"offload_activations": False}]
    hybrid = dict(STACKS["ours"], fuse_projections=False, tiled_layer=False)
    return (_composed_against_extended(llama, dict(STACKS["ours"]), inside + outside, 16384) +
            _composed_against_extended(_tiny_hybrid(16), hybrid,
                                       [{"mixer_chunk": 1024},
                                        {"mixer_parallelism": "state_passing"}], 16384) +
            _composed_against_extended(llama, dict(STACKS["ours"], ring_degree=2),
                                       [{"ring_degree": 4}], 32768, world=4) +
            _composed_against_extended(llama, dict(STACKS["ours"], offload_activations=False),
                                       [{"activation_checkpointing": False}], 16384))


@pytest.mark.slow  # 23 s; counts off shorter, shallower traces: the test before it
def test_a_neighbour_inside_the_layers_counts_its_layers_alone_and_the_same_work():
    """The search counts a setting that changes only the decoder layers (INSIDE_FIELDS) at
    one depth, against the current settings' outside: half the traces, the same counts as
    its own two depths (tiny-llama at 4 layers, a tiny Qwen3.5 at 16, 8192 tokens per rank),
    and so do a ring of 4 against a ring of 2 and no checkpointing against checkpointing
    without offload (the same outside). Changes outside the layers (the loss tiles, a ring
    where there was none, the offload's edges) are counted alone."""
    cases = plan_server.call(_composed_cases, env=_ENV, timeout=600)
    assert [used for _, _, used in cases] == [True] * 5 + [False] * 3 + [True] * 4
    for composed, alone, used in cases:
        for k, v in alone.items():
            assert composed[k] == pytest.approx(v, rel=1e-9, abs=1e-6), k


# --- the search -------------------------------------------------------------------------------

def test_neighbours_change_one_trade_and_keep_the_config_valid():
    from arctic.config import SequenceParallelConfig
    from arctic.plan.fastest import neighbours
    from arctic.plan.step import STACKS

    base = dict(STACKS["ours"], sequence_parallel_size=4, ring_degree=1)
    out = neighbours(base, sp_size=4, heads=(8, 4))
    for f in out:
        SequenceParallelConfig(**f).dims(4)
        if f["head_chunk_size"] is None:
            assert not f["fuse_projections"] and f["seq_chunk"] is None
    assert {f["ring_degree"] for f in out} == {1, 2, 4}
    assert {f["head_chunk_size"] for f in out} == {None, 1, 2}  # 8 heads over 4: 2 per rank
    assert any(f["recompute_attention"] is False for f in out)
    assert any(not f["activation_checkpointing"] for f in out)
    assert all(f != base for f in out)
    # The model's unsupported settings and a mixer's ring refusal (one without state
    # passing) are respected; a gated delta net and Mamba1 pass their state on a ring
    import dataclasses

    from arctic.hf.mixer_kinds import FAMILIES

    jamba = [("JambaMambaMixer", 8, 1)]
    kinds = dict(FAMILIES)
    try:
        FAMILIES["JambaMambaMixer"] = dataclasses.replace(kinds["JambaMambaMixer"],
                                                          diagonal=False)
        out = neighbours(base, sp_size=4, heads=(8, 4), unsupported=["fuse_projections"],
                         mixers=jamba)
    finally:
        FAMILIES.update(kinds)
    assert all(f["ring_degree"] == 1 for f in out)
    assert all(not f.get("fuse_projections") for f in out)
    for mixers in (jamba, [("Qwen3_5GatedDeltaNet", 8, 4)]):
        out = neighbours(base, sp_size=4, heads=(8, 4), mixers=mixers)
        assert {f["ring_degree"] for f in out} == {1, 2, 4}
        # the scans by state passing, or by the all-to-all where the heads split ("auto")
        assert {f["mixer_parallelism"] for f in out} == {"auto", "state_passing"}
    assert {f["mixer_parallelism"] for f in neighbours(base, sp_size=4, heads=(8, 4))} == \
        {"auto"}
    lfm2 = neighbours(base, sp_size=4, heads=(8, 4), mixers=[("Lfm2ShortConv", 1, 1)])
    assert {f["mixer_parallelism"] for f in lfm2} == {"auto"}
    # A hybrid's mixer layers chunked or whole; chunked, "auto" already passes the state, so
    # no state_passing neighbour (the same setting twice), and the all-to-all drops chunks
    from arctic.plan.search import MIXER_CHUNK

    gdn = [("Qwen3_5GatedDeltaNet", 8, 4)]
    whole = neighbours(base, sp_size=4, heads=(8, 4), mixers=gdn)
    assert {f["mixer_chunk"] for f in whole} == {None, MIXER_CHUNK}
    assert {f["mixer_chunk"] for f in lfm2} == {None, MIXER_CHUNK}
    chunked = neighbours(dict(base, mixer_chunk=MIXER_CHUNK), sp_size=4, heads=(8, 4),
                         mixers=gdn)
    assert {f["mixer_chunk"] for f in chunked} == {None, MIXER_CHUNK}
    assert {f["mixer_parallelism"] for f in chunked} == {"auto"}
    assert all(f["mixer_chunk"] is None for f in neighbours(
        dict(base, mixer_parallelism="all_to_all"), sp_size=4, heads=(8, 4), mixers=gdn))


def test_each_neighbour_counts_against_settings_with_its_outside():
    """references(): a neighbour inside the layers against the current settings; the first
    ring counted whole and the other rings against it; no checkpointing against no offload;
    a change outside, whole."""
    from arctic.plan.fastest import planned_fields, references
    from arctic.plan.step import STACKS

    current = planned_fields(dict(STACKS["ours"]), 8)
    options = [dict(current, ring_degree=2), dict(current, ring_degree=4),
               dict(current, head_chunk_size=2), dict(current, loss_tiles=1),
               dict(current, ring_degree=8), dict(current, offload_activations=False),
               dict(current, activation_checkpointing=False, offload_activations=False)]
    assert references(options, current) == [None, options[0], current, None, options[0],
                                            None, options[5]]


def test_the_search_takes_the_fastest_prediction_that_fits():
    """A stand-in world: time falls with each trade taken, memory rises; the search walks to
    the fastest settings that fit and never returns one that does not."""
    from arctic.plan.fastest import fastest
    from arctic.plan.step import STACKS

    def cost(f):  # fewer memory-saving settings: faster, more memory
        ckpt = bool(f.get("activation_checkpointing"))
        return (int(ckpt) + int(ckpt and f.get("recompute_attention", True))
                + int(f.get("head_chunk_size") is not None) + f.get("ring_degree", 1))

    class E:
        def __init__(self, f, budget):
            self.sp, self.fits = f, cost(f) >= budget

        def limit(self):
            return "activations"

    class P:
        def __init__(self, f, outside=None):  # the counts' outside: step_work's
            self.step_s = float(cost(f))

    for budget in (0, 3, 4):
        best, tried = fastest(lambda f, b=budget: E(f, b), P,
                              base=dict(STACKS["ours"]), sp_size=2, heads=(8, 4), seq_len=1,
                              log=lambda *a: None)
        assert best.fits
        fitting = [t for f, t, v in tried if v == "fits"]
        assert cost(best.sp) == min(fitting)
        assert cost(best.sp) == max(budget, 1)  # ring 1, nothing else left to drop
    best, tried = fastest(lambda f: E(f, 99), P, base=dict(STACKS["ours"]), sp_size=2,
                          heads=(8, 4), seq_len=1, log=lambda *a: None)
    assert best is None and len(tried) == 1


# --- the command line -------------------------------------------------------------------------

def _write_rates(path: str) -> None:
    _rates().save(Path(path))


@pytest.mark.slow  # 35 traced candidates (60-100 s); the search itself on given estimates:
# the fastest() tests above, in the default run
def test_seq_len_alone_searches_the_fastest_settings_and_writes_a_config(tmp_path):
    rates = tmp_path / "rates.json"
    _write_rates(str(rates))
    out = plan_server.plan(["--model", "tiny-llama", "--gpus", "2", "--seq-len", "4K",
                            "--rates", str(rates), "--write-config", str(tmp_path / "c.json"),
                            "--json", str(tmp_path / "r.json")], env=_ENV, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "searching the fastest settings that fit 4,096 tokens" in out.stdout
    assert "predicted step" in out.stdout and "MFU" in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    chosen = result["estimate"]
    tried = [t for t in result["tried"] if t["verdict"] == "fits"]
    assert chosen["predicted"]["step_s"] == pytest.approx(min(t["predicted_s"] for t in tried))
    written = json.loads((tmp_path / "c.json").read_text())
    assert written["ulysses"] == {k: v for k, v in chosen["sp"].items()
                                  if k != "sequence_parallel_size"}
    # The written config is what examples/train.py reads
    from arctic.config import SequenceParallelConfig, load_ds_config

    SequenceParallelConfig.from_ds_config(load_ds_config(tmp_path / "c.json"), world_size=2)


def test_given_settings_are_planned_not_searched_and_predicted(tmp_path):
    out = plan_server.plan(["--model", "tiny-llama", "--gpus", "2", "--seq-len", "4K",
                            "--stack", "alst", "--rates", "h200",
                            "--json", str(tmp_path / "r.json")], env=_ENV, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "searching" not in out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["estimate"]["sp"]["activation_checkpointing"] is True
    p = result["estimate"]["predicted"]
    assert p["rates"] == "h200" and p["step_s"] > 0 and set(p["by_class_s"]) == {
        "attention_fwd", "attention_bwd", "gemm", "memory", "host_copy", "host_restore",
        "collective", "ops"}


def test_a_bad_rates_argument_is_refused_before_any_trace():
    out = plan_server.plan(["--model", "tiny-llama", "--gpus", "2", "--seq-len", "4K",
                            "--rates", "/nonexistent.json"], env=_ENV)
    assert out.returncode == 1
    assert "neither one of h200, h100 nor a file" in out.stderr


def test_spearman_of_the_benchmark():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from plan_speed import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5]) == pytest.approx(1 - 6 * 4 / 210)


def test_the_search_starts_from_a_fallback_when_the_least_memory_settings_do_not_fit():
    """The least-memory stack does not fit, its first fallback (sequence blocks) neither, the
    optimizer state on the host does: the search starts there, returns settings that fit
    and keeps the state's placement in them."""
    from arctic.plan.fastest import fastest
    from arctic.plan.step import STACKS

    class E:
        def __init__(self, f):
            self.sp = f
            self.fits = f.get("offload_state") == "optimizer"

        def limit(self):
            return "optimizer"

    class P:
        def __init__(self, f, outside=None):  # the counts' outside: step_work's
            self.step_s = 10.0 + (f.get("head_chunk_size") is not None)

    logged = []
    best, tried = fastest(E, P, base=dict(STACKS["ours"]), sp_size=2, heads=(8, 4), seq_len=1,
                          fallbacks=[{"seq_chunk": "auto"}, {"offload_state": "optimizer"}],
                          log=logged.append)
    assert best is not None and best.fits and best.sp["offload_state"] == "optimizer"
    assert best.sp["head_chunk_size"] is None  # then the descent took the faster plain exchange
    starts = [line for line in logged if line.startswith("  start")]
    assert len(starts) == 3 and "seq_chunk=auto" in starts[1]


def test_the_kernel_self_check_is_not_counted_as_the_models_work():
    """The first call of a kernel runs its self-check (ulysses.self_check) on a small problem
    of its own: out of the count, which holds only the call itself."""
    from ulysses import self_check
    from ulysses.kernels import LocalAttention, attention_with_lse

    self_check._verdicts.clear()
    q, k, v = (torch.randn(1, 32, 2, 8, requires_grad=True) for _ in range(3))
    with count_work() as work:
        self_check.verify_call("cpu_flash", q, causal=True, window=None, sinks=False,
                               ring=False)
        out, _ = attention_with_lse(q, k, v, LocalAttention(True, 8 ** -0.5, "cpu_flash"))
    assert work.attention_fwd == attention_flops(q, k, v, True)


def test_the_fastest_search_plans_one_neighbour_ahead():
    """The descent plans the next neighbour predicted faster beside the one it needs
    (fastest._ahead with LOOKAHEAD 1): asking for the first starts the first two, no more;
    each result comes back in order, and a plan's error is raised where it is asked for."""
    from arctic.plan.fastest import LOOKAHEAD, _ahead

    started: list[int] = []

    def call(i: int):
        def plan():
            started.append(i)
            if i == 2:
                raise ValueError("no plan")
            return 10 * i
        return plan

    assert LOOKAHEAD == 1
    results = _ahead([call(i) for i in range(4)], LOOKAHEAD)
    assert started == []
    assert results[0]() == 0 and 2 not in started
    assert results[1]() == 10 and set(started) <= {0, 1, 2}
    with pytest.raises(ValueError, match="no plan"):
        results[2]()
    assert results[3]() == 30 and sorted(started) == [0, 1, 2, 3]
