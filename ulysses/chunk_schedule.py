"""The head-chunk schedule: which heads every rank attends and exchanges at each step.

Rank r of the Ulysses group holds ``h_r`` query heads and a kv range of ``k_r`` heads (group
``g_r = h_r / k_r``), from :func:`ulysses.sharding.head_layout`. Step j gives rank r its local
query heads ``[j c, (j+1) c)`` and the kv heads those read. A kv chunk is sent once, at the
first step that needs it, and reused by the following q chunks of its group; its dk/dv are
summed over those steps and sent back once. This also holds replicated kv (``K < U``). Ranks
with fewer heads idle in the last steps but still take part in every exchange.

The schedule is pure arithmetic on head counts (no tensors, no process group), identical on
every rank; :mod:`ulysses.chunk_loop` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ulysses.sharding import HeadLayout

DEFAULT_CHUNK_BUDGET_BYTES = 1 << 30
"""Byte budget that ``head_chunk_size="auto"`` fits the chunk buffers into (1 GiB)."""


@dataclass(frozen=True, slots=True)
class Step:
    q: tuple[tuple[int, int], ...]
    """Per rank: (first global q head, count) attended at this step; count 0 = idle."""
    kv: tuple[tuple[int, int], ...]
    """Per rank: (first global kv head, count) of its kv chunk at this step."""
    kv_new: tuple[bool, ...]
    """Per rank: its kv chunk must be (re)sent before this step."""
    kv_done: tuple[bool, ...]
    """Per rank: this is the last step using its kv chunk; dk/dv go back after it."""

    def kv_sent(self) -> tuple[tuple[int, int], ...] | None:
        """Per rank, the kv range sent at this step (count 0 where a rank keeps its chunk);
        None when no rank needs a new kv chunk (no exchange at all)."""
        if not any(self.kv_new):
            return None
        return tuple(kv if new else (kv[0], 0) for kv, new in zip(self.kv, self.kv_new))

    def kv_returned(self) -> tuple[tuple[int, int], ...] | None:
        """Per rank, the kv range whose summed dk/dv goes back after this step (count 0 where
        a rank's chunk lives on); None when no rank's chunk ends here."""
        if not any(self.kv_done):
            return None
        return tuple(kv if done else (kv[0], 0) for kv, done in zip(self.kv, self.kv_done))


def _groups(layout: HeadLayout) -> list[int]:
    return [h // k for h, k in zip(layout.q_sizes, layout.kv_sizes)]


def valid_chunk_sizes(layout: HeadLayout) -> list[int]:
    """Chunk sizes that divide every rank's query heads and fit its GQA groups."""
    groups = _groups(layout)
    return [c for c in range(1, max(layout.q_sizes) + 1)
            if all(h % c == 0 and (g % c == 0 or c % g == 0)
                   for h, g in zip(layout.q_sizes, groups))]


def chunk_buffer_bytes(layout: HeadLayout, c: int, batch: int, seq_len: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Estimated bytes of full-sequence chunk buffers alive at the backward peak.

    While a step's kernel runs: its inputs q, out, dout (c heads each) and k, v (ck), the next
    step's q and dout in flight (receive + send, ~3c), and the kernel's dq (c), dk, dv (ck each)
    plus the dk/dv sums (ck each): about 7c + 6ck heads of ``[B, S, D]`` (measured: 13.8 at
    c=ck=1 and 66 at c=8, ck=2 for 64 predicted).
    """
    ck = max(1, -(-c // min(_groups(layout))))
    units = 7 * c + 6 * ck
    return units * batch * seq_len * head_dim * torch.empty((), dtype=dtype).element_size()


def resolve_chunk_size(head_chunk_size, layout: HeadLayout, batch: int, seq_len: int,
                       head_dim: int, dtype: torch.dtype,
                       budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES) -> int:
    """An int chunk size from ``head_chunk_size`` (an int or ``"auto"``); ValueError if invalid.

    ``"auto"`` takes the largest valid size whose :func:`chunk_buffer_bytes` fits
    ``budget_bytes``, and the smallest valid size if none does.
    """
    valid = valid_chunk_sizes(layout)
    if head_chunk_size == "auto":
        fits = [c for c in valid
                if chunk_buffer_bytes(layout, c, batch, seq_len, head_dim, dtype) <= budget_bytes]
        return max(fits) if fits else min(valid)
    if isinstance(head_chunk_size, bool) or not isinstance(head_chunk_size, int):
        raise ValueError(f"head_chunk_size must be None, an int or 'auto', got "
                         f"{head_chunk_size!r}")
    if head_chunk_size not in valid:
        raise ValueError(f"head_chunk_size={head_chunk_size} does not divide the local query heads "
                         f"{list(layout.q_sizes)} into GQA-aligned chunks; valid values: {valid}")
    return head_chunk_size


def build_schedule(layout: HeadLayout, c: int) -> list[Step]:
    """The per-step head assignment of every rank (identical on all ranks)."""
    q_starts = [sum(layout.q_sizes[:r]) for r in range(len(layout.q_sizes))]
    groups = _groups(layout)
    num_steps = max(h // c for h in layout.q_sizes)

    def kv_at(r: int, j: int) -> tuple[int, int] | None:
        if j >= layout.q_sizes[r] // c:
            return None
        first, last = j * c // groups[r], ((j + 1) * c - 1) // groups[r]
        return layout.kv_ranges[r][0] + first, last - first + 1

    steps = []
    for j in range(num_steps):
        q, kv, new, done = [], [], [], []
        for r, h in enumerate(layout.q_sizes):
            active = j < h // c
            q.append((q_starts[r] + min(j * c, h), c if active else 0))
            cur = kv_at(r, j)
            kv.append(cur if cur is not None else (layout.kv_ranges[r][0], 0))
            new.append(cur is not None and (j == 0 or kv_at(r, j - 1) != cur))
            done.append(cur is not None and kv_at(r, j + 1) != cur)
        steps.append(Step(tuple(q), tuple(kv), tuple(new), tuple(done)))
    return steps
