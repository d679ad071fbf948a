"""Helpers shared by tests; the rank-side ones run inside dist_pool workers."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from ulysses import SequenceParallelDims
from ulysses.attention import local_attention

# Tolerances against the float64 reference, per input dtype. fp32: flash kernels reorder the
# softmax sums, so ~1e-6 absolute is typical. bf16: inputs, outputs and gradients are rounded
# to 8 mantissa bits (relative step 2^-8 = 3.9e-3); values here are O(1).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float64: dict(atol=1e-9, rtol=1e-9),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
EPS32 = torch.finfo(torch.float32).eps
"""One fp32 ulp at 1.0 (2^-23)."""


def fp32_exactness(got, plain, ref, *, ulps: float = 4) -> tuple[float, float]:
    """``(error, bound)`` for "``got`` is as exact as ``plain``": two fp32 computations of the
    same values (a sequence-chunked path and the unchunked one, say) and their fp64
    reference ``ref``. The error is ``got``'s largest distance from ``ref``; the bound twice
    ``plain``'s own, plus ``ulps`` fp32 ulps of ``max |ref|``. Machine-independent: both
    paths add in this machine's kernels' order, so a CPU whose kernels round differently
    moves both distances alike, while a wrong result (a dropped block, a wrong merge) is of
    the order of ``max |ref|`` away."""
    ref = ref.double()
    scale = ref.abs().max().item()
    error = (got.double() - ref).abs().max().item()
    base = (plain.double() - ref).abs().max().item()
    return error, 2 * base + ulps * EPS32 * scale


def assert_fp32_exact(got, plain, ref, *, what: str, ulps: float = 4) -> None:
    """:func:`fp32_exactness` as an assertion."""
    error, bound = fp32_exactness(got, plain, ref, ulps=ulps)
    assert error <= bound, (f"{what}: {error:.3g} from fp64, more than twice the plain "
                            f"path's own distance plus {ulps} ulps ({bound:.3g})")

def causal_lm_loss(model, ids, documents=None):
    """HF's loss of ``model`` on ``ids`` (labels = ids), or, with ``documents`` (lengths
    along the row), each document run on its own and the loss the mean over all their
    targets: the reference of a packed batch whose documents do not see each other."""
    if documents is None:
        return model(input_ids=ids, labels=ids).loss
    total, count = 0.0, 0
    for part in ids.split(list(documents), dim=1):
        total = total + model(input_ids=part, labels=part).loss * (part.shape[1] - 1)
        count += part.shape[1] - 1
    return total / count


_MESHES: dict = {}


def get_mesh(world_size: int, ulysses: int, ring: int = 1, zigzag: bool | str = True):
    """One mesh per configuration per worker process (new_group is collective and not free).
    ``zigzag``: the ring layout, True, False or ``"per_document"``."""
    key = (world_size, ulysses, ring, zigzag)
    if key not in _MESHES:
        _MESHES[key] = SequenceParallelDims(world_size, ulysses, ring, bool(zigzag),
                                            zigzag == "per_document").build_mesh("cpu")
    return _MESHES[key]


def make_qkv(seed: int, B: int, S: int, H: int, K: int, D: int, dtype: torch.dtype):
    """Full q [B,S,H,D], k/v [B,S,K,D] and dout [B,S,H,D], identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, S, K, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def reference(q, k, v, dout, *, causal: bool, softmax_scale=None):
    """float64 out and (dq, dk, dv) of single-device attention on the full tensors."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend="math")
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def init_deepspeed_comm() -> None:
    """Let deepspeed.comm wrap the worker's existing gloo group (once per process)."""
    import deepspeed.comm as ds_dist

    from arctic.train.ds_shm import release_deepspeed_shm

    if not ds_dist.is_initialized():
        ds_dist.init_distributed(dist_backend="gloo", verbose=False)
        release_deepspeed_shm()  # else every pool leaves 69 MB per rank in /dev/shm


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
                "all_to_all_single", "batch_isend_irecv", "broadcast", "barrier",
                "reduce_scatter_tensor", "isend", "irecv", "send", "recv")


def value_error_of(fn) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error"."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


@contextlib.contextmanager
def count_collectives():
    """Count calls of torch.distributed's collectives (rank side) while the block runs: a
    ``Counter`` of names, empty when none started."""
    counts: Counter = Counter()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def launch_path_sources() -> dict[str, str]:
    """The source of each launch path (arctic.initialize, the Trainer's __init__,
    examples/train_fsdp.py), for tests that each one calls what it must."""
    import inspect
    from pathlib import Path

    import arctic.train.deepspeed
    import arctic.train.trainer

    repo = Path(__file__).resolve().parent.parent
    return {"arctic.initialize": inspect.getsource(arctic.train.deepspeed.initialize),
            "SequenceParallelTrainer": inspect.getsource(
                arctic.train.trainer.SequenceParallelTrainer.__init__),
            "train_fsdp.py": (repo / "examples" / "train_fsdp.py").read_text()}


def grads_of(model) -> dict:
    """Every parameter's gradient, by name (those that have one), copied."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def averaged_grads(model, world: int) -> dict:
    """:func:`grads_of` after averaging each gradient over the world, as DDP would."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    return grads_of(model)


def assert_step_matches(results, ref) -> None:
    """Every rank's ``(loss, grads)`` equals the reference's: the loss within 1e-5 relative,
    the same parameters with gradients, each within ``TOL[float32]``."""
    loss, grads = ref
    for got_loss, got in results:
        assert abs(got_loss - loss) <= 1e-5 * abs(loss), (got_loss, loss)
        assert set(got) == set(grads)
        for n, g in got.items():
            torch.testing.assert_close(g, grads[n], **TOL[torch.float32],
                                       msg=lambda m: f"{n}: {m}")
