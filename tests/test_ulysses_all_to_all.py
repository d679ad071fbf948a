"""The all-to-all primitive: exact data movement, uneven splits, adjoint backward, async."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dist_pool
from ulysses import all_to_all, all_to_all_async


def _full(shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rank_seq_to_head(head_sizes, dtype_name, use_async):
    """[B, s, H, D] -> [B, S, h, D] must equal slicing the full tensor."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    B, s, D = 2, 3, 5
    H = sum(head_sizes) if head_sizes else 4 * world
    full = _full((B, s * world, H, D), dtype)
    local = full[:, rank * s:(rank + 1) * s]
    kw = dict(scatter_dim=2, gather_dim=1, scatter_sizes=head_sizes)
    out = all_to_all_async(local, None, **kw).wait() if use_async else all_to_all(local, None, **kw)
    sizes = head_sizes or [H // world] * world
    start = sum(sizes[:rank])
    torch.testing.assert_close(out, full[:, :, start:start + sizes[rank]], rtol=0, atol=0)
    # And back: head -> seq restores the local piece exactly.
    back = all_to_all(out, None, scatter_dim=1, gather_dim=2, gather_sizes=head_sizes)
    torch.testing.assert_close(back, local, rtol=0, atol=0)
    return out.is_contiguous() and back.is_contiguous()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("head_sizes", [None, [3, 1, 2, 2], [2, 2, 1, 1]], ids=str)
def test_seq_to_head_exact(head_sizes, use_async):
    assert all(dist_pool.run(_rank_seq_to_head, head_sizes, "fp32", use_async, world_size=4))


def test_bf16_through_gloo():
    assert all(dist_pool.run(_rank_seq_to_head, [2, 1], "bf16", False, world_size=2))


def _rank_adjoint(scatter_dim, gather_dim, scatter_sizes, shape):
    """Backward is the adjoint: sum_r <A x, g> == sum_r <x, A^T g> over all ranks."""
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(
        dist.get_rank())).requires_grad_()
    y = all_to_all(x, None, scatter_dim=scatter_dim, gather_dim=gather_dim,
                   scatter_sizes=scatter_sizes)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(
        100 + dist.get_rank()))
    y.backward(g)
    dots = torch.tensor([(y.detach() * g).sum().item(), (x.detach() * x.grad).sum().item()],
                        dtype=torch.float64)
    dist.all_reduce(dots)
    return dots.tolist()


@pytest.mark.parametrize("scatter_dim,gather_dim,scatter_sizes,shape", [
    (2, 1, None, (2, 3, 8, 4)),          # batch-first seq -> head
    (2, 0, [3, 1, 2, 2], (3, 2, 8, 4)),  # seq-first, uneven heads
    (1, 2, None, (2, 8, 3, 4)),          # head -> seq
    (0, 3, [1, 2, 3, 2], (8, 2, 3, 5)),  # scatter dim 0 (zero-copy pack)
])
def test_backward_is_adjoint(scatter_dim, gather_dim, scatter_sizes, shape):
    for lhs, rhs in dist_pool.run(_rank_adjoint, scatter_dim, gather_dim, scatter_sizes, shape,
                                  world_size=4):
        assert lhs == pytest.approx(rhs, rel=1e-12)


def _rank_bad_sizes():
    x = torch.zeros(2, 3, 5, 4)
    try:
        all_to_all(x, None, scatter_dim=2, gather_dim=1)  # 5 heads, 2 ranks, no sizes
    except ValueError as e:
        return str(e)
    return None


def test_uneven_without_sizes_is_value_error():
    for msg in dist_pool.run(_rank_bad_sizes, world_size=2):
        assert msg is not None and "(5)" in msg and "group size (2)" in msg


def test_a_work_trace_packs_one_block_of_each_size_and_counts_them_all():
    """Packing an exchange's send buffer (and placing received blocks) copies every block in
    a real step; a work trace over fake tensors copies the first block of each size once,
    weighed by how many share it, so the counted work is the full loop's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from arctic.plan.work import count_work
    from ulysses.all_to_all import _pack_blocks
    from ulysses.chunk_loop import place_blocks
    from ulysses.trace_shortcuts import work_trace

    def pack_and_place(make):
        blocks = [make(2, 3) * r for r in range(4)] + [make(1, 3), make(0, 3)]
        numels = [b.numel() for b in blocks]
        send = make(sum(numels))
        dest = make(1, 2, 9, 3)  # heads (0, 2), (2, 2), (4, 2), (6, 2), (8, 1), (8, 0)
        ranges = [(0, 2), (2, 2), (4, 2), (6, 2), (8, 1), (8, 0)]
        got = [b.view(1, 1, *b.shape).expand(1, 2, *b.shape) for b in blocks]
        with count_work() as work:
            _pack_blocks(send, blocks, numels, skip=1)
            place_blocks(dest, ranges, got, add=False)
        return work, send, dest

    real, send, dest = pack_and_place(lambda *s: torch.ones(*s))
    assert send[6:12].eq(1).all()  # the skipped block's place is left alone
    assert torch.equal(send[:6], torch.zeros(6)) and torch.equal(send[12:18], torch.full((6,), 2.0))
    assert torch.equal(dest[0, 0, 6:8], torch.full((2, 3), 3.0))
    with work_trace(), FakeTensorMode() as mode, _CopyCount() as copies:
        traced_work, _, _ = pack_and_place(lambda *s: mode.from_tensor(torch.ones(*s)))
    for k, v in real.as_dict().items():
        assert traced_work.as_dict()[k] == v, k
    assert real.ops == 5 + 5  # 5 packed (one skipped, an empty one included), 5 placed
    # packed: one of 6 elements (for 3), one of 3, one empty; placed: one of 2 heads (for 4), one of 1
    assert copies.n == 3 + 2


class _CopyCount(torch.utils._python_dispatch.TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))
