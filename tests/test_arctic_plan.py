"""The memory planner (``python -m arctic.plan``): its trace reproduces measured peaks, its depth
extrapolation reproduces full traces, and its command line answers and refuses as documented.

Each planner command line runs in a process of its own (tests/plan_server.py: one long-lived
process answers them all): it initializes torch's fake process group, which must not leak into
other tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import launch_pool
import plan_server
import pytest

from arctic.plan import parse_bytes, parse_tokens

pytest.importorskip("transformers", reason="the planner builds HF models ([hf])")

REPO = Path(__file__).resolve().parent.parent


_CACHE = plan_server.CACHE  # this run's traces, shared by the planner's tests


def _run(*args: str, timeout: int = 300, step_time: bool = False) -> subprocess.CompletedProcess:
    """``python *args``; ``-m arctic.plan ...`` goes to the planner's process."""
    if args[:2] == ("-m", "arctic.plan"):
        if not {"--find-max", "--search", "--no-search"} & set(args):
            # these tests plan given settings; --seq-len alone searches the fastest ones
            # (tests/test_arctic_plan_speed.py)
            args = (*args, "--no-search")
        ranks_by_time = "--search" in args and "--find-max" not in args
        if not (step_time or ranks_by_time or "--rates" in args):
            # memory, not the step time: the speed model's tests are test_arctic_plan_speed.py
            args = (*args, "--no-step-time")
        return plan_server.plan(list(args[2:]), env={"ARCTIC_PLAN_CACHE": _CACHE},
                                timeout=timeout)
    env = dict(os.environ, ARCTIC_PLAN_CACHE=_CACHE)
    return launch_pool.run([sys.executable, *args], cwd=REPO, timeout=timeout, env=env)


def _plan(tmp_path: Path, *args: str, name: str = "plan.json", step_time: bool = False) -> dict:
    out = tmp_path / name
    proc = _run("-m", "arctic.plan", *args, "--json", str(out), step_time=step_time)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_predicted_peaks_match_the_memory_benchmark_within_10_percent(tmp_path):
    """Issue 8's validation: the four stacks of benchmarks/memory.py, tiny Llama, 2 ranks. The
    measured peak is MemTracker's on real tensors over gloo; the prediction traces rank 0 with
    fake tensors on the fake process group, through the same build() and step()."""
    # 4 layers: offload lowers the peak (at 2 the prefetch brings layer 0 back for the peak)
    common = ["--seq", "1024", "--layers", "4"]
    stacks = ["ulysses", "+chunking", "+tiling", "+ckpt+offload"]
    # the prediction (one thread, fake tensors) and the two ranks that measure
    predicting = launch_pool.Started(
        [sys.executable, "benchmarks/memory.py", "--predict", "--world", "2", *common,
         "--stacks", *stacks, "--out", str(tmp_path / "pred.json")], cwd=REPO)
    try:
        real = _run("-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "benchmarks/memory.py", *common, "--iters", "1", "--stacks", *stacks,
                    "--out", str(tmp_path / "real.json"))
        _, err = predicting.communicate(timeout=300)
    finally:
        predicting.kill()
    assert real.returncode == 0, real.stdout[-3000:]
    assert predicting.returncode == 0, err[-3000:]
    measured = json.loads((tmp_path / "real.json").read_text())["stacks"]
    predicted = json.loads((tmp_path / "pred.json").read_text())["predicted"]
    for s in stacks:
        m, p = measured[s]["rank0_device_peak_bytes"], predicted[s]["device_peak_bytes"]
        print(f"{s:<14} measured {m / 2**20:7.2f} MiB  predicted {p / 2**20:7.2f} MiB  "
              f"ratio {p / m:.4f}")
        # The issue asks for 10%; the trace reproduces the measured bytes exactly, so hold it
        # to 1%: a planner that, e.g., kept offloaded inputs on the device would pass 10%.
        assert abs(p / m - 1) <= 0.01, (s, m, p)
    # The stacks differ by far more than the tolerance, so matching each is not luck.
    assert measured["+ckpt+offload"]["rank0_device_peak_bytes"] < \
        0.5 * measured["ulysses"]["rank0_device_peak_bytes"]


def test_each_backward_moment_is_extended_along_the_depth_on_its_own(monkeypatch, tmp_path):
    """Tiny Llama (vocabulary 2048) on 2 ranks: at 3 and 4 layers the backward's peak is the
    head's (the lm_head's gradient and its fp32 reduce-scatter input), at 7 the bottom
    layer's, which holds the gradient shards of every layer above it and so grows faster
    with depth. Read off 3 and 4 layers phase by phase, the 7-layer backward matches its
    trace; one backward phase on that line is several percent under (the planner's line
    before the backward was split)."""
    import transformers as tf

    from arctic.plan.step import stack_config
    from arctic.plan.traces import Tracer, backward_peak

    monkeypatch.setenv("ARCTIC_PLAN_CACHE", str(tmp_path))
    config = tf.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2)
    tracer, S = Tracer(config, stack_config("ours", world=2), 2, shard=True), 2048
    shallow, deep, whole = tracer.at(S, 3), tracer.at(S, 4), tracer.at(S, 7)
    at = {d: max((k for k in p if k.startswith("backward")), key=lambda k: p[k].total)
          for d, p in ((3, shallow), (4, deep), (7, whole))}
    assert at == {3: "backward", 4: "backward", 7: "backward: bottom layer"}, at
    line = backward_peak(tracer.deep(S, full=False)).total
    assert abs(line / backward_peak(whole).total - 1) < 1e-3, (line, backward_peak(whole))
    one = backward_peak(deep).total + 3 * (backward_peak(deep).total -
                                           backward_peak(shallow).total)
    assert one < 0.97 * backward_peak(whole).total, (one, backward_peak(whole))


@pytest.mark.slow  # 26 s (ours); the length line: test_length_line_matches_a_traced_length...
@pytest.mark.parametrize("stack", ["ours", "alst"])
def test_depth_extrapolation_matches_a_full_trace(tmp_path, stack):
    """A 9-layer Llama-3-8B-shaped step: traced whole, and traced at 3 and 4 layers then
    extended; the peaks and every breakdown entry agree."""
    args = ["--model", "llama3-8b", "--layers", "9", "--seq-len", "32K", "--gpus", "8",
            "--stack", stack]
    full = _plan(tmp_path, *args, "--full-trace", name="full.json")["estimate"]
    fast = _plan(tmp_path, *args, name="fast.json")["estimate"]
    assert full["device_peak_bytes"] > 0 and full["host_peak_bytes"] > 0
    assert abs(fast["device_peak_bytes"] / full["device_peak_bytes"] - 1) < 0.01
    for kind, value in full["by_kind"].items():
        assert abs(fast["by_kind"][kind] - value) <= 0.01 * full["device_peak_bytes"], kind
    assert fast["host_peak_bytes"] == full["host_peak_bytes"]


@pytest.mark.slow  # 19 s; the bisection: test_find_max_lands_on_the_longest_fit_in_few_plans
def test_find_max_verdict_and_plot(tmp_path):
    """--find-max on the tiny Llama with a 48 MiB GPU: what it returns fits, 1.05x of it
    does not; the plot is written."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "peak.png"
    got = _plan(tmp_path, "--model", "tiny-llama", "--gpus", "2", "--gpu-memory", "48MiB",
                "--host-memory", "1GiB", "--find-max", "--no-search", "--plot", str(png))
    best = got["max_seq_len"]
    assert best > 0
    tried = {t["seq_len"]: t for t in got["tried"]}
    assert tried[best]["fits"] and tried[best]["device_peak_bytes"] <= tried[best]["device_budget"]
    above = [n for n, t in tried.items() if n > best]
    assert above and all(not tried[n]["fits"] for n in above)
    assert min(above) <= best * 1.05 + 2048  # bisected to within 2% (+ one granule)
    assert png.stat().st_size > 10_000


@pytest.mark.slow  # 35 s; the plot: test_find_max_verdict_and_plot; the search:
# test_search_tries_sequence_chunks_on_the_best_ulysses_split (a stand-in planner)
def test_searched_plot_draws_each_factorization(tmp_path):
    """With the search, --plot draws every traced factorization at its own settings beside
    the chosen ones (and the JSON records each line): tiny Llama on 2 GPUs, ring 1 x
    Ulysses 2 and ring 2 x Ulysses 1."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "peak.png"
    got = _plan(tmp_path, "--model", "tiny-llama", "--gpus", "2", "--gpu-memory", "48MiB",
                "--host-memory", "1GiB", "--find-max", "--plot", str(png))
    ring = got["settings"]["ulysses"].get("ring_degree", 1)
    other = f"ring {3 - ring} x ulysses {ring}"
    assert set(got["plot"]) >= {"these settings", other, "ulysses", "alst", "ours"}
    for name in ("these settings", other):
        peaks = [p for _, p in got["plot"][name]]
        assert len(peaks) >= 2 and peaks == sorted(peaks) and peaks[0] > 0, name
    assert png.stat().st_size > 10_000


def _trace_keeps_its_key() -> bool:
    from arctic.plan.cache import is_cached
    from arctic.plan.traces import Tracer
    from arctic.plan.models import model_config
    from arctic.plan.step import stack_config

    t = Tracer(model_config("tiny-llama"), stack_config("ours", world=2), 2, shard=True)
    key = t._key(4096, 2)
    t.at(4096, 2)
    return t._key(4096, 2) == key and is_cached(key)


def test_a_trace_in_this_process_keeps_the_cache_keys():
    """Building a model writes to its config (dtype): a trace must not change the key of the
    next one, or every trace after the first in a process misses the cache. (In the
    planner's process, where the fake process group lives.)"""
    assert plan_server.call(_trace_keeps_its_key, env={"ARCTIC_PLAN_CACHE": _CACHE}), \
        "the key changed"


