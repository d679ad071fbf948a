"""The CUDA kernels against the float64 reference, on whatever GPU this is.

Every backend that this GPU and this install can run is checked (the others skip, with
``check_supported``'s reason): out, lse, dq, dk, dv, causal and not, GQA and MHA, through
``local_attention``; the pieces ring and window attention hand the kernels (row slices,
rectangular blocks, one key); and, on a one-rank mesh, head-chunked Ulysses, a sliding
window, and the ring code path. bf16 tolerances are those of ``helpers.TOL``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import TOL, make_qkv, reference, value_error_of
from test_ulysses_blocks import block_reference
from test_ulysses_window_sinks import reference as window_reference
from ulysses import SequenceParallelDims, shard_sequence, ulysses_attention
from ulysses.attention import local_attention
from ulysses.kernels import attention_backward, attention_forward, check_supported
from ulysses.mesh import axis_group
from ulysses.ring import ring_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BACKENDS = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "fa3", "fa4"]
BF16 = torch.bfloat16
B, S, D = 2, 128, 64


def _require(backend: str | None) -> None:
    if backend is None:  # automatic: select_backend's pick for this GPU must run and be right
        return
    problem = value_error_of(lambda: check_supported(backend, torch.device("cuda"), BF16, D))
    if problem != "no error":
        pytest.skip(problem)


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), **TOL[BF16],
                               msg=lambda m: f"{what}: {m}")


def _cuda_qkv(seed, H, K, S=S):
    return tuple(t.cuda() for t in make_qkv(seed, B, S, H, K, D, BF16))


@pytest.mark.parametrize("backend", BACKENDS + [None], ids=BACKENDS + ["auto"])
@pytest.mark.parametrize("H,K", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_local_attention_matches_math(backend, H, K, causal):
    _require(backend)
    q, k, v, dout = _cuda_qkv(H + K + causal, H, K)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # A scale other than 1/sqrt(D), so a wrapper that drops it fails.
    out, lse = local_attention(*leaves, causal=causal, softmax_scale=0.1, backend=backend,
                               return_lse=True)
    out.backward(dout)
    ref_out, dq, dk, dv = reference(q, k, v, dout, causal=causal, softmax_scale=0.1)
    _, ref_lse = attention_forward(q.double(), k.double(), v.double(), causal=causal,
                                   softmax_scale=0.1, backend="math")
    assert lse.dtype == torch.float32 and lse.shape == (B, H, S)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"),
                               (out, lse, *(t.grad for t in leaves)),
                               (ref_out, ref_lse, dq, dk, dv)):
        _close(got, want, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,keys", [((32, 96), (0, 48)), ((16, 48), (5, 6))],
                         ids=["rectangular", "one-key"])
def test_ring_and_window_pieces(backend, rows, keys):
    """Non-causal blocks as ring steps and window pieces pass them: row slices of a larger
    tensor (strided), fewer keys than queries, down to a single key."""
    _require(backend)
    q, k, v, dout = _cuda_qkv(7, 8, 2)
    qp, dp = (t[:, rows[0]:rows[1]] for t in (q, dout))
    kp, vp = (t[:, keys[0]:keys[1]] for t in (k, v))
    out, lse = attention_forward(qp, kp, vp, causal=False, softmax_scale=0.1, backend=backend)
    grads = attention_backward(dp, qp, kp, vp, out, lse, causal=False, softmax_scale=0.1,
                               backend=backend)
    wide = [t.double() for t in (dp, qp, kp, vp)]
    ref_out, ref_lse = attention_forward(*wide[1:], causal=False, softmax_scale=0.1,
                                         backend="math")
    ref = attention_backward(*wide, ref_out, ref_lse, causal=False, softmax_scale=0.1,
                             backend="math")
    for name, got, want in zip(("out", "lse", "dq"), (out, lse, grads[0]),
                               (ref_out, ref_lse, ref[0])):
        _close(got, want, name)
    # dk, dv: each kv head's gradient is the sum over its 4 query heads of per-head bf16
    # results (the kernels write them in bf16, then they are summed), so the rounding is that
    # of the terms, not of the sum: with one key every row's softmax is 1 and dv is 128 rows
    # of dout summed, where an element that cancels to about 1 still carries the terms'
    # rounding (0.065 off on an H200, the same for all three SDPA kernels). Measured against
    # the largest reference magnitude (atol + rtol x that; with one key dk is exactly 0).
    for name, got, want in zip(("dk", "dv"), grads[1:], ref[1:]):
        err = float((got.double() - want).abs().max())
        allowed = TOL[BF16]["atol"] + TOL[BF16]["rtol"] * float(want.abs().max())
        assert err <= allowed, f"{name}: {err:.3g} off, {allowed:.3g} allowed"


@pytest.fixture(scope="module")
def mesh():
    """A one-rank ("dp", "ring", "ulysses") mesh on this GPU. The planner's tests leave torch's
    fake process group behind; it is replaced, and the planner makes a new one when needed."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            pytest.skip("a real process group is already initialized in this process")
        dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield SequenceParallelDims(world_size=1, ulysses_degree=1).build_mesh("cuda")
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["chunked", "window", "ring", "ring-window"])
def test_one_rank_paths_match_reference(mesh, backend, path):
    """Head-chunked Ulysses (one head per step), a sliding window (band pieces: causal,
    rectangular, anticausal), and the ring's own code (its backward's dk/dv hop goes to this
    rank itself), all causal with GQA, on one GPU."""
    _require(backend)
    q, k, v, dout = _cuda_qkv(11, 8, 2)
    window = 48 if path.endswith("window") else None
    leaves = [shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v)]
    if path.startswith("ring"):
        out = ring_attention(*leaves, group=axis_group(mesh, "ring"), causal=True,
                             backend=backend, window=window)
    else:
        out = ulysses_attention(*leaves, mesh=mesh, causal=True, backend=backend, window=window,
                                head_chunk_size=1 if path == "chunked" else None)
    out.backward(shard_sequence(dout, mesh))
    ref = window_reference(*(t.cpu() for t in (q, k, v, dout)), window=window)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)),
                               ref):
        _close(got.cpu(), want, name)


