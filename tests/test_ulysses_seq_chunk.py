"""Sequence-chunked attention (ulysses.seq_chunk): equal to the head-chunked loop and to an
fp64 reference, with O(block) exchange buffers; refused combinations raise before any
collective.

Tolerances: against the fp64 reference, :data:`helpers.TOL` of the input dtype. Against the
unchunked head-chunked path in fp32, only the order of the softmax sums differs (the
log-sum-exp merge of the key blocks, float32 accumulators), so the chunked result must be as
exact as the unchunked one: its distance from fp64 at most twice the unchunked path's own,
plus 4 fp32 ulps of the largest value (:func:`helpers.assert_fp32_exact`). That bound is in
the machine's own units: a CPU whose kernels add in another order moves both distances
(a fixed 1e-6 of the largest value failed on an AVX-512 CPU, dk 1.79e-6). A wrong merge is
O(1) away (:func:`test_a_wrong_merge_is_caught`). Bit-identity is out of reach: the
unchunked kernel sums a row's keys in one order, the blocks in another.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dist_pool
from helpers import (DTYPES, TOL, assert_fp32_exact, count_collectives, fp32_exactness,
                     get_mesh, make_qkv)
from helpers import value_error_of as _error
from ulysses import BufferPool, shard_sequence, ulysses_attention
from ulysses.seq_chunk import (block_bounds, block_buffer_bytes, check_seq_chunk,
                               resolve_seq_chunk)
from ulysses.sharding import head_layout

D = 8


def _dense_reference(q, k, v, dout, *, causal, window=None, kv_len=None):
    """float64 ``(out, dq, dk, dv, lse)`` of masked softmax attention on the whole sequence."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    H, K, S = q.shape[2], k.shape[2], q.shape[1]
    kx, vx = (t.repeat_interleave(H // K, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) / math.sqrt(q.shape[-1])
    pos = torch.arange(S)
    seen = torch.ones(S, S, dtype=torch.bool)
    if causal:
        seen &= pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[:, None] - pos[None, :] < window
    if kv_len is not None:
        seen &= pos[None, :] < kv_len
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                               # [B, H, S]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), vx)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, lse.detach()


def _lse(mesh, q, k, v, *, causal, c, N, window, unpadded_len):
    """This rank's ``lse_BhS`` from the sequence-chunked forward loop, called directly."""
    from ulysses.attention import between_exchanges
    from ulysses.chunk_loop import ChunkConfig
    from ulysses.head_chunking import _SlicedChunks, build_schedule
    from ulysses.mesh import axis_group, axis_rank
    from ulysses.seq_chunk import run_forward, seq_chunking

    U = mesh["ulysses"].size()
    layout = head_layout(q.shape[2], k.shape[2], U)
    attn = between_exchanges(mesh, batch=q.shape[0], local_len=q.shape[1], causal=causal,
                             scale=D ** -0.5, backend="cpu_flash", unpadded_len=unpadded_len,
                             segments=None, window=window)
    cfg = ChunkConfig(group=axis_group(mesh, "ulysses"), rank=axis_rank(mesh, "ulysses"),
                      layout=layout, schedule=tuple(build_schedule(layout, c)), attn=attn,
                      overlap=False)
    return run_forward(_SlicedChunks(q, k, v), torch.empty_like(q), cfg, BufferPool(),
                       seq_chunking(attn, N))


def _rank_parity(world, H, K, B, S, causal, c, N, dtype_name, window, pad, comm, seed):
    """Sequence-chunked and unchunked (head-chunked) fwd+bwd on the same shards."""
    mesh = get_mesh(world, world)
    full = make_qkv(seed, B, S, H, K, D, DTYPES[dtype_name])
    q, k, v, dout = (shard_sequence(t, mesh, pad=pad).contiguous() for t in full)
    unpadded_len = S if pad else None
    got = {}
    for name, blocks in (("seq", N), ("plain", None)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*leaves, mesh=mesh, causal=causal, head_chunk_size=c,
                                window=window, unpadded_len=unpadded_len, comm_dtype=comm,
                                seq_chunk=blocks)
        out.backward(dout)
        got[name] = [out.detach()] + [t.grad for t in leaves]
    lse = _lse(mesh, q, k, v, causal=causal, c=c, N=N, window=window,
               unpadded_len=unpadded_len) if comm is None else None
    rank = mesh["ulysses"].get_local_rank()
    return rank, got, lse, sum(head_layout(H, K, world).q_sizes[:rank])


CASES = {  # world, H, K, B, S, causal, c, N, window, pad
    "u1-n3-causal": (1, 4, 2, 2, 12, True, 1, 3, None, False),
    "u1-n4-full-c2": (1, 4, 2, 1, 12, False, 2, 4, None, False),
    "u2-n1-causal": (2, 8, 2, 2, 32, True, 1, 1, None, False),
    "u2-k2-uneven-blocks-causal": (2, 8, 2, 2, 36, True, 1, 4, None, False),
    "u2-k8-c2-full": (2, 8, 8, 2, 32, False, 2, 3, None, False),
    "u2-k4-c4-uneven-causal": (2, 8, 4, 1, 32, True, 4, 5, None, False),
    "u2-padded-full": (2, 8, 4, 2, 29, False, 1, 4, None, True),
    "u2-window5": (2, 8, 2, 2, 32, True, 1, 3, 5, False),
    "u4-k2-replicated-causal": (4, 8, 2, 2, 32, True, 1, 3, None, False),
    "u4-k2-replicated-padded-full": (4, 8, 2, 2, 30, False, 2, 3, None, True),
    "u4-k4-full": (4, 8, 4, 1, 32, False, 1, 2, None, False),
    "u4-uneven-heads-idle-ranks": (4, 12, 6, 1, 32, True, 1, 3, None, False),
    "u4-k8-c2-window3": (4, 8, 8, 1, 32, True, 2, 4, 3, False),
}
MAX_DIFF: dict = {}


def _check(results, S, ref, dtype, tight):
    """Each rank's valid rows against the reference (at ``dtype``'s tolerance) and, with
    ``tight``, as exact as the unchunked path (:func:`helpers.assert_fp32_exact`); otherwise
    the unchunked path at ``dtype``'s tolerance."""
    out_r, dq_r, dk_r, dv_r, lse_r = ref
    for rank, got, lse, first in results:
        n = got["seq"][0].shape[1]
        valid = max(0, min(n, S - rank * n))
        rows = slice(rank * n, rank * n + valid)
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), got["seq"], got["plain"],
                                 (out_r, dq_r, dk_r, dv_r)):
            a, b = a[:, :valid], b[:, :valid]
            torch.testing.assert_close(a.double(), r[:, rows], **TOL[dtype],
                                       msg=lambda m: f"{name} rank {rank} vs reference: {m}")
            if tight:
                if valid:
                    assert_fp32_exact(a, b, r[:, rows], what=f"{name} rank {rank}")
            else:
                torch.testing.assert_close(a, b, **TOL[dtype],
                                           msg=lambda m: f"{name} rank {rank} vs unchunked: {m}")
            MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), (a - b).abs().max().item())
        if lse is not None:
            h = lse.shape[1]
            torch.testing.assert_close(lse[:, :, :S].double(), lse_r[:, first:first + h, :S],
                                       **TOL[torch.float32], msg=lambda m: f"lse: {m}")


