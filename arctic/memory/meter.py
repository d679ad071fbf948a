"""Per-step tokens/s and every rank's peak memory, for a training loop of one's own.

::

    meter = arctic.StepMeter(tokens_per_step=seq_len * micro_batch * dp_size, device=device)
    for batch in loader:
        with meter:                     # times the step
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
        stats = meter.stats()           # a collective: every rank calls it
        # {"step_s": ..., "tokens_per_s": ..., "peak_mib": [rank 0's, rank 1's, ...]}

The peak is the CUDA allocator's (``torch.cuda.max_memory_allocated``) on a GPU and the
process's peak resident set on the CPU (``getrusage``), in MiB; the examples print the same.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist


def peak_memory_mib(device: torch.device | str | None = None) -> float:
    """This rank's peak in MiB: the CUDA allocator's on a CUDA ``device`` (the current one
    when None and CUDA is there), the process's peak RSS on the CPU."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def gather_peak_memory_mib(device: torch.device | str, group=None) -> list[float]:
    """Every rank's :func:`peak_memory_mib` (0.1 MiB precision), in rank order; a collective
    over ``group`` (default: every rank)."""
    device = torch.device(device)
    size = dist.get_world_size(group)
    peaks = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(size)]
    dist.all_gather(peaks, torch.tensor(peak_memory_mib(device), dtype=torch.float64,
                                        device=device), group=group)
    return [round(p.item(), 1) for p in peaks]


class StepMeter:
    """Times the steps run inside ``with meter:`` and reports them with every rank's peak.

    Args:
        tokens_per_step: the tokens one step trains on over every rank that holds its own
            data (sequence length x micro batch x data-parallel size); an SP group's ranks
            share their sequences, so SP does not multiply it.
        device: where this rank trains; on CUDA the step's end waits for the device.
        group: the ranks whose peaks :meth:`stats` gathers (default: every rank).
    """

    def __init__(self, tokens_per_step: int, device: torch.device | str, group=None) -> None:
        if not isinstance(tokens_per_step, int) or isinstance(tokens_per_step, bool) \
                or tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
        self.tokens_per_step, self.device = tokens_per_step, torch.device(device)
        self.group, self.step_s, self._start = group, None, None

    def __enter__(self) -> "StepMeter":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_s = time.perf_counter() - self._start

    def stats(self) -> dict:
        """The last step's ``step_s`` and ``tokens_per_s``, and ``peak_mib``: every rank's
        peak so far (a collective: every rank of ``group`` calls it)."""
        if self.step_s is None:
            raise ValueError("StepMeter.stats() before any step: run a step inside "
                             "`with meter:` first")
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_step / self.step_s,
                "peak_mib": gather_peak_memory_mib(self.device, self.group)}


__all__ = ["StepMeter", "gather_peak_memory_mib", "peak_memory_mib"]
