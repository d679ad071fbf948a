"""``benchmarks/step_gpu.py``'s side measurements: the executed work on fake tensors
(``--flops-only``), one profiled step (``--profile``), and each attention kernel alone
(``--kernels``)."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from arctic.plan import (build, fake_world, init_optimizer_state, make_batch, model_config,
                         parse_tokens, stack_config, train_step)
from arctic.plan.work import count_work, model_flops

H100_BF16_TFLOPS = 989.0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- work alone, on fake tensors --------------------------------------------------------------

def flops_only(args, stacks, backends, dtype) -> dict:
    """Each stack's executed work (:func:`arctic.plan.work.count_work`), traced on fake tensors
    (any machine, no time): what recompute costs at the real shapes. With the kernel speeds
    (``--attention-tflops``, ``--matmul-tflops``) also the step time and MFU they imply."""
    from ulysses.torch_internals import FakeTensorMode

    fake_world(args.world)
    rows = []
    for tokens_text in args.tokens_per_rank:
        tokens = parse_tokens(tokens_text)
        for stack in stacks:
            backend = None if backends[0] == "auto" else backends[0]
            sp = replace(stack_config(stack, world=args.world), attention_backend=backend)
            seq = tokens * sp.sequence_parallel_size
            config = model_config(args.model, layers=args.layers, max_positions=seq)
            mesh = sp.dims(args.world).build_mesh("cpu")
            with FakeTensorMode(allow_non_fake_inputs=True):
                model, optimizer = build(config, sp, mesh, device="cpu", compute_dtype=dtype,
                                         host_memory_limit=1 << 50)
                init_optimizer_state(model, optimizer)
                batch = make_batch(seq, config.vocab_size, mesh, "cpu")
                with count_work() as work:
                    train_step(model, optimizer, batch)
            model_f = model_flops(config, tokens, seq, sp.sequence_parallel_size)
            attention = work.attention_fwd + work.attention_bwd
            attention_s = attention / (args.attention_tflops * 1e12)
            other_s = work.gemm / (args.matmul_tflops * 1e12)
            peak = args.peak_tflops or H100_BF16_TFLOPS
            rows.append({"stack": stack, "tokens_per_rank": tokens, "seq_len": seq,
                         "model_flops": model_f, "executed_flops": work.flops,
                         "attention_flops": attention, "other_flops": work.gemm,
                         "work": work.as_dict(),
                         "implied_step_s": attention_s + other_s,
                         "implied_mfu": model_f / (attention_s + other_s) / (peak * 1e12)})
            del model, optimizer, batch
            gc.collect()
    print(f"{args.model} x {args.layers} layers, {args.world} ranks: executed TFLOP per step "
          f"(rank 0), and the step implied by attention at {args.attention_tflops:g} and "
          f"matrix products at {args.matmul_tflops:g} TFLOP/s")
    print(f"{'stack':<22}{'tokens':>8}{'attention':>11}{'gemm':>9}{'executed':>10}"
          f"{'model':>8}{'step s':>8}{'MFU':>7}")
    for r in rows:
        print(f"{r['stack']:<22}{r['tokens_per_rank']:>8}{r['attention_flops'] / 1e12:11.1f}"
              f"{r['other_flops'] / 1e12:9.1f}{r['executed_flops'] / 1e12:10.1f}"
              f"{r['model_flops'] / 1e12:8.1f}{r['implied_step_s']:8.2f}"
              f"{100 * r['implied_mfu']:6.1f}%")
    return {"flops_only": rows, "attention_tflops": args.attention_tflops,
            "matmul_tflops": args.matmul_tflops}


# --- profile ---------------------------------------------------------------------------------

def profile_step(run, device, top: int) -> list[dict]:
    """One steady step under torch.profiler: the ``top`` ops by self time (CUDA time on a
    GPU, CPU time otherwise), each with its share of the step. Printed on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        train_step(run.model, run.optimizer, run.batch)
        _sync(device)
    cuda = device.type == "cuda"
    events = [e for e in prof.key_averages() if e.key and not e.key.startswith("ProfilerStep")]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(key(e) for e in events) or 1
    rows = [{"op": e.key, "self_us": key(e), "share": key(e) / total, "calls": e.count}
            for e in sorted(events, key=key, reverse=True)[:top]]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  profile of {run.label} / {run.resolved}: top {top} ops by self "
              f"{'CUDA' if cuda else 'CPU'} time (of {total / 1e6:.2f} s)")
        for r in rows:
            print(f"    {r['share']:6.1%} {r['self_us'] / 1e6:8.3f} s {r['calls']:7d} x  {r['op']}")
    return rows


# --- kernels alone --------------------------------------------------------------------------

def kernel_tflops(device, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                  backends, iters: int, dtype: torch.dtype) -> list[dict]:
    """Causal forward + backward of each backend alone, FLOPs = 3.5 forwards."""
    from ulysses.attention import local_attention
    from ulysses.kernels import check_supported

    g = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(1, seq_len, h, head_dim, generator=g, device=device, dtype=dtype)

    q, k, v, dout = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
    flops = 3.5 * 4 * seq_len * seq_len * heads * head_dim * 0.5
    rows = []
    for backend in backends:
        try:
            check_supported(backend, device, dtype, head_dim)
        except ValueError as e:
            rows.append({"backend": backend, "skipped": str(e)})
            continue
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        times = []
        try:
            for _ in range(iters + 1):  # the first is a warm-up
                _sync(device)
                start = time.perf_counter()
                local_attention(*leaves, causal=True, backend=backend).backward(dout)
                _sync(device)
                times.append(time.perf_counter() - start)
        except ValueError as e:  # its self-check at first use
            rows.append({"backend": backend, "skipped": str(e)})
            continue
        t = statistics.median(times[1:])
        rows.append({"backend": backend, "seconds": t, "tflops": flops / t / 1e12})
    return rows