def _run_case(world, H, K, B, S, causal, c, N, window, pad, dtype_name="fp32", comm=None,
              tight=True):
    seed = world * 100 + H * 10 + N
    results = dist_pool.run(_rank_parity, world, H, K, B, S, causal, c, N, dtype_name, window,
                            pad, comm, seed, world_size=world)
    full = make_qkv(seed, B, S, H, K, D, DTYPES[dtype_name])
    ref = _dense_reference(*full, causal=causal, window=window,
                           kv_len=S if pad and not causal else None)
    # bf16 exchanges round like bf16 inputs
    _check(results, S, ref, DTYPES[dtype_name] if comm is None else comm, tight)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_unchunked_and_reference(case):
    """out, dq, dk, dv (and lse) in fp32 against the fp64 reference, and as exact as the
    head-chunked path without sequence blocks."""
    world, H, K, B, S, causal, c, N, window, pad = CASES[case]
    _run_case(world, H, K, B, S, causal, c, N, window, pad)
    print(f"max |seq - unchunked| so far: {MAX_DIFF}")


def _rank_ring(world, U, R, zigzag, H, K, S, causal, N, window, pad, comm):
    """Sequence-chunked and unchunked fwd+bwd on a ring (hybrid when U > 1), and the fp64
    reference sharded as the mesh shards the inputs."""
    mesh = get_mesh(world, U, R, zigzag)
    full = make_qkv(world + S + N, 2, S, H, K, D, torch.float32)
    q, k, v, dout = (shard_sequence(t, mesh, pad=pad).contiguous() for t in full)
    got = {}
    for name, blocks in (("seq", N), ("plain", None)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*leaves, mesh=mesh, causal=causal, head_chunk_size=1,
                                window=window, unpadded_len=S if pad else None,
                                comm_dtype=comm, seq_chunk=blocks)
        out.backward(dout)
        got[name] = [out.detach()] + [t.grad for t in leaves]
    ref = _dense_reference(*full, causal=causal, window=window,
                           kv_len=S if pad and not causal else None)
    # the rows that hold tokens (padding rows have no reference)
    rows = shard_sequence(torch.ones(1, S, dtype=torch.bool), mesh, pad=pad)[0]
    return got, [shard_sequence(t, mesh, pad=pad) for t in ref[:4]], rows


