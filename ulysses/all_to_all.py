"""The one all-to-all primitive: scatter one tensor dimension, gather another.

For Ulysses the two directions are (B = batch, S = full sequence, s = S / U local sequence,
H = all heads, h = this rank's heads, D = head dim, U = group size):

- seq -> head: ``x_BsHD`` -> ``x_BShD``: scatter_dim=2 (heads), gather_dim=1 (sequence);
- head -> seq: ``x_BShD`` -> ``x_BsHD``: scatter_dim=1 (sequence), gather_dim=2 (heads).

The backward of one direction is the other direction with the split sizes swapped. Splits may
be uneven: ``scatter_sizes[j]`` is what rank ``j`` receives along the scatter dim, and
``gather_sizes[j]`` is what rank ``j`` contributes along the gather dim (DeepSpeed's
``uneven_heads_all2all`` case). Both default to an even split.

Both directions go through ``all_to_all_single`` on one flat buffer, so the same code runs on
gloo and NCCL. Each direction costs one packing copy before the exchange and one unpacking
copy after; either is skipped when the scattered/gathered dim is dim 0 and already contiguous.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses import trace_shortcuts
from ulysses.buffer_pool import BufferPool


@dataclass(frozen=True, slots=True)
class _Plan:
    """Shapes and flat split sizes of one all-to-all, as seen from this rank."""

    world: int
    scatter_dim: int
    gather_dim: int
    scatter_sizes: tuple[int, ...]
    gather_sizes: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    send_numels: tuple[int, ...]
    recv_numels: tuple[int, ...]


def check_comm_dtype(comm_dtype) -> torch.dtype | None:
    """Validate the dtype sequence-parallel exchanges carry (``comm_dtype`` of the attention
    functions): None (the tensors' own) or a floating torch dtype; ``ValueError`` otherwise."""
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and
                                       comm_dtype.is_floating_point):
        raise ValueError(f"comm_dtype must be None or a floating torch dtype (torch.float32, "
                         f"torch.bfloat16, torch.float16), got {comm_dtype!r}")
    return comm_dtype