def _workers_write_where_the_caller_reads(before: str, after: str) -> list[bool]:
    from arctic.plan.cache import is_cached
    from arctic.plan.models import model_config
    from arctic.plan.step import stack_config
    from arctic.plan.traces import Tracer

    kept = {k: os.environ.get(k) for k in ("ARCTIC_PLAN_CACHE", "ARCTIC_PLAN_WORKERS")}
    t = Tracer(model_config("tiny-llama"), stack_config("ours", world=2), 2, shard=True)
    try:
        os.environ.update(ARCTIC_PLAN_CACHE=before, ARCTIC_PLAN_WORKERS="2")
        t.prefetch([(2048, 1), (2048, 2)])  # the workers' fork server runs from here on
        os.environ["ARCTIC_PLAN_CACHE"] = after
        t.prefetch([(3072, 1), (3072, 2)])
        return [is_cached(t._key(3072, d)) for d in (1, 2)]
    finally:
        for k, v in kept.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_the_tracing_workers_write_the_cache_the_caller_reads_now(tmp_path):
    """The tracing processes fork from a server that kept the environment it started with: a
    caller that moved ``ARCTIC_PLAN_CACHE`` since (a test's own folder) reads its traces where
    the workers wrote them, not traces made again in its own process (where a process that
    traced before peaks higher)."""
    got = plan_server.call(_workers_write_where_the_caller_reads, str(tmp_path / "before"),
                           str(tmp_path / "after"), env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert got == [True, True], got


def _traces_in_long_lived_workers(where: str) -> tuple[bool, bool]:
    from arctic.plan import traces, workers
    from arctic.plan.models import model_config
    from arctic.plan.step import STACKS, stack_config

    kept = {k: os.environ.get(k) for k in ("ARCTIC_PLAN_CACHE", "ARCTIC_PLAN_WORKERS")}
    config = model_config("tiny-llama")
    settings = [stack_config("ours", world=2), stack_config({**STACKS["ours"], "loss_tiles": 1},
                                                            world=2)]
    jobs = [(2048, 1), (2048, 2)]
    try:
        os.environ.update(ARCTIC_PLAN_CACHE=where, ARCTIC_PLAN_WORKERS="2")
        tracers = [traces.Tracer(config, sp, 2, shard=True, work=work)
                   for sp in settings for work in (True, False)]
        traces.prefetch([(t, n, d) for t in tracers for n, d in jobs])
        pids = sorted(p.pid for p in workers._pool()._pool)
        counted = [t.at(n, d) for t in tracers for n, d in jobs]
        traces.prefetch([(t, 1024, 1) for t in tracers])
        kept_pids = sorted(p.pid for p in workers._pool()._pool) == pids
        os.environ["ARCTIC_PLAN_CACHE"] = "off"  # traced again here, in this process
        again = [t.at(n, d) for t in tracers for n, d in jobs]
        return kept_pids, counted == again
    finally:
        for k, v in kept.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.slow  # 11 s; the workers' cache, in the default run:
# test_the_tracing_workers_write_the_cache_the_caller_reads_now
def test_traces_share_long_lived_workers_and_read_the_same(tmp_path):
    """Traces run in tracing processes that live on between traces (their fake tensors'
    dispatch cache warm: a llama3-8b search's 60 work traces took half the time), each
    worker tracing several: the work counted and each phase's peaks are those of another
    process, to the op and to the byte."""
    kept_pids, same = plan_server.call(_traces_in_long_lived_workers, str(tmp_path),
                                       env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert kept_pids, "the workers were replaced"
    assert same, "a long-lived worker traced otherwise"


def _capped_peaks(seq_len: int, layers: int, cap: int = 100_000):
    """Every phase of a stand-in step over 8 ranks whose device bytes grow 8 hidden-sized
    (4096, bf16) rows per token per rank up to ``cap`` tokens per rank and 4 past it: a
    moment whose tiles stop growing at ``cap`` rows, as Qwen3.5-9B's gated output's do."""
    from arctic.plan.tracing import KINDS, Peak

    t = seq_len // 8
    row = 4096 * 2
    total = (5 << 30) + layers * (1 << 26) + 4 * row * t + 4 * row * min(t, cap)
    kinds = dict.fromkeys(KINDS, 0) | {"temporaries": total}
    return {k: Peak(total, dict(kinds), stateless=total)
            for k in ("forward", "backward", "optimizer")}


def test_a_misfit_needs_a_checked_line_as_a_fit_does(monkeypatch):
    """A step whose bytes stop growing as fast past a cap between the anchors and the length
    (tiles capped at 100K rows per rank) fits at 1.5M tokens per rank (54 GiB of 67.86):
    the line through 48K and 96K reads 98 GiB there, and the line at the deeper depth
    (once taken as a lower bound, and its misfit as final) no less. The check at 128K sees
    the first line off, the second (128K and 256K) checks at 384K, and the plan fits,
    read off it exactly. ``--quick`` still reads the anchors' line alone."""
    from arctic.plan import estimate

    class Stand(estimate.Tracer):
        def at(self, seq_len, layers):
            return _capped_peaks(seq_len, layers)

        def prefetch(self, jobs):
            pass

    monkeypatch.setattr(estimate, "Tracer", Stand)
    n = 8 * 1_500_000
    e = estimate.plan("llama3-8b", n, gpus=8)
    truth = _capped_peaks(e.seq_len, 4)["backward"].total + 28 * (1 << 26)
    assert e.fits, e.method
    assert "the line through 48K and 96K was" in e.method and "checked at 384K" in e.method
    assert abs(e.peak.total - truth) <= 1 << 20, (e.peak.total, truth)
    quick = estimate.plan("llama3-8b", n, gpus=8, quick=True)
    assert not quick.fits and "unchecked: quick" in quick.method


def _auto_blocks_as_run(model: str, fuse: bool) -> tuple:
    """The block counts of ``seq_chunk="auto"`` as the attention resolves them in a trace of
    ``model`` (its arguments, recorded), at the traced length and at 1.5M tokens per rank,
    and as :func:`arctic.plan.step.pinned_blocks` pins them at the same lengths."""
    import ulysses.attention
    import ulysses.fused_attention
    from arctic.plan.models import model_config
    from arctic.plan.step import pinned_blocks, stack_config
    from arctic.plan.traces import layer_period, trace
    from ulysses.seq_chunk import resolve_seq_chunk

    calls = []

    def recorded(seq_chunk, *args):  # the attention passes its arguments by position
        calls.append(args)
        return resolve_seq_chunk(seq_chunk, *args)

    config = model_config(model)
    config = model_config(model, layers=layer_period(config))  # an attention layer in it
    sp = stack_config(dict(head_chunk_size=1, seq_chunk="auto", fuse_projections=fuse,
                           sequence_parallel_size=2), world=2)
    ulysses.attention.resolve_seq_chunk = ulysses.fused_attention.resolve_seq_chunk = recorded
    try:
        trace(config, sp, 2, 2 * 512, shard=True)
    finally:
        ulysses.attention.resolve_seq_chunk = resolve_seq_chunk
        ulysses.fused_attention.resolve_seq_chunk = resolve_seq_chunk
    layout, c, batch, local, dim, dtype, *budget = calls[0]
    run = [resolve_seq_chunk("auto", layout, c, batch, t, dim, dtype, *budget)
           for t in (local, 1_500_000)]
    pinned = [pinned_blocks(sp, config, 2 * t).seq_chunk for t in (local, 1_500_000)]
    return local, run, pinned


@pytest.mark.parametrize("model,fuse", [
    ("qwen3.5-9b", True), pytest.param("llama3-8b", True, marks=pytest.mark.slow),
    pytest.param("deepseek-v2-lite", False, marks=pytest.mark.slow)])  # latent attention
def test_auto_blocks_are_traced_as_the_count_they_resolve_to(model, fuse):
    """The planner traces ``seq_chunk="auto"`` as the block count that the attention
    resolves it to at the planned length (:func:`arctic.plan.step.pinned_blocks`): the same
    count, from the arguments the attention passes in a trace, at the traced length (one
    block) and at 1.5M tokens per rank (several)."""
    local, run, pinned = plan_server.call(_auto_blocks_as_run, model, fuse,
                                          env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert local == 512
    assert run == pinned and run[0] == 1 and run[1] > 1, (run, pinned)


def _synthetic(device, host, budget=(100.0, 100.0)):
    """A ``plan_at`` whose device and host figures are the given functions of the length."""
    from types import SimpleNamespace

    def plan_at(n):
        d, h = device(n), host(n)
        fits = d <= budget[0] and h <= budget[1]
        return SimpleNamespace(seq_len=n, fits=fits, limit=lambda: "x",
                               loads=lambda: (d / budget[0], h / budget[1]),
                               peak=SimpleNamespace(total=d, host=h),
                               device_budget=budget[0], host_budget=budget[1])
    return plan_at


def test_find_max_stops_short_where_another_search_fits_its_shortest_misfit():
    """find_max with ``beaten`` (the settings search's factorizations side by side) stops
    refining once another search fits its shortest misfit: it returns its longest fit so
    far, in fewer plans; without it, the same search refines to the granule."""
    from arctic.plan.search import find_max

    plan_at = _synthetic(lambda n: 20 + n / 1e5, lambda n: 0.0)  # fits up to 8,000,000
    quiet = lambda *_: None  # noqa: E731
    full, tried_full = find_max(plan_at, start=1 << 20, granule=1024, log=quiet, tolerance=0)
    asked: list[int] = []
    short, tried = find_max(plan_at, start=1 << 20, granule=1024, log=quiet, tolerance=0,
                            beaten=lambda n: asked.append(n) or n <= 9_000_000)
    assert 8_000_000 - 1024 < full <= 8_000_000
    assert asked and asked[0] > 8_000_000 and short < full
    assert len(tried) < len(tried_full)
    assert find_max(plan_at, start=1 << 20, granule=1024, log=quiet, tolerance=0,
                    beaten=lambda n: False)[0] == full


@pytest.mark.parametrize("name,device,host,most", [
    ("host line", lambda n: 20 + n / 1e5, lambda n: 5 + n / 5.3e4, 5),
    ("device line", lambda n: 20 + n / 6.1e4, lambda n: n / 1e6, 5),
    ("bent device", lambda n: 20 + max(n / 1e5, n / 2e4 - 150), lambda n: 0.0, 7),
    ("curved host", lambda n: 0.0, lambda n: (n / 7.7e4) ** 1.5, 8),
    # the device nearer its budget at first, the host growing faster and over it first
    ("host overtakes", lambda n: 50 + n / 1.3e5, lambda n: n / 3.1e4, 5),
])
def test_find_max_lands_on_the_longest_fit_in_few_plans(name, device, host, most):
    """find_max returns the longest granule multiple that fits (checked against every
    multiple), in few plans: lines are crossed where they cross the budget; a bend or a curve
    costs a few more plans, never a creep of a tenth of the bracket per plan."""
    from arctic.plan.search import find_max

    granule, plans = 1024, []
    plan_at = _synthetic(device, host)
    counted = lambda n: plans.append(n) or plan_at(n)  # noqa: E731
    best, tried = find_max(counted, start=1 << 20, granule=granule, log=lambda _: None,
                           tolerance=0)
    truth = max(n for n in range(granule, 1 << 24, granule) if plan_at(n).fits)
    assert best == truth, (name, best, truth, plans)
    assert len(plans) <= most, (name, plans)
    assert find_max(plan_at, start=1 << 20, granule=1 << 30, log=lambda _: None)[0] == 0


@pytest.mark.parametrize("device_bound,ring_cut", [(True, 1.0), (True, 3.0), (False, 3.0)])
def test_search_tries_sequence_chunks_on_the_best_ulysses_split(device_bound, ring_cut):
    """A device-bound search tries seq_chunk="auto" on its ring-only winner and on its
    longest split with more than one Ulysses rank (not on the other splits, not when
    host-bound), and keeps the one that goes furthest past the winner; the chosen fields
    then carry it. Synthetic lines: blocks halve the slope of a Ulysses split's device
    bytes, and divide a ring-only split's by ``ring_cut`` (1: they cut nothing there, as
    for Llama-3-8B; 3: more, as the ring backward of wide heads)."""
    from arctic.plan.search import search

    calls = []

    def plan_with(n, fields):
        calls.append(dict(fields))
        ring = fields["ring_degree"]
        slope = {1: 1 / 3e4, 2: 1 / 4e4, 4: 1 / 5e4}[ring]
        if fields.get("seq_chunk") == "auto":
            slope /= ring_cut if ring == 4 else 2
        host = (lambda m: m / 1e5) if device_bound else (lambda m: m / 3e4)
        e = _synthetic(lambda m: 20 + m * slope, host)(n)
        e.limit = lambda: "host memory" if host(n) > 100 else "temporaries"
        e.state_host = 0
        return e

    base = {"head_chunk_size": 1, "seq_chunk": None, "recompute_attention": True,
            "offload_activations": True}
    winner, candidates = search(plan_with, base=base, sp_size=4, heads=(8, 4),
                                start=1 << 20, granule=1024, log=lambda _: None)
    chunked = [c for c in candidates if c.fields.get("seq_chunk") == "auto"]
    if not device_bound:
        assert not chunked and winner.fields["seq_chunk"] is None
        return
    # the ring-only winner (4 x 1), then the best split with U > 1 (2 x 2); not 1 x 4
    assert [(c.ring, c.ulysses) for c in chunked] == [(4, 1), (2, 2)]
    assert not any(f.get("seq_chunk") == "auto" and f["ring_degree"] == 1 for f in calls)
    slope = 1 / 1.5e5 if ring_cut == 3.0 else 1 / 8e4  # the ring-only or the 2 x 2 blocks
    assert winner is chunked[0 if ring_cut == 3.0 else 1]
    assert winner.best > max(c.best for c in candidates if c is not winner)
    assert winner.best == max(n for n in range(1024, 1 << 24, 1024)
                              if 20 + n * slope <= 100 and n / 1e5 <= 100)


def _freeing(key: str, value, freed: float, host_slope: float):
    """A stand-in ``plan_with``: device bytes ``20 + n / 3e4`` of 100, less ``freed`` where
    ``fields[key] == value``; host bytes ``n / host_slope`` of 100."""
    def plan_with(n, fields):
        gain = freed if key in fields and fields[key] == value else 0
        host = lambda m: m / host_slope  # noqa: E731
        e = _synthetic(lambda m: 20 + m / 3e4 - gain, host)(n)
        e.limit = lambda: "host memory" if host(n) > 100 else "temporaries"
        e.state_host = 0
        return e
    return plan_with


@pytest.mark.parametrize("device_bound", [True, False])
def test_a_device_bound_search_tries_the_optimizer_state_on_the_host(device_bound):
    """With offload_state, a search still held back by the device tries the optimizer's
    state on the host (fields["offload_state"] = "optimizer") on the winner's split and keeps
    it when it goes past; a host-bound one does not (it would only add host bytes).
    Synthetic lines: the offloaded state frees a fixed 15 of the device's 100."""
    from arctic.plan.search import search

    plan_with = _freeing("offload_state", "optimizer", 15, 1e5 if device_bound else 2e4)
    base = {"head_chunk_size": 1, "recompute_attention": True, "offload_activations": True}
    winner, candidates = search(plan_with, base=base, sp_size=2, heads=(8, 4),
                                start=1 << 20, granule=1024, log=lambda _: None,
                                offload_state=True)
    tried = [c for c in candidates if c.fields.get("offload_state") == "optimizer"]
    if not device_bound:
        assert not tried and "offload_state" not in winner.fields
        return
    assert len(tried) == 1 and winner is tried[0]
    assert winner.best == max(n for n in range(1024, 1 << 24, 1024)
                              if 5 + n / 3e4 <= 100 and n / 1e5 <= 100)
    # then the parameters too, on the new winner: they free nothing more here, so not kept
    assert [c.fields["offload_state"] for c in candidates if "offload_state" in c.fields] == \
        ["optimizer", "optimizer+params"]


def test_a_device_bound_search_keeps_the_parameters_on_the_host_where_they_go_further():
    """Still device-bound with the optimizer's state on the host, the search tries the
    parameters there too (offload_state "optimizer+params") and keeps it when it goes past.
    Synthetic lines: the optimizer's state frees 15 of the device's 100, with the parameters
    25."""
    from arctic.plan.search import search

    def plan_with(n, fields):
        freed = {"optimizer": 15, "optimizer+params": 25}.get(fields.get("offload_state"), 0)
        e = _synthetic(lambda m: 20 + m / 3e4 - freed, lambda m: m / 1e5)(n)
        e.limit = lambda: "host memory" if n / 1e5 > 100 else "temporaries"
        e.state_host = 0
        return e

    base = {"head_chunk_size": 1, "recompute_attention": True, "offload_activations": True}
    winner, _ = search(plan_with, base=base, sp_size=2, heads=(8, 4), start=1 << 20,
                       granule=1024, log=lambda _: None, offload_state=True)
    assert winner.fields["offload_state"] == "optimizer+params"
    assert winner.best == max(n for n in range(1024, 1 << 24, 1024)
                              if n / 3e4 - 5 <= 100 and n / 1e5 <= 100)


@pytest.mark.parametrize("bound", ["device", "host"])
def test_a_device_bound_search_tries_the_inputs_without_prefetch(bound):
    """A search held back by the device tries the layer inputs copied back without prefetch
    (offload_prefetch=False: one layer input less on the device) on the winner's split and
    keeps it when it goes past; not when host-bound. Synthetic lines: no prefetch frees a
    fixed 10 of the device's 100."""
    from arctic.plan.search import search

    plan_with = _freeing("offload_prefetch", False, 10, 2e4 if bound == "host" else 1e5)
    base = {"head_chunk_size": 1, "recompute_attention": True, "offload_activations": True}
    winner, candidates = search(plan_with, base=base, sp_size=2, heads=(8, 4),
                                start=1 << 20, granule=1024, log=lambda _: None)
    tried = [c for c in candidates if c.fields.get("offload_prefetch") is False and
             "seq_chunk" not in c.fields]  # (sequence chunks are tried on it next)
    if bound != "device":
        assert not tried and "offload_prefetch" not in winner.fields
        return
    assert len(tried) == 1 and winner is tried[0]
    assert winner.best == max(n for n in range(1024, 1 << 24, 1024)
                              if 10 + n / 3e4 <= 100 and n / 1e5 <= 100)


def test_the_inputs_without_prefetch_hold_one_layer_input_less(monkeypatch, tmp_path):
    """Traced through the recipe (tiny Llama, 4 layers, 2 ranks): with offload_prefetch=False
    the backward's peak is one layer input ([1, S/2, E] bf16) lower (less the embedding
    ZeRO-3 gathers in the first layer's backward), and the copies back
    are counted as ones the step waits for (host_restore), not beside compute."""
    import transformers as tf

    from arctic.config import SequenceParallelConfig
    from arctic.plan.traces import Tracer, backward_peak

    monkeypatch.setenv("ARCTIC_PLAN_CACHE", str(tmp_path))
    config = tf.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    S, got = 16384, {}
    for ahead in (True, False):
        sp = SequenceParallelConfig(sequence_parallel_size=2, head_chunk_size=1,
                                    fuse_projections=True, tiled_mlp="auto", tiled_layer=True,
                                    activation_checkpointing=True, offload_activations=True,
                                    offload_prefetch=ahead)
        peak = backward_peak(Tracer(config, sp, 2, shard=True).at(S, 4)).total
        work = Tracer(config, sp, 2, shard=True, work=True).at(S, 4)
        got[ahead] = peak, work
    layer_input = S // 2 * config.hidden_size * 2
    # less the input embedding's weight, which ZeRO-3 prefetches in the first layer's
    # backward, where the peak without prefetch falls (with prefetch: the layer above's,
    # as it brings that input back)
    embedding = config.vocab_size * config.hidden_size * 2
    assert got[True][0] - got[False][0] == layer_input - embedding, (got, layer_input)
    assert got[True][1].host_restore == 0 < got[False][1].host_restore
    assert got[True][1].host_copy == got[False][1].host_copy + got[False][1].host_restore


def test_no_offload_is_skipped_only_when_half_the_offloaded_inputs_overflow():
    """The search skips the no-offload variant untraced only when at least half the host
    bytes of the offloaded layer inputs (the pool reuses a buffer for a tensor half its size)
    exceed the device budget; the offloaded training state does not count."""
    from types import SimpleNamespace

    from arctic.plan.search import _inputs_overflow

    def at(host, state=0):
        return SimpleNamespace(seq_len=1 << 20, peak=SimpleNamespace(host=host),
                               state_host=state, device_budget=100)
    assert _inputs_overflow(at(202)) and "at least" in _inputs_overflow(at(202))
    assert _inputs_overflow(at(200)) is None
    assert _inputs_overflow(at(250, state=60)) is None


@pytest.mark.hf_facing
def test_verdict_names_the_limit(tmp_path):
    """Plain Ulysses (untiled logits) at 512K tokens on 8 x 80 GiB does not fit; the full stack
    does, and uses far less."""
    args = ["--model", "llama3-8b", "--layers", "2", "--seq-len", "512K", "--gpus", "8"]
    plain = _plan(tmp_path, *args, "--stack", "ulysses", name="u.json")["estimate"]
    ours = _plan(tmp_path, *args, name="o.json")["estimate"]
    assert not plain["fits"] and plain["limit"] in ("temporaries", "activations")
    assert ours["fits"] and ours["device_peak_bytes"] < 0.5 * plain["device_peak_bytes"]
    assert ours["host_peak_bytes"] > 0 and plain["host_peak_bytes"] == 0


def test_kept_attention_costs_host_bytes_not_device_bytes(tmp_path):
    """--no-recompute-attention (issue 17): each layer keeps its attention out (bf16, s x E)
    and lse (fp32, h x S) on the host with its input; the device peak does not grow (the kept
    results come back as each layer's recompute starts, not a layer ahead)."""
    args = ["--model", "llama3-8b", "--layers", "2", "--seq-len", "512K", "--gpus", "8"]
    full = _plan(tmp_path, *args, name="full.json")["estimate"]
    kept = _plan(tmp_path, *args, "--no-recompute-attention", name="kept.json")["estimate"]
    assert kept["sp"]["recompute_attention"] is False and full["sp"]["recompute_attention"]
    s, S, E, h = 65536, 524288, 4096, 32 // 8
    per_layer = 2 * s * E + 4 * h * S
    assert kept["host_peak_bytes"] - full["host_peak_bytes"] == 2 * per_layer
    assert kept["device_peak_bytes"] <= full["device_peak_bytes"]


@pytest.mark.parametrize("args,needle", [
    (["--seq-len", "1M", "--ulysses", "3"], "must divide the world size"),
    (["--seq-len", "1M", "--model", "gpt-17"], "--model must be one of"),
    (["--seq-len", "1M", "--gpu-memory", "lots"], "not a memory size"),
    ([], "give --seq-len, or --find-max"),
    (["--seq-len", "1M", "--allocator-headroom", "0.9"], "headroom is reserved / allocated"),
])
def test_bad_arguments_are_refused(args, needle):
    proc = _run("-m", "arctic.plan", "--layers", "2", *args)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-2000:]


def test_ds_config_with_zero_2_is_refused(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "sequence_parallel_size": 8}))
    proc = _run("-m", "arctic.plan", "--seq-len", "1M", "--ds-config", str(cfg))
    assert proc.returncode != 0 and "ZeRO stage 2" in proc.stderr