RING_CASES = {  # world, U, R, zigzag, H, K, S, causal, N, window, pad
    # U=1: a block's run crosses the zigzag chunk boundary (6 of 12 rows)
    "r2-u1-zigzag-causal": (2, 1, 2, True, 4, 2, 24, True, 3, None, False),
    "r2-u2-zigzag-causal": (4, 2, 2, True, 8, 2, 48, True, 3, None, False),
    "r2-u2-contiguous-causal": (4, 2, 2, False, 8, 4, 32, True, 2, None, False),
    "r2-u2-window7": (4, 2, 2, True, 8, 2, 48, True, 3, 7, False),
    "r2-u2-padded-full": (4, 2, 2, True, 8, 2, 45, False, 3, None, True),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_and_hybrid(case):
    """seq_chunk composed with the ring (pure, and hybrid U=2 x R=2; zigzag and contiguous;
    a window; padding): out, dq, dk, dv as exact as the unchunked ring's, and the fp64
    reference at fp32's tolerance. Every ring rank's kv blocks are gathered to the host along the ring and the
    dk/dv sums go back to their owners."""
    world, U, R, zigzag, H, K, S, causal, N, window, pad = RING_CASES[case]
    for got, ref, rows in dist_pool.run(_rank_ring, world, U, R, zigzag, H, K, S, causal, N,
                                        window, pad, None, world_size=world):
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), got["seq"], got["plain"], ref):
            a, b, r = a[:, rows], b[:, rows], r[:, rows]
            assert_fp32_exact(a, b, r, what=f"{name} vs unchunked")
            torch.testing.assert_close(a.double(), r, **TOL[torch.float32],
                                       msg=lambda m: f"{name} vs reference: {m}")


def test_bf16_and_comm_dtype():
    """bf16 inputs (float32 merge and gradient sums) and bf16 exchanges of fp32 inputs: the
    reference at bf16's tolerance."""
    _run_case(2, 8, 2, 2, 32, True, 1, 3, None, False, dtype_name="bf16", tight=False)
    _run_case(2, 8, 4, 2, 32, False, 2, 3, None, False, comm=torch.bfloat16, tight=False)


def _rank_wrong_merge():
    """The parity check can fail: a merge that forgets the running lse's weight."""
    import ulysses.seq_chunk as sc

    def wrong(out, lse, out_b, lse_b):
        out.add_(out_b)
        lse.copy_(torch.logaddexp(lse, lse_b))

    mesh = get_mesh(1, 1)
    full = make_qkv(2, 1, 12, 4, 2, D, torch.float32)
    q, k, v, _ = full
    right = ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=1, seq_chunk=3)
    saved, sc.merge_into = sc.merge_into, wrong
    try:
        bad = ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=1, seq_chunk=3)
    finally:
        sc.merge_into = saved
    plain = ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=1)
    ref = _dense_reference(*full, causal=True)[0]
    return fp32_exactness(right, plain, ref), fp32_exactness(bad, plain, ref)