def _even(n: int, world: int, what: str) -> tuple[int, ...]:
    if n % world != 0:
        raise ValueError(f"{what} ({n}) must be divisible by the group size ({world}), "
                         f"or pass explicit split sizes")
    return (n // world,) * world


def _make_plan(shape: Sequence[int], world: int, rank: int, scatter_dim: int, gather_dim: int,
               scatter_sizes: Sequence[int] | None, gather_sizes: Sequence[int] | None) -> _Plan:
    ndim = len(shape)
    scatter_dim, gather_dim = scatter_dim % ndim, gather_dim % ndim
    if scatter_dim == gather_dim:
        raise ValueError(f"scatter_dim and gather_dim must differ, both are {scatter_dim}")
    if scatter_sizes is None:
        scatter_sizes = _even(shape[scatter_dim], world, f"size of scatter dim {scatter_dim}")
    if gather_sizes is None:
        gather_sizes = (shape[gather_dim],) * world
    scatter_sizes, gather_sizes = tuple(scatter_sizes), tuple(gather_sizes)
    if len(scatter_sizes) != world or sum(scatter_sizes) != shape[scatter_dim]:
        raise ValueError(f"scatter_sizes {scatter_sizes} must have {world} entries summing to "
                         f"{shape[scatter_dim]} (dim {scatter_dim} of shape {tuple(shape)})")
    if len(gather_sizes) != world or gather_sizes[rank] != shape[gather_dim]:
        raise ValueError(f"gather_sizes {gather_sizes} must have {world} entries, and entry "
                         f"{rank} must equal this rank's dim {gather_dim} ({shape[gather_dim]})")
    other = 1
    for d, n in enumerate(shape):
        if d not in (scatter_dim, gather_dim):
            other *= n
    out_shape = list(shape)
    out_shape[scatter_dim] = scatter_sizes[rank]
    out_shape[gather_dim] = sum(gather_sizes)
    return _Plan(
        world=world, scatter_dim=scatter_dim, gather_dim=gather_dim,
        scatter_sizes=scatter_sizes, gather_sizes=gather_sizes,
        in_shape=tuple(shape), out_shape=tuple(out_shape),
        send_numels=tuple(s * shape[gather_dim] * other for s in scatter_sizes),
        recv_numels=tuple(scatter_sizes[rank] * g * other for g in gather_sizes),
    )


def _pack(x: Tensor, plan: _Plan) -> Tensor:
    """Lay out ``x`` so that rank j's block is the j-th contiguous run of a flat buffer."""
    sd = plan.scatter_dim
    if sd == 0 and x.is_contiguous():
        return x.view(-1)  # blocks along dim 0 are already contiguous runs
    if len(set(plan.scatter_sizes)) == 1:
        # [..., (U n), ...] -> [U, ..., n, ...]: one copy, block j = index j of dim 0
        blocks = x.unflatten(sd, (plan.world, plan.scatter_sizes[0])).movedim(sd, 0)
        return blocks.contiguous().view(-1)
    send = x.new_empty(x.numel())
    offset, flat = 0, 0
    for size, numel in zip(plan.scatter_sizes, plan.send_numels):
        block = x.narrow(sd, offset, size)
        send[flat:flat + numel].view(block.shape).copy_(block)
        offset, flat = offset + size, flat + numel
    return send


def _unpack(recv: Tensor, plan: _Plan) -> Tensor:
    """Concatenate the per-source blocks of ``recv`` along the gather dim."""
    gd = plan.gather_dim
    block_shape = list(plan.out_shape)
    if gd == 0:
        return recv.view(plan.out_shape)  # blocks concatenate along dim 0 as they are
    if len(set(plan.gather_sizes)) == 1:
        # [U, ..., g, ...] -> [..., (U g), ...]: one copy
        block_shape[gd] = plan.gather_sizes[0]
        blocks = recv.view(plan.world, *block_shape).movedim(0, gd)
        # contiguous() rather than reshape(): with size-1 dims reshape can return a view with
        # odd strides, which breaks a caller's .view() and makes autograd copy the gradient.
        return blocks.contiguous().view(plan.out_shape)
    out = recv.new_empty(plan.out_shape)
    offset, flat = 0, 0
    for size, numel in zip(plan.gather_sizes, plan.recv_numels):
        block_shape[gd] = size
        out.narrow(gd, offset, size).copy_(recv[flat:flat + numel].view(block_shape))
        offset, flat = offset + size, flat + numel
    return out


class PendingExchange:
    """A block exchange in flight. :meth:`wait` returns the received blocks (views into one
    flat buffer, made when first asked for); :meth:`release` hands that buffer back to the
    pool once they are consumed."""

    def __init__(self, work, send: Tensor, recv: Tensor, shapes: Sequence[Sequence[int]],
                 pool: BufferPool | None) -> None:
        self._work, self._send, self._recv, self._pool = work, send, recv, pool
        self._shapes, self._views = shapes, None

    def arrive(self) -> None:
        """Wait for the exchange (and give the send buffer back), making no views."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._send is not None and self._pool is not None:
            self._pool.release(self._send)  # the exchange no longer reads it
        self._send = None

    def wait(self) -> list[Tensor]:
        self.arrive()
        if self._views is None and self._recv is not None:
            numels = [math.prod(shape) for shape in self._shapes]
            self._views = [r.view(shape) for r, shape in
                           zip(self._recv.split(numels), self._shapes)]
        return self._views

    def wait_flat(self) -> Tensor:
        """Like :meth:`wait`, but the whole receive buffer: the blocks back to back, 1-D."""
        self.arrive()
        return self._recv

    def release(self) -> None:
        if self._pool is not None and self._recv is not None:
            self._pool.release(self._recv)
        self._recv = self._views = None


class BlockViews(Sequence):
    """Send blocks made when read: ``make(r)`` is rank r's block (a view), and ``numels[r]``
    its element count, known without making it. A memory trace, which packs nothing
    (:mod:`ulysses.trace_shortcuts`), then makes only the first."""

    def __init__(self, make, numels: Sequence[int]) -> None:
        self._make, self.numels = make, list(numels)

    def __len__(self) -> int:
        return len(self.numels)

    def __getitem__(self, r: int) -> Tensor:
        return self._make(range(len(self))[r])  # IndexError past the end ends iteration


def exchange_blocks_async(send_blocks: Sequence[Tensor], recv_shapes: Sequence[Sequence[int]],
                          group: dist.ProcessGroup | None, *,
                          pool: BufferPool | None = None,
                          dtype: torch.dtype | None = None) -> PendingExchange:
    """Send ``send_blocks[r]`` to rank r and receive a ``recv_shapes[r]`` block from rank r.

    The lower-level form of :func:`all_to_all_async`, for callers that pick each rank's block
    themselves (head chunks, whose heads are not one contiguous range). Blocks may be strided
    views and may be empty, or a :class:`BlockViews` that makes them as read. Received blocks
    come back as contiguous views of one flat buffer, in rank order. With the list
    all-to-all (even blocks) this rank's own block never enters the send buffer: it is copied
    straight into its place in the receive buffer. Both buffers come from ``pool`` when given.
    On one rank a block that is a whole contiguous tensor in the travelling dtype is itself
    what arrives: no buffer is taken, and the caller reads the block it sent, so it must not
    write to it.
    ``dtype``: the dtype that travels (blocks are cast into the send buffer, and the received
    blocks are in it); default the blocks' own. No autograd.
    """
    first = send_blocks[0]
    world = len(send_blocks)
    if world == 1 and _whole(first, recv_shapes[0], dtype):
        # One rank: the block is what arrives, read in place (no buffer, no copy).
        return PendingExchange(None, None, first.reshape(-1), recv_shapes, None)
    me = dist.get_rank(group) if world > 1 else 0
    recv_numels = [math.prod(shape) for shape in recv_shapes]
    # gloo's list all-to-all needs equal sizes; it lets this rank's own block skip the send
    # buffer (copied straight into place). Uneven blocks, and gloo before torch 2.12 (no list
    # all-to-all), go through all_to_all_single, whose cumulative offsets need the self block
    # in the send buffer too.
    numels = (send_blocks.numels if isinstance(send_blocks, BlockViews) else
              [b.numel() for b in send_blocks])
    uniform = len(set(numels) | set(recv_numels)) == 1 and (
        world == 1 or trace_shortcuts.skip(first) or _has_list_all_to_all(group, first.device))
    skip = me if uniform else -1
    send_numels = [0 if r == skip else n for r, n in enumerate(numels)]
    dtype = first.dtype if dtype is None else dtype
    acquire = (lambda n: pool.acquire(n, dtype, first.device)) if pool is not None else (
        lambda n: torch.empty(n, dtype=dtype, device=first.device))
    send, recv = acquire(sum(send_numels)), acquire(sum(recv_numels))
    work = None
    if trace_shortcuts.skip(first):
        pass  # a memory trace: packing and the exchange fill buffers that exist
    elif uniform:
        _pack_blocks(send, send_blocks, send_numels, skip)
        recvs = list(recv.split(recv_numels))  # flat views at their offsets
        recvs[me].view(send_blocks[me].shape).copy_(send_blocks[me])
        if world > 1:
            sends = list(send.split(send_numels))
            sends[me] = recvs[me]  # the exchange's self copy is then a no-op onto itself
            work = dist.all_to_all(recvs, sends, group=group, async_op=True)
    else:
        _pack_blocks(send, send_blocks, send_numels, skip)
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_numels,
                                      input_split_sizes=send_numels, group=group, async_op=True)
    return PendingExchange(work, send, recv, recv_shapes, pool)


def _whole(block: Tensor, shape: Sequence[int], dtype: torch.dtype | None) -> bool:
    """Whether ``block`` can stand for its own receive buffer: contiguous, of that shape and
    the travelling dtype, and all of its storage (a view of more would keep the rest alive
    for as long as the block is read)."""
    return (block.is_contiguous() and tuple(block.shape) == tuple(shape)
            and (dtype is None or dtype == block.dtype) and
            block.untyped_storage().nbytes() == block.numel() * block.element_size())


_LIST_ALL_TO_ALL: dict[str, bool] = {}
"""Per backend name: whether its process groups take the list ``all_to_all``."""


def _has_list_all_to_all(group, device: torch.device) -> bool:
    """gloo has the list all-to-all only from torch 2.12 (pytorch#165435); before, it raises
    "Backend gloo does not support alltoall" on the calling rank, before any communication.
    Other backends (NCCL) always had it. For gloo the answer is probed once per process with
    an exchange of empty tensors: every rank of the group is in this same exchange and runs
    the same torch, so all of them probe together and reach the same answer."""
    backend = str(dist.get_backend(group))
    if backend != "gloo":
        return True
    if backend not in _LIST_ALL_TO_ALL:
        world = dist.get_world_size(group)
        empty = [torch.empty(0, device=device) for _ in range(2 * world)]
        try:
            dist.all_to_all(empty[:world], empty[world:], group=group)
            _LIST_ALL_TO_ALL[backend] = True
        except RuntimeError as e:
            if "does not support alltoall" not in str(e):
                raise
            _LIST_ALL_TO_ALL[backend] = False
    return _LIST_ALL_TO_ALL[backend]


def _pack_blocks(send: Tensor, blocks: Sequence[Tensor], numels: list[int], skip: int) -> None:
    """Copy each block but ``blocks[skip]`` into its place in the flat ``send`` buffer (in a
    work trace, one block of each size, weighed: :func:`ulysses.trace_shortcuts.alike`)."""
    offsets = [0, *itertools.accumulate(numels)]
    sizes = {r: numel for r, numel in enumerate(numels) if r != skip}
    for r, times in trace_shortcuts.alike(sizes, send):
        block = blocks[r]
        with trace_shortcuts.weighted(times):
            send[offsets[r]:offsets[r + 1]].view(block.shape).copy_(block)


class PendingAllToAll:
    """An all-to-all in flight; :meth:`wait` returns its result (not autograd-tracked)."""

    def __init__(self, work, recv: Tensor, plan: _Plan) -> None:
        self._work, self._recv, self._plan = work, recv, plan

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
        return _unpack(self._recv, self._plan)


def _start(x: Tensor, group, scatter_dim: int, gather_dim: int, scatter_sizes, gather_sizes,
           async_op: bool) -> PendingAllToAll:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = _make_plan(x.shape, world, rank, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
    if world == 1:
        return PendingAllToAll(None, x.contiguous().view(-1), plan)
    send = _pack(x, plan)
    recv = x.new_empty(sum(plan.recv_numels))
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(plan.recv_numels),
                                  input_split_sizes=list(plan.send_numels), group=group,
                                  async_op=async_op)
    return PendingAllToAll(work, recv, plan)


def all_to_all_async(x: Tensor, group: dist.ProcessGroup | None, *, scatter_dim: int,
                     gather_dim: int, scatter_sizes: Sequence[int] | None = None,
                     gather_sizes: Sequence[int] | None = None) -> PendingAllToAll:
    """Start the all-to-all of ``x`` and return a handle; no autograd.

    Args:
        x: any-rank tensor; ``x.shape[gather_dim]`` must equal ``gather_sizes[rank]``.
        group: the process group (the mesh's ``"ulysses"`` axis for Ulysses).
        scatter_dim: dim split across ranks; rank j receives ``scatter_sizes[j]`` of it.
        gather_dim: dim concatenated from all ranks, in rank order.
        scatter_sizes / gather_sizes: per-rank split sizes; default is an even split.

    Returns:
        A :class:`PendingAllToAll`. Its ``wait()`` gives a contiguous tensor shaped like ``x``
        but with ``scatter_dim`` of size ``scatter_sizes[rank]`` and ``gather_dim`` of size
        ``sum(gather_sizes)``.
    """
    return _start(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes, True)


def _all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int, scatter_sizes,
                gather_sizes) -> Tensor:
    # The blocking collective, not async + wait: the backend then drops its reference to the
    # send buffer before returning, so buffer lifetimes (and peak memory) are deterministic.
    return _start(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes, False).wait()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes):
        ctx.args = (group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
        return _all_to_all(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim, scatter_sizes, gather_sizes = ctx.args
        # The inverse exchange: gather where we scattered, scatter where we gathered.
        dx = _all_to_all(grad, group, gather_dim, scatter_dim, gather_sizes, scatter_sizes)
        return dx, None, None, None, None, None


def all_to_all(x: Tensor, group: dist.ProcessGroup | None, *, scatter_dim: int, gather_dim: int,
               scatter_sizes: Sequence[int] | None = None,
               gather_sizes: Sequence[int] | None = None) -> Tensor:
    """Autograd-aware all-to-all; same arguments and result as :func:`all_to_all_async`.

    Its backward is the same exchange with ``scatter_dim``/``gather_dim`` and
    ``scatter_sizes``/``gather_sizes`` swapped.
    """
    return _AllToAll.apply(x, group, scatter_dim, gather_dim,
                           None if scatter_sizes is None else tuple(scatter_sizes),
                           None if gather_sizes is None else tuple(gather_sizes))