def test_disk_tier_holds_what_the_host_cannot(tmp_path):
    """--disk plans the offload_dir tier: tiny Llama (2 layers) at 64K tokens offloads 19 MB
    of layer inputs per rank, over a 13 MB host budget. Without a disk it does not fit; with
    one it fits, the disk holding the overflow plus the rest of the layer where it began
    (whole layers spill); with a disk smaller than that it does not fit, and says so."""
    args = ["--model", "tiny-llama", "--gpus", "2", "--seq-len", "64K", "--gpu-memory", "1GiB",
            "--host-memory", "32MiB"]
    none = _plan(tmp_path, *args, name="none.json")["estimate"]
    acts, host_limit = none["host_peak_bytes"], none["host_budget"]
    assert not none["fits"] and acts > host_limit and none["disk_bytes"] == 0
    disk = _plan(tmp_path, *args, "--disk", "64MiB", name="disk.json")["estimate"]
    assert disk["fits"] and disk["disk_budget"] == (64 << 20) // 2
    assert disk["disk_bytes"] == min(acts, acts - host_limit + -(-acts // 2)), disk
    small = _plan(tmp_path, *args, "--disk", "16MiB", name="small.json")["estimate"]
    assert not small["fits"] and "disk" in small["limit"], small


def _users_ds_config(tmp_path: Path) -> Path:
    """A user's own JSON: ZeRO-3, bf16, an optimizer, sequence_parallel_size, no "ulysses"."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
        "sequence_parallel_size": 2}))
    return cfg


def test_ds_config_search_starts_from_the_least_memory_settings(tmp_path):
    """--ds-config with --search keeps the JSON's SP size and state, and searches our
    settings from the least-memory ones (not the JSON's, which check nothing); where even
    they do not fit, --write-config says it wrote nothing, and why."""
    out = tmp_path / "merged.json"
    proc = _run("-m", "arctic.plan", "--model", "tiny-llama", "--gpus", "2", "--ds-config",
                str(_users_ds_config(tmp_path)), "--seq-len", "4K", "--search",
                "--gpu-memory", "10MiB", "--write-config", str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    start = next(line for line in proc.stdout.splitlines() if line.strip().startswith("start"))
    assert "activation_checkpointing=True, offload_activations=True" in start, start
    assert f"did not write {out}: no settings fit 4,096 tokens" in proc.stdout, proc.stdout
    assert not out.exists()


@pytest.mark.slow  # 17 s; --no-step-time's refusals, in the default run:
# test_no_step_time_is_refused_where_the_step_time_is_asked_for
def test_no_step_time_answers_memory_alone(tmp_path):
    """--no-step-time: the same memory answer without the predicted step time, and without
    the work traces that time counts (the plain run after it traces them)."""
    # loss tiles no other test plans: traces of its own in the run's shared cache
    args = ["--model", "tiny-llama", "--gpus", "2", "--seq-len", "10K", "--stack", "ours",
            "--loss-tiles", "3"]
    traces = lambda: len(list(Path(_CACHE).glob("*.json")))  # noqa: E731
    before = traces()
    memory = _plan(tmp_path, *args, "--no-step-time", name="memory.json",
                   step_time=True)["estimate"]
    after_memory = traces()
    timed = _plan(tmp_path, *args, name="timed.json", step_time=True)["estimate"]
    assert memory["predicted"] is None and timed["predicted"]["step_s"] > 0
    assert after_memory > before and traces() > after_memory  # the work traces came after
    for key in ("device_peak_bytes", "host_peak_bytes", "by_kind", "fits"):
        assert memory[key] == timed[key], key
    proc = _run("-m", "arctic.plan", *args, "--no-step-time", step_time=True)
    assert proc.returncode == 0 and "predicted step" not in proc.stdout, proc.stdout


def test_no_step_time_is_refused_where_the_step_time_is_asked_for():
    """--no-step-time is refused beside --rates, and with the settings search, which ranks
    settings by their step time (before any trace)."""
    args = ["--model", "tiny-llama", "--gpus", "2", "--seq-len", "10K", "--no-step-time"]
    for extra, why in ((["--rates", "h200"], "--rates h200 with --no-step-time"),
                       (["--search"], "--no-step-time with the settings search")):
        proc = _run("-m", "arctic.plan", *args, *extra, step_time=True)
        assert proc.returncode != 0 and why in proc.stderr, proc.stderr[-2000:]


def test_launch_lines_name_only_a_file_that_was_written(tmp_path):
    """Given settings: without --write-config no command line names a config (none was
    written), and the answer says how to get one; with it, the settings are written and the
    launch lines name that file; where they do not fit, nothing is written, and it says so."""
    args = ["-m", "arctic.plan", "--model", "tiny-llama", "--gpus", "2", "--seq-len", "4K",
            "--quick"]
    bare = _run(*args)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert "launch with:" not in bare.stdout and "--deepspeed_config" not in bare.stdout
    assert "to launch: add --write-config FILE" in bare.stdout, bare.stdout[-2000:]
    out = tmp_path / "written.json"
    wrote = _run(*args, "--write-config", str(out))
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    lines = wrote.stdout.split("launch with:", 1)[1].strip().splitlines()
    assert out.exists() and lines and all(str(out) in line for line in lines), wrote.stdout
    assert json.loads(out.read_text())["ulysses"]["head_chunk_size"] == 1  # the given stack
    small = tmp_path / "small.json"
    refused = _run(*args, "--gpu-memory", "1MiB", "--write-config", str(small))
    assert f"did not write {small}: these settings do not fit 4,096 tokens" in refused.stdout
    assert not small.exists()


@pytest.mark.slow  # a search of 30 candidates, then a launch
def test_ds_config_search_writes_the_fit_merged_into_the_json_and_it_trains(tmp_path):
    """The user's JSON (no checkpointing, no offload) does not fit 16K tokens in 64 MiB; the
    search from the least-memory settings does, and --write-config writes them merged into
    the JSON, which examples/train.py then runs."""
    cfg, out = _users_ds_config(tmp_path), tmp_path / "merged.json"
    args = ["-m", "arctic.plan", "--model", "tiny-llama", "--gpus", "2", "--ds-config", str(cfg),
            "--seq-len", "16K", "--gpu-memory", "64MiB"]
    given = _run(*args)  # the JSON's own settings
    assert "verdict: DOES NOT FIT" in given.stdout, given.stdout[-2000:]
    proc = _run(*args, "--search", "--write-config", str(out))
    assert proc.returncode == 0 and "verdict: FITS" in proc.stdout, proc.stdout[-3000:]
    written, user = json.loads(out.read_text()), json.loads(cfg.read_text())
    assert {k: v for k, v in written.items() if k != "ulysses"} == user  # the JSON, kept
    assert written["ulysses"]["activation_checkpointing"] is True
    ran = launch_pool.run(["deepspeed", "--num_gpus", "2", "examples/train.py", "--seq-len",
                           "256", "--max-steps", "2", "--deepspeed_config", str(out)], cwd=REPO)
    assert ran.returncode == 0, ran.stdout[-3000:]


def test_ds_config_with_a_disk_tier(tmp_path):
    """A --ds-config with ulysses.offload_dir (the training nodes' directory, which need not
    exist here; nor its offload_io backend) is planned with --disk, refused without it;
    --write-config keeps the config's other 'ulysses' keys, and writes --offload-dir, else the
    config's own directory (without either it is refused)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
                               "ulysses": {"activation_checkpointing": True,
                                           "offload_activations": True,
                                           "attention_backend": "math",
                                           # the training nodes' directory, not here
                                           "offload_dir": "/nvme/not/on/this/machine",
                                           "offload_io": "aio"}}))
    args = ["-m", "arctic.plan", "--model", "tiny-llama", "--gpus", "2", "--ds-config",
            str(cfg)]
    proc = _run(*args, "--seq-len", "8K")
    assert proc.returncode != 0 and "give --disk" in proc.stderr, proc.stderr[-2000:]
    out = tmp_path / "written.json"
    proc = _run(*args, "--seq-len", "8K", "--gpu-memory", "48MiB", "--disk", "1GiB",
                "--offload-dir", str(tmp_path), "--write-config", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())["ulysses"]
    assert written["offload_dir"] == str(tmp_path) and written["attention_backend"] == "math"
    assert written["offload_io"] == "aio"
    proc = _run(*args, "--seq-len", "8K", "--gpu-memory", "48MiB", "--disk", "1GiB",
                "--write-config", str(out))  # the config's own directory is kept
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["ulysses"]["offload_dir"] == "/nvme/not/on/this/machine"
    proc = _run("-m", "arctic.plan", "--model", "tiny-llama", "--gpus", "2", "--find-max",
                "--no-search", "--gpu-memory", "48MiB", "--disk", "1GiB", "--write-config",
                str(out))
    assert proc.returncode != 0 and "give --offload-dir" in proc.stderr, proc.stderr[-2000:]