def test_a_wrong_merge_is_caught():
    """The bound of :func:`helpers.assert_fp32_exact` passes the right merge and fails the
    wrong one, by far."""
    (right, right_bound), (bad, bad_bound) = dist_pool.run(_rank_wrong_merge, world_size=1)[0]
    assert right <= right_bound, (right, right_bound)
    assert bad > 1000 * bad_bound, (bad, bad_bound)


@pytest.mark.parametrize("world,U,R", [(2, 2, 1), (4, 2, 2)], ids=["u2", "u2-r2"])
def test_fused_attention_with_seq_chunk(world, U, R):
    """The fused block (projections in the loop) with sequence blocks, on Ulysses 2 and on
    Ulysses 2 x ring 2: y, dx and every weight gradient equal the fused head-chunk loop's
    (fp32, as exact as it) and its float64 run's."""
    for got in dist_pool.run(_rank_fused, world, U, R, world_size=world):
        for name in got["seq"]:
            a, b, r = got["seq"][name], got["plain"][name], got["fp64"][name]
            assert_fp32_exact(a, b, r, what=name)
            torch.testing.assert_close(a.double(), r, **TOL[torch.float32],
                                       msg=lambda m: f"{name} vs fp64: {m}")


def _rank_fused(world, U, R):
    from ulysses.fused_attention import fused_attention

    mesh = get_mesh(world, U, R)
    H, K, E, B, S = 8, 2, 32, 2, 32
    g = torch.Generator().manual_seed(5)
    p = dict(wq=torch.randn(H * D, E, generator=g) / E ** 0.5,
             wk=torch.randn(K * D, E, generator=g) / E ** 0.5,
             wv=torch.randn(K * D, E, generator=g) / E ** 0.5,
             wo=torch.randn(E, H * D, generator=g) / (H * D) ** 0.5,
             bq=torch.randn(H * D, generator=g))
    x, dy = (shard_sequence(torch.randn(B, S, E, generator=g), mesh) for _ in range(2))
    freqs = torch.arange(S)[:, None].float() / 100 ** (torch.arange(0, D, 2).float() / D)
    emb = shard_sequence(torch.cat((freqs, freqs), dim=-1)[None], mesh)
    got = {}
    for name, blocks, dtype in (("seq", 3, torch.float32), ("plain", None, torch.float32),
                                ("fp64", None, torch.float64)):
        backend = "math" if dtype == torch.float64 else None
        xs = x.to(dtype).clone().requires_grad_()
        ws = {n: t.to(dtype).clone().requires_grad_() for n, t in p.items()}
        y = fused_attention(xs, emb.cos().to(dtype), emb.sin().to(dtype), **ws, num_heads=H,
                            num_kv_heads=K, mesh=mesh, head_chunk_size=2, seq_chunk=blocks,
                            backend=backend)
        y.backward(dy.to(dtype))
        got[name] = {"y": y.detach(), "x": xs.grad, **{n: t.grad for n, t in ws.items()}}
    return got


# --- memory -----------------------------------------------------------------------------------

