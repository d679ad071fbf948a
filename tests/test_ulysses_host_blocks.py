"""Host blocks (:mod:`ulysses.host_blocks`) keep their values across the streams: a parked
block whose device buffer is overwritten at once, a fetched block, a block written back and
dropped at once, a fetched block dropped unread. On CUDA the copies run on a side stream
(pinned host memory), so each case is a race the stream and allocator bookkeeping must win;
on CPU the same code copies in place."""

from __future__ import annotations

import pytest
import torch

from ulysses.buffer_pool import PoolStats
from ulysses.host_blocks import HostBlocks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]
SHAPE = (4, 1024, 8, 128)  # 16 MiB in float32: copies long enough to race on a GPU


def _sleep(device: torch.device) -> None:
    """Keep the compute stream busy, so a copy ordered wrongly against it would show."""
    if device.type == "cuda":
        torch.cuda._sleep(20_000_000)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_keep_their_values_across_streams(device):
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(SHAPE, generator=g) for _ in range(3)]
    stats = PoolStats()
    blocks = HostBlocks(torch.empty(0, device=device), stats)

    # park: the device buffer is reused (overwritten) right after the call returns
    buf = want[0].to(device, copy=True)
    parked = blocks.park(buf)
    _sleep(device)
    buf.fill_(-1.0)
    assert stats.host_bytes == buf.numel() * 4

    # fetch: compute reads it only after get()
    fetched = blocks.fetch(parked)
    _sleep(device)
    assert torch.equal(fetched.get().cpu(), want[0])

    # store: the device block is dropped at once, and its memory handed out again
    host = blocks.empty(buf)
    x = want[1].to(device, copy=True)
    _sleep(device)
    blocks.store(host, x)
    del x
    reused = torch.full(SHAPE, 7.0, device=device)
    # a fetched block dropped unread (an exception between fetch and get)
    dropped = blocks.fetch(blocks.park(want[2].to(device, copy=True)))
    del dropped
    again = torch.full(SHAPE, 9.0, device=device)
    blocks.close()
    assert torch.equal(host, want[1])
    assert (reused == 7).all() and (again == 9).all()
    if device.type == "cuda":
        assert host.is_pinned() and parked.is_pinned()