def test_sizes_parse():
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40) and parse_bytes("4096") == 4096
    assert parse_tokens("512K") == 512 * 1024 and parse_tokens("5000000") == 5_000_000
    with pytest.raises(ValueError):
        parse_tokens("5 million")


def test_track_peak_counts_the_given_pools_buffers_and_restores_their_hooks():
    """The chunk buffers are told apart through each pool's own on_allocate hook (no class
    patching): a buffer the pool creates counts as "attention buffers", a reused one is not
    counted twice, a pool not given is not seen, and the previous hooks come back."""
    import torch

    from arctic.plan import track_peak
    from ulysses import BufferPool

    seen, other = [], BufferPool()
    pool = BufferPool(on_allocate=seen.append)
    with track_peak(pools=[pool]) as tracker:
        buf = pool.acquire(1024, torch.float32, "cpu")
        pool.release(buf)
        again = pool.acquire(512, torch.float32, "cpu")  # reused: no new buffer
        not_ours = other.acquire(4096, torch.float32, "cpu")
    peak = tracker.breakdown("cpu")
    assert peak.by_kind["attention buffers"] == 1024 * 4, peak.by_kind
    assert peak.total >= (1024 + 4096) * 4
    assert pool.on_allocate == seen.append and other.on_allocate is None and seen == []
    del again, not_ours


