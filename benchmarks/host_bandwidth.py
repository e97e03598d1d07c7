"""What this host's memory reads now: the bandwidth benchmarks quote beside their numbers (it moves
under a shared host's neighbours by half within minutes, and every memory-bound number with it)."""

from __future__ import annotations

import time

import torch


def dram_read_gbps(repeats: int = 5) -> float:
    """A plain read of 1 GiB (torch's `sum`, default threads), best of `repeats`, in GB/s."""
    data = torch.ones(1 << 28)  # fp32
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9