DOCS = ((0, 37, 90), (0, 64))
"""Documents of the one-rank paths below: they cut the 128 rows at odd places."""
PATHS = {  # path -> (ring, head chunk, causal, window, documents)
    "documents": (False, None, True, None, DOCS),
    "ring-documents-window": (True, None, True, 21, DOCS),
    "symmetric-window": (False, None, False, 33, None),
    "chunked-symmetric-window-documents": (False, 1, False, 33, DOCS),
    "ring-full-documents": (True, None, False, None, DOCS),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", list(PATHS))
def test_one_rank_documents_and_symmetric_windows(mesh, backend, path):
    """Packed documents (row by row of the batch) and windows without a causal mask
    (anticausal, full and offset-causal pieces), through Ulysses, head chunks and the ring's
    own code, with GQA, on one GPU."""
    _require(backend)
    ring, chunk, causal, window, docs = PATHS[path]
    q, k, v, dout = _cuda_qkv(13, 8, 2)
    leaves = [shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v)]
    if ring:
        out = ring_attention(*leaves, group=axis_group(mesh, "ring"), causal=causal,
                             backend=backend, window=window, segments=docs)
    else:
        out = ulysses_attention(*leaves, mesh=mesh, causal=causal, backend=backend,
                                window=window, segments=docs, head_chunk_size=chunk)
    out.backward(shard_sequence(dout, mesh))
    ref = window_reference(*(t.cpu() for t in (q, k, v, dout)), window=window, starts=docs,
                           causal=causal)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)),
                               ref):
        _close(got.cpu(), want, name)


BLOCKS = (((3, 20), (40, 41), (95, 120)), ((66, 90),))
"""Gemma3-style image blocks of the one-rank paths below, each inside one of DOCS."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["plain", "chunked-documents-window"])
def test_one_rank_image_blocks(mesh, backend, path):
    """Blocks whose tokens see their whole block (``ulysses.blocks``: one anticausal piece
    per block, starting one key in, merged by lse), plain, and with head chunks, packed
    documents and a sliding window, with GQA, on one GPU."""
    _require(backend)
    q, k, v, dout = _cuda_qkv(17, 8, 2)
    docs, window = (DOCS, 21) if path != "plain" else (None, None)
    leaves = [shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*leaves, mesh=mesh, causal=True, backend=backend, window=window,
                            segments=docs, blocks=BLOCKS,
                            head_chunk_size=1 if path != "plain" else None)
    out.backward(shard_sequence(dout, mesh))
    ref = block_reference(*(t.cpu() for t in (q, k, v, dout)), BLOCKS, window=window,
                          starts=docs)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)),
                               ref):
        _close(got.cpu(), want, name)