def test_a_tensor_is_labelled_with_one_module_whatever_order_the_modules_come_in():
    """What is alive at the peak is grouped by the innermost module that made it; of sibling
    modules alike in depth (a backward runs k_proj's and v_proj's at once), the same one
    names it in every process. (The tracker keeps the modules in a set, whose order follows
    the string hash, which differs from process to process: the planner's answer changed
    from run to run.)"""
    import torch

    from arctic.plan.tracing import _tracker_class
    from ulysses.torch_internals import mem_tracker

    activation = mem_tracker()[2].ACT
    named = []
    for parents in (["Global", "m", "m.k_proj", "m.v_proj"],
                    ["m.v_proj", "m.k_proj", "m", "Global"]):
        tracker = _tracker_class()()
        tracker._mod_tracker.parents = parents
        made = torch.empty(4)  # labelled while it lives
        tracker._track(activation, made)
        named += [label for label, _, _ in tracker.labels.values()]
    assert named == ["before the step in m.v_proj (forward)"] * 2, named


@pytest.mark.slow  # 20 s; a line's reading: test_the_deeper_layers_bytes_are_read_off_...
def test_length_line_matches_a_traced_length_within_1_percent(tmp_path):
    """Issue 18's speed-up: a 4-layer Llama-3-8B on 8 ranks at 160K tokens per rank, read off
    the line through the 48K and 96K traces (checked at 128K), agrees with the length traced
    (--trace-length) to 1%, device and host. (4 layers: the depth line's deepest trace; the
    depth line itself is held to full traces by test_depth_extrapolation_matches_a_full_trace.
    For the 32-layer model the same comparison gave 32.34 GiB both ways.)"""
    args = ["--model", "llama3-8b", "--layers", "4", "--seq-len", "1280K", "--gpus", "8"]
    line = _plan(tmp_path, *args, name="line.json")["estimate"]
    traced = _plan(tmp_path, *args, "--trace-length", name="traced.json")["estimate"]
    assert traced["method"] == "traced" and line["method"].startswith("length line"), line
    for key in ("device_peak_bytes", "host_peak_bytes", "stateless_peak_bytes"):
        assert abs(line[key] / traced[key] - 1) < 0.01, key
    # --quick reads the same line without the check trace
    quick = _plan(tmp_path, *args, "--quick", name="quick.json")["estimate"]
    assert quick["method"].endswith("(unchecked: quick)"), quick["method"]
    assert quick["device_peak_bytes"] == line["device_peak_bytes"]


@pytest.mark.parametrize("ring,layers,seq_chunk", [
    (1, 2, None),
    # 30 s: the ring hops' shortcut (the tiles' and head-chunk periods' run by default)
    pytest.param(8, 1, None, marks=pytest.mark.slow),
    # 56 s (6 blocks: 88 s); test_ulysses_seq_chunk.py checks the block shortcuts byte for
    # byte in the default run. 4 blocks: block 2 repeats and is skipped (the first, its first
    # repeat and the last are kept), and every pair's repeated pieces are.
    pytest.param(1, 1, 4, marks=pytest.mark.slow)])
def test_trace_shortcuts_change_no_byte(ring, layers, seq_chunk):
    """The trace's shortcuts (ulysses.trace_shortcuts: repeated tiles, head-chunk periods and
    ring hops run once, in-place packing and exchanges left out) give each phase the same
    peaks and breakdown, byte for byte, as the full trace, where most repeats are skipped: 47
    loss tiles; with ring 8 x Ulysses 1, 32 head-chunk steps and 8 ring hops; with 4
    sequence blocks (ulysses.seq_chunk), repeated blocks and a pair's repeated pieces."""
    from arctic.plan.traces import BACKWARD_PHASES, trace
    from arctic.plan.models import model_config
    from arctic.plan.step import STACKS, stack_config

    world = 8
    config = model_config("llama3-8b", layers=layers)
    sp = stack_config(dict(STACKS["ours"], ring_degree=ring, seq_chunk=seq_chunk), world=world)
    seq_len = 12 * 1024 * world + 3 * world  # uneven tiles (and blocks)
    full = trace(config, sp, world, seq_len, shard=True, shortcuts=False)
    fast = trace(config, sp, world, seq_len, shard=True, shortcuts=True)
    # the backward's phases (split_backward): the middle layers' from 3 layers, the top's
    # from 2
    layer_phases = BACKWARD_PHASES[1:4] if layers > 2 else BACKWARD_PHASES[1:4:2][2 - layers:]
    assert list(full) == ["forward", "backward", *layer_phases, "backward: tail", "optimizer"]
    for phase, peak in full.items():
        assert fast[phase] == peak, phase


def _chunked_hybrid(world: int, ring: int, chunk: int):
    """A tiny Qwen3.5 (2 layers: a gated delta net, an attention layer) and the recipe's
    least-memory settings with its mixers in sequence chunks of ``chunk`` positions."""
    from arctic.config import SequenceParallelConfig

    config = _hybrid_config()
    config.num_hidden_layers = 2
    config.layer_types = ["linear_attention", "full_attention"]
    sp = SequenceParallelConfig(sequence_parallel_size=world, ring_degree=ring,
                                head_chunk_size=1, fuse_projections=True, tiled_mlp="auto",
                                tiled_layer=True, activation_checkpointing=True,
                                offload_activations=True, mixer_chunk=chunk)
    return config, sp


def _stand_ins_against_full(world: int, ring: int, seq_len: int) -> list[str]:
    from arctic.plan.traces import trace

    config, sp = _chunked_hybrid(world, ring, 128)
    full = trace(config, sp, world, seq_len, shard=True, shortcuts=False)
    fast = trace(config, sp, world, seq_len, shard=True, shortcuts=True)
    return [phase for phase, peak in full.items() if fast[phase] != peak]


@pytest.mark.slow  # 14 s; the trace shortcuts' bytes, in the default run:
# test_trace_shortcuts_change_no_byte (the tiles' and head chunks' shortcuts), and a hybrid's
# traces with mixer chunks: test_a_traced_ring_passes_gradients_through_the_mixer_state
@pytest.mark.parametrize("world,ring,seq_len", [
    (2, 2, 3000),  # a zigzag rank's two runs of 750: 5 chunks of 128 (2 stood in), one of 110
    (4, 1, 12004)])  # Ulysses 4: no summary pass