def _rank_buffers(N):
    """Largest buffer the pool creates, and the largest tensor any op makes besides the
    outputs and seq-local gradients, over one fwd+bwd at c=1."""
    mesh = get_mesh(2, 2)
    B, S, H, K = 1, 512, 8, 2
    q, k, v, dout = (shard_sequence(t, mesh).contiguous()
                     for t in make_qkv(7, B, S, H, K, 16, torch.float32))
    largest = {"pool": 0}
    seq_local = {tuple(q.shape), tuple(k.shape)}

    def seen(buf):
        largest["pool"] = max(largest["pool"], buf.numel())

    pool = BufferPool(on_allocate=seen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with _Largest(lambda t: tuple(t.shape) not in seq_local) as op:
        out = ulysses_attention(*leaves, mesh=mesh, causal=True, head_chunk_size=1,
                                buffer_pool=pool, seq_chunk=N)
        out.backward(dout)
    return {**largest, "op": op.numel}


class _Largest(TorchDispatchMode):
    """The largest 4-d tensor an op allocates (not a view of, or a write into, an input) among
    those ``counted`` accepts."""

    def __init__(self, counted) -> None:
        super().__init__()
        self.counted, self.numel = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.dim() == 4 and self.counted(t) and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return result


def test_device_buffers_shrink_with_the_blocks():
    """U=2, S=512, c=1: with 4 blocks the largest exchange buffer (the pool's) and the
    largest intermediate tensor are a quarter of the unchunked loop's (full-sequence chunk
    buffers), give or take a block's rounding."""
    plain = dist_pool.run(_rank_buffers, None, world_size=2)
    four = dist_pool.run(_rank_buffers, 4, world_size=2)
    for p, f in zip(plain, four):
        print(f"largest buffers: unchunked {p}, 4 blocks {f}")
        for kind in ("pool", "op"):
            assert 0.2 <= f[kind] / p[kind] <= 0.3, (kind, p, f)


def _rank_fused_largest(N):
    """The largest tensor of a chunk's heads (4-d, fewer heads than all H; not a view) that
    any op makes in one fwd+bwd of the fused block at c=1: projected heads, exchange blocks,
    gradients."""
    from ulysses.fused_attention import fused_attention

    mesh = get_mesh(2, 2)
    H, K, E, B, S = 4, 2, 32, 1, 256
    g = torch.Generator().manual_seed(5)
    w = dict(wq=torch.randn(H * D, E, generator=g), wk=torch.randn(K * D, E, generator=g),
             wv=torch.randn(K * D, E, generator=g), wo=torch.randn(E, H * D, generator=g))
    w = {n: (t / t.shape[1] ** 0.5).requires_grad_() for n, t in w.items()}
    x, dy = (shard_sequence(torch.randn(B, S, E, generator=g), mesh) for _ in range(2))
    x.requires_grad_()
    emb = shard_sequence(torch.randn(1, S, D, generator=g), mesh)
    with _Largest(lambda t: t.shape[2] < H) as op:
        y = fused_attention(x, emb.cos(), emb.sin(), **w, num_heads=H, num_kv_heads=K,
                            mesh=mesh, head_chunk_size=1, seq_chunk=N)
        y.backward(dy)
    return op.numel


def test_fused_chunk_tensors_shrink_with_the_blocks():
    """The fused block projects a step's heads (and takes their gradients back) one sequence
    block at a time: with 4 blocks no tensor of a chunk's heads is more than a quarter of the
    unchunked loop's largest (a full-sequence chunk buffer, or the seq-local projection of
    the heads every rank gets)."""
    plain = dist_pool.run(_rank_fused_largest, None, world_size=2)
    four = dist_pool.run(_rank_fused_largest, 4, world_size=2)
    for p, f in zip(plain, four):
        print(f"largest chunk tensor: unchunked {p}, 4 blocks {f}")
        assert 0.2 <= f / p <= 0.3, (p, f)


def _rank_trace(N, shortcuts, window):
    """Peak memory (MemTracker) and kernel calls of one fwd+bwd traced with fake tensors, as
    the memory planner traces a step, with or without its shortcuts."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from ulysses.torch_internals import step_mem_tracker

    import ulysses.seq_chunk as sc
    from ulysses.trace_shortcuts import memory_trace

    mesh = get_mesh(1, 1)
    calls = [0]
    saved = sc.piece_forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return saved(*args, **kwargs)

    sc.piece_forward = counting
    try:
        with FakeTensorMode(), memory_trace() if shortcuts else contextlib.nullcontext():
            q, k, v, dout = (torch.randn(1, 64, h, D) for h in (2, 1, 1, 2))
            q.requires_grad_()
            tracker = step_mem_tracker()
            tracker.track_external(q, k, v, dout)
            with tracker:
                ulysses_attention(q, k, v, mesh=mesh, causal=True, head_chunk_size=1,
                                  seq_chunk=N, window=window).backward(dout)
            peak = tracker.get_tracker_snapshot("peak")[q.device]["Total"]
    finally:
        sc.piece_forward = saved
    return peak, calls[0]


@pytest.mark.parametrize("window", [None, pytest.param(20, marks=pytest.mark.slow)],
                         ids=["causal", "window20"])  # window20: 5 s, the same shortcuts
def test_memory_trace_shortcuts(window):
    """The planner's shortcut trace keeps only block iterations whose shapes differ from the
    two before: the same peak as the full trace, byte for byte (left-out blocks still hold
    their host copies), and, causal, as many kernel calls at 16 blocks as at 8."""
    run = lambda n, cut: dist_pool.run(_rank_trace, n, cut, window, world_size=1)[0]  # noqa
    full, cut = run(8, False), run(8, True)
    assert full[0] == cut[0] and cut[1] < full[1], (full, cut)
    if window is None:
        assert run(16, True)[1] == cut[1], (cut, run(16, True))


# --- sizes and refusals ---------------------------------------------------------------------

def test_blocks_and_auto():
    assert block_bounds(10, 4) == ((0, 3), (3, 3), (6, 2), (8, 2))
    assert [len(c) for c in torch.arange(10).tensor_split(4)] == [3, 3, 2, 2]
    layout = head_layout(32, 8, 2)
    args = (layout, 1, 1, 16384, 64, torch.bfloat16)
    per_block = [block_buffer_bytes(layout, 1, n, 1, 16384, 64, torch.bfloat16) for n in (1, 4)]
    assert per_block[1] * 4 == per_block[0]
    assert resolve_seq_chunk("auto", *args, budget_bytes=1 << 40) == 1
    assert resolve_seq_chunk("auto", *args, budget_bytes=1) == 16384
    budget = per_block[0] // 5
    n = resolve_seq_chunk("auto", *args, budget_bytes=budget)
    assert block_buffer_bytes(layout, 1, n, 1, 16384, 64, torch.bfloat16) <= budget
    assert block_buffer_bytes(layout, 1, n - 1, 1, 16384, 64, torch.bfloat16) > budget
    assert resolve_seq_chunk(3, *args) == 3
    assert check_seq_chunk(None, head_chunk_size=None, local_len=4) is None


def _rank_refusals():
    mesh = get_mesh(2, 2)
    q, k, v, _ = (shard_sequence(t, mesh) for t in make_qkv(1, 1, 16, 4, 2, D, torch.float32))
    call = lambda m=mesh, **kw: ulysses_attention(  # noqa: E731
        q, k, v, **{"mesh": m, "causal": True, "head_chunk_size": 1, "seq_chunk": 2, **kw})
    with count_collectives() as counts:
        errors = {
            "no_chunking": _error(lambda: call(head_chunk_size=None)),
            "too_many": _error(lambda: call(seq_chunk=9)),
            "zero": _error(lambda: call(seq_chunk=0)),
            "float": _error(lambda: call(seq_chunk=2.0)),
            "bool": _error(lambda: call(seq_chunk=True)),
            "word": _error(lambda: call(seq_chunk="max")),
            "overlap": _error(lambda: call(chunk_overlap=True)),
            "overlap_type": _error(lambda: call(chunk_overlap="yes")),
        }
    return errors, dict(counts)


def test_refusals_raise_before_any_collective():
    errors, counts = dist_pool.run(_rank_refusals, world_size=2)[0]
    assert counts == {}, counts
    assert "seq_chunk needs head_chunk_size" in errors["no_chunking"]
    assert "seq_chunk=9 is more blocks than this rank's 8 rows; use at most 8" in \
        errors["too_many"]
    assert "chunk_overlap=True with seq_chunk: the sequence-chunked loop does not overlap" in \
        errors["overlap"]
    assert "chunk_overlap must be None, True or False, got 'yes'" in errors["overlap_type"]
    for name, bad in (("zero", "0"), ("float", "2.0"), ("bool", "True"), ("word", "'max'")):
        assert errors[name] == ("seq_chunk must be None, a positive int (blocks per rank's "
                                f"piece) or 'auto', got {bad}"), errors[name]