def test_mixer_chunk_stand_ins_change_no_byte(world, ring, seq_len):
    """A memory trace stands in for the repeated mixer chunks (mixer_chunks._StandIn: the
    first two, the last of each size and the last are run): each phase's peak, breakdown
    and largest tensors are those of the full trace, byte for byte. It fails with the stand
    -ins' inputs held on the node instead of saved (each layer's first forward then keeps
    its input norm's output), or with their results all taking a gradient."""
    differ = plan_server.call(_stand_ins_against_full, world, ring, seq_len,
                              env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert differ == []


def test_a_dead_branch_under_module_tracking_holds_nothing():
    """A module's result that nothing uses frees what its graph holds, under the planner's
    tracker as without it: the step's peak is that of the same step without the branch.
    MemTracker's module tracking (torch's register_multi_grad_hook) held the branch's nodes
    in a reference cycle until the garbage collector ran: 3,408,904 bytes against 2,884,616,
    whenever the collector ran; the tracker's own hooks hold no node
    (ulysses.torch_internals._acyclic_module_hooks)."""
    import torch
    from torch import nn

    from arctic.plan.tracing import track_peak

    class Model(nn.Module):
        def __init__(self, dead: bool) -> None:
            super().__init__()
            self.a, self.act, self.dead = nn.Linear(256, 256), nn.SiLU(), dead

        def forward(self, x):
            if self.dead:  # a module on a slice (relu keeps its result for the backward)
                self.act(self.a(x).relu()[:, :128])
            return self.a(x).square().sum()

    peaks = []
    for dead in (False, True):
        model = Model(dead)
        x = torch.randn(512, 256, requires_grad=True)
        with track_peak(track=(model, x)) as tracker:
            model(x).backward()
            tracker.end_phase("step")
        peaks.append(tracker.phases["step"].total)
    assert peaks[0] == peaks[1], peaks


def _peaks_with_the_collector_off_and_eager() -> list[dict]:
    import gc

    from arctic.plan.traces import trace

    config, sp = _chunked_hybrid(2, 2, 256)
    before, enabled = gc.get_threshold(), gc.isenabled()
    peaks = []
    try:
        for threshold in (None, (1, 1, 1)):
            gc.collect()
            if threshold is None:
                gc.disable()
            else:
                gc.enable()
                gc.set_threshold(*threshold)
            peaks.append({k: (v.total, v.by_kind) for k, v in
                          trace(config, sp, 2, 3000, shard=True).items()})
    finally:
        gc.set_threshold(*before)
        (gc.enable if enabled else gc.disable)()
    return peaks


@pytest.mark.slow  # 15 s; test_a_dead_branch_under_module_tracking_holds_nothing: the cause
def test_a_trace_reads_the_same_whenever_the_collector_runs():
    """The same hybrid step traced with the garbage collector off and with it collecting at
    every allocation holds the same bytes. MemTracker's module tracking once kept dead parts
    of the graph (a traced summary pass's, when the traced scans gave the state no
    gradient) in reference cycles: a second trace in one process read a tiny Qwen3.5
    15,421,500 bytes at the backward's peak against 15,029,820."""
    off, eager = plan_server.call(_peaks_with_the_collector_off_and_eager,
                                  env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert off == eager


def _pieces_with_a_backward() -> dict[str, int]:
    from collections import Counter

    from arctic.hf import mixer_chunks
    from arctic.plan.traces import trace

    counted: Counter = Counter()
    original = mixer_chunks._Piece.backward

    def backward(ctx, grad):
        counted["with a gradient" if grad is not None else "without"] += 1
        return original(ctx, grad)

    config, sp = _chunked_hybrid(2, 2, 256)
    mixer_chunks._Piece.backward = staticmethod(backward)
    try:
        trace(config, sp, 2, 3000, shard=True)
    finally:
        mixer_chunks._Piece.backward = staticmethod(original)
    return dict(counted)


def test_a_traced_ring_passes_gradients_through_the_mixer_state():
    """In a trace, as in a real step, the scans' final states depend on their inputs and the
    output on the incoming state (ulysses.mixers.traced_scan's ``final`` and ``initial``):
    on a ring of 2 with mixer chunks of 256, the gated delta net layer's pieces all take a
    gradient in the backward: the summary pass's 6 chunks too, besides the output pass's 6
    and the 2 tails (with the state given none, the summary pass had no backward: 8)."""
    counted = plan_server.call(_pieces_with_a_backward, env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert counted == {"with a gradient": 14}, counted


@pytest.mark.parametrize("ring,heads_per_chunk", [
    (1, 1),
    # 40 s: 32 head-chunk steps (period 1) of 8 ring hops each, counted in full
    pytest.param(8, 1, marks=pytest.mark.slow),
    pytest.param(2, 2, marks=pytest.mark.slow)])
def test_work_trace_shortcuts_change_no_count(ring, heads_per_chunk):
    """A work trace that leaves repeated tiles, head-chunk periods and ring hops out and
    weighs the iteration before each left-out run (ulysses.trace_shortcuts.work_trace)
    counts every class of work the full trace counts: the same FLOPs, bytes, collective
    bytes and kernel launches."""
    import torch

    from arctic.plan.models import model_config
    from arctic.plan.step import STACKS, stack_config
    from arctic.plan.traces import _work_trace

    world = 8
    config = model_config("llama3-8b", layers=1)
    sp = stack_config(dict(STACKS["ours"], ring_degree=ring, head_chunk_size=heads_per_chunk,
                           tiled_mlp=5, loss_tiles=7), world=world)
    seq_len = 2 * 1024 * world + 6 * world  # uneven tiles
    counts = [_work_trace(config, sp, world, seq_len, shard=True, compute_dtype=torch.bfloat16,
                          shortcuts=shortcuts).as_dict() for shortcuts in (False, True)]
    assert counts[0]["ops"] > 0 and counts[0]["collective"] > 0
    for k, full in counts[0].items():
        assert counts[1][k] == pytest.approx(full, rel=1e-12, abs=0), k


def test_work_trace_weighs_what_it_leaves_out():
    """In a work trace over fake tensors, a loop leaves out the same iterations as in a memory
    trace, and the iteration before each left-out run counts for it; over real tensors every
    iteration runs once."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from arctic.tiling.tiles import tile_rows
    from ulysses.trace_shortcuts import work_trace, work_weight

    def run(x):
        return [(i, n, work_weight()) for i, _, n in tile_rows(x, 10, 7)]

    with work_trace():
        assert run(torch.zeros(10)) == [(i, n, 1) for i, n in
                                        enumerate((2, 2, 2, 1, 1, 1, 1))]
        with FakeTensorMode():
            fake = torch.zeros(10)
            # sizes 2, 2, 2, 1, 1, 1, 1: tile 1 stands for tile 2, tile 4 for tile 5
            assert run(fake) == [(0, 2, 1), (1, 2, 2), (3, 1, 1), (4, 1, 2), (6, 1, 1)]
    assert work_weight() == 1


def _seq_chunk_peak(ulysses: int, blocks: int, shortcuts: bool) -> int:
    """The traced peak of one sequence-blocked attention fwd+bwd as rank 0 of ``ulysses``
    ranks (a fake group): only the attention, so the peak falls inside its piece loops."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ulysses.torch_internals import step_mem_tracker

    from arctic.plan.tracing import fake_world
    from ulysses import SequenceParallelDims, ulysses_attention
    from ulysses.trace_shortcuts import memory_trace

    fake_world(ulysses)
    mesh = SequenceParallelDims(ulysses, ulysses, 1, True, False).build_mesh("cpu")
    with FakeTensorMode(), memory_trace() if shortcuts else contextlib.nullcontext():
        q, k, v, dout = (torch.randn(1, 96, h, 16) for h in (8, 4, 4, 8))
        q.requires_grad_()
        tracker = step_mem_tracker()
        tracker.track_external(q, k, v, dout)
        with tracker:
            ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=1,
                              seq_chunk=blocks).backward(dout)
        return tracker.get_tracker_snapshot("peak")[q.device]["Total"]


def test_sequence_block_shortcuts_keep_the_largest_pieces():
    """At Ulysses 4 a block pair holds pieces of up to 4 query lengths; the shortcut trace
    keeps, of each kind and key length, the pieces with the most query rows, and its peak,
    which falls inside the piece loops here, is the full trace's byte for byte."""
    full, cut = (plan_server.call(_seq_chunk_peak, 4, 3, shortcuts,
                                   env={"ARCTIC_PLAN_CACHE": _CACHE})
                 for shortcuts in (False, True))
    assert full == cut and full > 0, (full, cut)


def test_trace_shortcuts_never_touch_real_tensors():
    """Inside memory_trace(), tile loops over real tensors still run every tile (and the tiled
    loss is the same); over fake tensors they skip the repeats but keep the last tile."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from arctic.tiling.tiles import tile_rows
    from arctic.loss.tiled import tiled_logits_loss
    from ulysses.trace_shortcuts import memory_trace

    real = torch.zeros(10)
    with memory_trace():
        assert [i for i, _, _ in tile_rows(real, 10, 7)] == list(range(7))
        with FakeTensorMode():
            fake = torch.zeros(10)
            # sizes 2, 2, 2, 1, 1, 1, 1: each size's first two tiles, and the last
            assert [i for i, _, _ in tile_rows(fake, 10, 7)] == [0, 1, 3, 4, 6]
    assert [i for i, _, _ in tile_rows(fake, 10, 7)] == list(range(7))  # outside: all
    torch.manual_seed(0)
    h, w = torch.randn(37, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (37,))
    grads = []
    for ctx in (memory_trace(), contextlib.nullcontext()):
        with ctx:
            loss, _ = tiled_logits_loss(h[None], w, labels[None], tiles=9)
            grads.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _deepened_against_traced(stack: str, per_rank: int) -> list[tuple[int, int]]:
    """Tiny-llama at 8 layers over 2 ranks: each phase at ``per_rank`` tokens per rank, its
    deeper layers' bytes read off the anchors' line, and traced at both depths."""
    from arctic.plan import model_config, stack_config
    from arctic.plan.estimate import ANCHOR_TOKENS
    from arctic.plan.traces import Tracer

    tracer = Tracer(model_config("tiny-llama", layers=8), stack_config(stack, world=2), 2,
                    shard=True)
    anchors = tuple(2 * t for t in ANCHOR_TOKENS)
    read = tracer.deep(2 * per_rank, full=False, anchors=anchors)
    traced = tracer.deep(2 * per_rank, full=False)
    return tracer.steady(anchors), [(read[k].total, traced[k].total) for k in traced] + [
        (read[k].host, traced[k].host) for k in traced]


@pytest.mark.parametrize("stack", [
    "ours",
    # 7 s: the inputs kept on the device, traced at both depths (the default run: "ours")
    pytest.param("ours-no-offload", marks=pytest.mark.slow)])
def test_the_deeper_layers_bytes_are_read_off_the_anchors_line(stack):
    """Past the anchors a length is traced at the shallower depth alone where the deeper
    layers add the same device bytes at both anchors (their state: the inputs offloaded),
    what they add read off the line through the anchors; where they keep their inputs on
    the device the length is traced at both depths. Tiny-llama, 200K tokens per rank."""
    steady, pairs = plan_server.call(_deepened_against_traced, stack, 200 * 1024,
                                     env={"ARCTIC_PLAN_CACHE": _CACHE})
    assert steady == (stack == "ours")
    for read, traced in pairs:
        assert abs(read - traced) <= 1e-4 * traced, (read, traced)


@pytest.mark.slow
def test_a_bent_line_is_traced_instead():
    """Two layers on ring 2 x Ulysses 4 at 160K tokens per rank: the check at 128K sees the
    line through 48K and 96K 2.45% off (past the anchors the peak is no longer the same
    tensors grown), and the length (within the next line's anchors, 128K and 256K) is
    traced instead."""
    proc = _run("-m", "arctic.plan", "--model", "llama3-8b", "--layers", "2", "--seq-len",
                "1280K", "--gpus", "8", "--ring", "2", "--ulysses", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "how: traced (the line through 48K and 96K was" in proc.stdout, proc.stdout


@pytest.mark.slow  # 65 s; the search's logic, in the default run:
# test_search_tries_sequence_chunks_on_the_best_ulysses_split (a stand-in planner)
def test_search_winner_fits_and_every_other_factorization_does_not(tmp_path):
    """--find-max searches ring x Ulysses over 4 ranks (tiny Llama: 8 query / 4 kv heads, so
    every split is valid): the winner fits at its length, and each other factorization,
    planned at that length, does not fit (or is the winner's tie at a larger ring); the
    device-bound search also tried the layer inputs without prefetch on the winner's split
    and seq_chunk="auto" on its best split with Ulysses > 1."""
    cfg = tmp_path / "chosen_ds.json"
    got = _plan(tmp_path, "--model", "tiny-llama", "--gpus", "4", "--gpu-memory", "28MiB",
                "--host-memory", "1GiB", "--find-max", "--write-config", str(cfg))
    best, rows = got["max_seq_len"], got["search"]
    assert best > 0 and {(r["ring"], r["ulysses"]) for r in rows} >= {(1, 4), (2, 2), (4, 1)}
    winner = [r for r in rows if r["max_seq_len"] == best and r["at_winner"]["fits"]]
    assert winner
    for r in rows:
        if r["max_seq_len"] == 0:  # a variant that did not fit one granule past the winner
            assert r["at_winner"] is None, r
            assert (r["fields"].get("seq_chunk") == "auto"
                    or r["fields"].get("offload_state") in ("optimizer", "optimizer+params")
                    or r["fields"].get("offload_prefetch") is False), r
        elif r["max_seq_len"] < best:
            assert not r["at_winner"]["fits"], r
    assert sum(r["fields"].get("offload_prefetch") is False and not r["fields"].get("seq_chunk")
               for r in rows) == 1
    # device-bound (temporaries): sequence chunks were tried on the best Ulysses > 1 split
    assert [(r["ring"], r["ulysses"]) for r in rows if r["fields"].get("seq_chunk")] == [(1, 4)]
    written = json.loads(cfg.read_text())
    assert written["ulysses"] == got["settings"]["ulysses"]
    assert written["sequence_parallel_size"] == 4


def test_optimizer_offload_moves_the_state_to_the_host(tmp_path):
    """--offload-state optimizer (ZeRO-3 offload_optimizer): the device keeps the phase's
    peak without the sharded state plus the bf16 partition and the gradient bucket; the host
    adds 18 bytes per parameter of the shard (arctic.memory.placement, checked against DeepSpeed in
    tests/test_arctic_plan_offload.py). A --ds-config with the block plans the same."""
    args = ["--model", "tiny-llama", "--seq-len", "8K", "--gpus", "2"]
    none = _plan(tmp_path, *args, name="none.json")["estimate"]
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "sequence_parallel_size": 2,
                              "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                    "offload_optimizer": {"device": "cpu"}},
                              "ulysses": {"head_chunk_size": 1, "fuse_projections": True,
                                          "tiled_mlp": "auto", "loss_tiles": "auto",
                                          "activation_checkpointing": True,
                                          "offload_activations": True}}))
    off = _plan(tmp_path, *args, "--ds-config", str(ds), name="off.json")["estimate"]
    n = off["shard_params"]
    assert n == none["shard_params"] > 0 and off["state_offload"] == "optimizer"
    assert off["state_host_bytes"] == 18 * n
    assert off["host_peak_bytes"] == none["host_peak_bytes"] + 18 * n
    # the bucket: 1000 elements of the SP comm dtype (fp32 by default with SP > 1)
    assert off["device_peak_bytes"] == off["stateless_peak_bytes"] + 2 * n + 4000
    # the parameter shards and AdamW's moments (12 bytes per parameter) are alive all step,
    # so without the state every moment is at least that much lower
    assert off["stateless_peak_bytes"] <= none["device_peak_bytes"] - 12 * n
    assert off["device_peak_bytes"] < none["device_peak_bytes"]
    # the device budget: 80 GiB less the 5% reserve, over the allocator headroom
    assert none["device_budget"] == int((80 << 30) * 0.95 / 1.12)
    bare = _plan(tmp_path, *args, "--allocator-headroom", "1.0", name="bare.json")["estimate"]
    assert bare["device_budget"] == int((80 << 30) * 0.95)


@pytest.mark.parametrize("mode", ["optimizer", "optimizer+params"])
def test_an_offload_without_a_config_plans_the_config_it_writes(tmp_path, mode):
    """--offload-state without --ds-config (and the search's state trade, which plans the
    same way) plans the DeepSpeed JSON it writes, ZeRO-3's gradient bucket included (500M
    elements of fp32 at DeepSpeed's default size): planning the written file gives the same
    device bytes. A bare Placement(mode) left the bucket out, 1.86 GiB under the config."""
    from arctic.plan.launch import written_placement

    args = ["--model", "tiny-llama", "--seq-len", "8K", "--gpus", "2"]
    cfg = tmp_path / "written.json"
    own = _plan(tmp_path, *args, "--offload-state", mode, "--write-config", str(cfg),
                name="own.json")["estimate"]
    again = _plan(tmp_path, *args, "--ds-config", str(cfg), name="again.json")["estimate"]
    assert own["state_offload"] == again["state_offload"] == mode
    assert own["device_peak_bytes"] == again["device_peak_bytes"]
    assert written_placement(mode, 2).device_fixed == 500_000_000 * 4


@pytest.mark.slow  # 20 s
def test_plans_gemma2_with_attention_softcapping(tmp_path):
    """transformers refuses sdpa for Gemma2 with attention softcapping; the planner builds it
    with eager attention (the recipe swaps in the sequence-parallel one) and traces the
    blockwise softcap kernel through its memory-trace shortcuts."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 attn_logit_softcapping=50.0, final_logit_softcapping=None,
                 sliding_window=4096, query_pre_attn_scalar=32).save_pretrained(tmp_path)
    est = _plan(tmp_path, "--model", str(tmp_path / "config.json"), "--seq-len", "8K",
                "--gpus", "2", "--stack", "ours", "--no-fuse-projections", "--no-tiled-layer",
                "--quick")["estimate"]
    assert est["fits"] and est["device_peak_bytes"] > 0, est


def test_plans_each_ring_layout(tmp_path):
    """ulysses.ring_layout reaches the trace: the per-document layout plans one document per
    row, cut as the zigzag cuts it, so its peak is the zigzag's and the batch's varlen
    arguments (cu_seq_lens_q and _k: [0, 8192] in int32, 16 bytes); the plan names it."""
    peaks = {}
    for layout in ("zigzag", "per_document"):
        cfg = tmp_path / f"{layout}.json"
        cfg.write_text(json.dumps({"sequence_parallel_size": 4, "ulysses": {
            "ring_degree": 2, "ring_layout": layout, "head_chunk_size": 1}}))
        out = _plan(tmp_path, "--model", "tiny-llama", "--gpus", "4", "--seq-len", "8K",
                    "--ds-config", str(cfg), "--quick", name=f"{layout}_plan.json")
        assert out["estimate"]["sp"]["ring_layout"] == layout, out["estimate"]["sp"]
        peaks[layout] = out["estimate"]["device_peak_bytes"]
    assert peaks["per_document"] - peaks["zigzag"] == 2 * 2 * 4 and peaks["zigzag"] > 0, peaks


def _parameters(config) -> tuple[int, int]:
    """The model's parameter count, and its vision tower's (0 without one)."""
    import torch
    import transformers

    vlm = hasattr(config, "vision_config")
    auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    vision = sum(p.numel() for p in model.model.visual.parameters()) if vlm else 0
    return sum(p.numel() for p in model.parameters()), vision


def test_plans_a_vlm_with_its_vision_tower(tmp_path):
    """A VLM config (tiny Qwen2.5-VL): the whole model is built and sharded, so the planned
    parameter shard holds the vision tower's share too; the step is traced on the merged
    sequence, and the plan says what it leaves out (the vision activations)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, hidden_size=256, intermediate_size=512, num_heads=4,
                  out_hidden_size=128, patch_size=14, spatial_merge_size=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    config.save_pretrained(tmp_path)
    est = _plan(tmp_path, "--model", str(tmp_path / "config.json"), "--seq-len", "4K",
                "--gpus", "2", "--stack", "ours-no-offload", "--quick", "--no-search")["estimate"]
    assert est["fits"] and any("vision tower" in n for n in est["notes"]), est
    whole, vision = _parameters(config)
    assert vision > 0.3 * whole  # the test's vision tower is no rounding error
    # FSDP2 shards each unit's parameters over the 2 ranks (padded to even rows)
    assert abs(est["shard_params"] - whole / 2) <= 0.01 * whole / 2, (est, whole, vision)


def test_plans_an_moe_with_its_experts(tmp_path):
    """An MoE config (tiny Mixtral, 4 experts): every expert's parameters are in the planned
    shard, and the routed activations are traced: two experts per token plan a larger peak
    than one."""
    from transformers import MixtralConfig

    peaks = {}
    for k in (1, 2):
        config = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=512,
                               num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, num_local_experts=4,
                               num_experts_per_tok=k, tie_word_embeddings=False)
        config.save_pretrained(tmp_path / f"k{k}")
        est = _plan(tmp_path, "--model", str(tmp_path / f"k{k}" / "config.json"), "--seq-len",
                    "8K", "--gpus", "2", "--stack", "ours-no-offload", "--tiled-mlp", "none",
                    "--quick", "--no-search", name=f"k{k}.json")["estimate"]
        whole, _ = _parameters(config)
        assert abs(est["shard_params"] - whole / 2) <= 0.01 * whole / 2, (est, whole)
        peaks[k] = est["device_peak_bytes"]
    # k=2 routes each token to two experts: at least one more [tokens, intermediate] buffer
    assert peaks[2] - peaks[1] >= 4096 * 512 * 2, peaks


def _hybrid_config():
    import transformers as tf

    return tf.Qwen3_5TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=16, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                                linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, tie_word_embeddings=False)


def test_a_hybrid_is_traced_along_whole_periods_of_its_layers():
    """Qwen3.5's layers repeat every 4 (three gated delta nets, an attention layer): its depth
    line runs through 8 and 12 layers, a dense model's through 3 and 4."""
    import transformers as tf

    from arctic.plan.traces import layer_period, trace_layers

    assert layer_period(_hybrid_config()) == 4 and trace_layers(_hybrid_config()) == (8, 12)
    assert trace_layers(tf.LlamaConfig()) == (3, 4)


@pytest.mark.slow  # a full 16-layer trace beside the depth line
def test_plans_a_hybrid_along_whole_periods_of_its_layers(tmp_path):
    """A hybrid (tiny Qwen3.5, 16 layers) under our stack, whose fused projections and tiled
    layer tail its classes take: the peak read off the depth line through 8 and 12 layers
    equals a full trace's."""
    config = _hybrid_config()
    config.save_pretrained(tmp_path / "q")
    args = ["--model", str(tmp_path / "q" / "config.json"), "--seq-len", "4K", "--gpus", "2",
            "--quick", "--stack", "ours"]
    full = _plan(tmp_path, *args, "--full-trace", name="full.json")
    fast = _plan(tmp_path, *args, name="fast.json")
    assert fast["estimate"]["sp"]["fuse_projections"] is True
    assert fast["estimate"]["sp"]["tiled_layer"] is True
    a, b = fast["estimate"]["device_peak_bytes"], full["estimate"]["device_peak_bytes"]
    assert abs(a / b - 1) < 0.01, (a, b)


@pytest.mark.slow  # 40 s: traces at 8, 12 and 16 layers
def test_a_hybrids_depth_line_skips_its_first_period(monkeypatch, tmp_path):
    """Tiny Qwen3.5 on a ring of 8 with chunked mixers: its backward's peak at 16 layers, read
    off the line through 8 and 12 layers, is within 1.5% of the trace at 16 (each traced in a
    fresh process: the same to the byte on torch 2.13 and 2.15; off the line through 4 and 8,
    whose one-period model overlaps no later layer's gradient reduction: 1.2% under on torch
    2.13, the same on 2.15)."""
    import transformers as tf

    from arctic.config import SequenceParallelConfig
    from arctic.plan.traces import Tracer, backward_peak

    monkeypatch.setenv("ARCTIC_PLAN_CACHE", str(tmp_path))
    config = _hybrid_config()
    config.intermediate_size, config.hidden_size = 4096, 256
    assert isinstance(config, tf.Qwen3_5TextConfig) and config.num_hidden_layers == 16
    sp = SequenceParallelConfig(sequence_parallel_size=8, ring_degree=8, head_chunk_size=1,
                                fuse_projections=True, tiled_mlp="auto", tiled_layer=True,
                                activation_checkpointing=True, offload_activations=True,
                                mixer_chunk=1024)
    tracer = Tracer(config, sp, 8, shard=True)
    line = backward_peak(tracer.deep(32768, full=False)).total
    whole = backward_peak(tracer.at(32768, 16)).total
    assert abs(line / whole - 1) < 0.015, (line, whole)


@pytest.mark.slow  # a fresh hybrid trace; the holding itself: the test below
def test_tracing_warnings_are_one_line(tmp_path):
    """A hybrid traced afresh (a config no other test traces) warns while tracing
    (transformers' reference convolution): the answer carries one line about it, the
    warnings themselves held back, those of the trace workers too."""
    import transformers as tf

    tf.Qwen3_5TextConfig(vocab_size=256, hidden_size=96, intermediate_size=192,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=24, linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         tie_word_embeddings=False).save_pretrained(tmp_path / "q")
    proc = _run("-m", "arctic.plan", "--model", str(tmp_path / "q" / "config.json"),
                "--seq-len", "2K", "--gpus", "2", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    about = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "warning" in line.lower().replace(str(tmp_path).lower(), "")]
    assert len(about) == 1 and about[0].startswith("note: tracing gave "), about


def test_held_warnings_keep_what_tracing_says_and_print_on_request(monkeypatch, capsys):
    """held_warnings() keeps Python warnings and the transformers logger's records; the
    summary counts them; ARCTIC_PLAN_WARNINGS=1 prints each distinct one."""
    import logging
    import warnings

    from arctic.plan import traces
    from arctic.plan.cli import print_held

    traces.HELD.clear()
    with traces.held_warnings():
        warnings.warn("Module is None. Skipping PRE_BW hook.")
        warnings.warn("Module is None. Skipping PRE_BW hook.")
        logging.getLogger("transformers.integrations").warning("falling back")
    assert sorted(traces.HELD) == ["UserWarning: Module is None. Skipping PRE_BW hook."] * 2 + [
        "transformers.integrations: falling back"]
    print_held()
    assert capsys.readouterr().err.startswith("note: tracing gave 3 warning(s), 2 distinct")
    monkeypatch.setenv("ARCTIC_PLAN_WARNINGS", "1")
    print_held()
    assert sorted(capsys.readouterr().err.splitlines()) == [
        "warning: UserWarning: Module is None. Skipping PRE_BW hook.",
        "warning: transformers.integrations: falling back"]
    traces.HELD.clear()


def test_plans_a_state_space_model_without_its_attention_settings(tmp_path):
    """Mamba2 (no attention, no MLP): the default stack's head chunks, sequence blocks and
    tiled MLP are set aside, with a note each (the recipe would refuse them by name); the
    config has no position bound to raise."""
    import transformers as tf

    tf.Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=4,
                    head_dim=32, n_groups=2, state_size=8, chunk_size=16, expand=2,
                    tie_word_embeddings=False).save_pretrained(tmp_path / "m")
    proc = _run("-m", "arctic.plan", "--model", str(tmp_path / "m" / "config.json"),
                "--seq-len", "8K", "--gpus", "2", "--quick", "--json", str(tmp_path / "p.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for note in ("note: head_chunk_size=None: Mamba2ForCausalLM has no attention",
                 "note: tiled_mlp=None: Mamba2ForCausalLM's decoder layers hold no MLP"):
        assert note in proc.stdout, proc.stdout
    sp = json.loads((tmp_path / "p.json").read_text())["estimate"]["sp"]
    assert sp["head_chunk_size"] is None and sp["tiled_mlp"] is None


def test_the_search_rings_every_scanning_mixer(monkeypatch):
    """Gated delta nets, Mamba1 and short convolutions run on rings and at any degree (state
    passing, mixer_parallelism "auto"), so the search keeps every split the attention allows.
    A mixer without state passing would run under Ulysses only, over degrees its heads split:
    the search skips the rest (it would trace them, and fail)."""
    import dataclasses

    from arctic.hf.mixer_kinds import FAMILIES
    from arctic.plan.models import token_mixer_heads
    from arctic.plan.search import factorizations

    mixers = token_mixer_heads(_hybrid_config())
    assert mixers == [("Qwen3_5GatedDeltaNet", 4, 2)]
    kept = [(c.ring, c.ulysses) for c in factorizations(8, 4, 2, mixers=mixers) if not c.pruned]
    assert kept == [(2, 4), (4, 2), (8, 1)]  # 4 attention heads do not split over 8
    for others in ([("JambaMambaMixer", 4, 1)], [("Lfm2ShortConv", 1, 1)]):
        kept = [(c.ring, c.ulysses) for c in factorizations(4, 4, 2, mixers=others)
                if not c.pruned]
        assert kept == [(1, 4), (2, 2), (4, 1)], others
    monkeypatch.setitem(FAMILIES, "JambaMambaMixer", dataclasses.replace(
        FAMILIES["JambaMambaMixer"], diagonal=False))
    mamba1 = [("JambaMambaMixer", 4, 1)]
    kept = [(c.ring, c.ulysses) for c in factorizations(4, 4, 2, mixers=mamba1) if not c.pruned]
    assert kept == [(1, 4)]
    reasons = {(c.ring, c.ulysses): c.pruned for c in factorizations(4, 4, 2, mixers=mamba1)}
    assert "Ulysses only" in reasons[2, 2] and "Ulysses only" in reasons[4, 1]


def test_a_trace_calls_the_kernels_packages_modules_of_functions_as_their_functions():
    """transformers 5.25 with ``kernels`` holds some functions of its model files as modules
    of a function; inside the trace's block they are the functions (also inside the dispatch
    sequence parallelism installs there, before or during the block), and afterwards the
    modules again. (Their effect on a traced peak: the hybrid depth-line test on 5.25.)"""
    import sys
    import types

    import torch

    from arctic.hf.mixers import Dispatch
    from arctic.plan.tracing import plain_kernel_functions

    def conv(x):
        return x

    def scan(x):
        return x

    def module_of(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    file = types.ModuleType("transformers.models.arctic_test.modeling_arctic_test")
    file.conv, file.scan, file.weights = module_of(conv), Dispatch(module_of(scan), "scan"), \
        torch.nn.Linear(2, 2)
    modules = (file.conv, file.scan.original, file.weights)
    sys.modules[file.__name__] = file
    try:
        with plain_kernel_functions():
            assert file.conv is conv and file.scan.original is scan
            assert file.weights is modules[2]  # a module with parameters stays
            file.conv = Dispatch(file.conv, "conv")  # installed inside the block
        assert isinstance(file.conv, Dispatch) and file.conv.original is modules[0]
        assert file.scan.original is modules[1]
    finally:
        del sys.modules[file.__name__]
