"""Cumulative histograms of per-step quantities, kept by the engine and read (never drained); the
server keeps its per-request latencies in the same `Histogram` (`pod_metrics.py`).

Each is what a Prometheus histogram holds: per-bucket counts, a sum and a count, only ever growing,
so any number of readers can take a copy and differences between copies lose nothing. The buckets
are those of the exported families (docs/metrics.md).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Fractions of a device peak. Above 1 happens: a model that fits in a CPU's caches beats DRAM bandwidth.
UTILIZATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                       0.9, 1.0, 1.5, 2.0, 4.0)  # fmt: skip
INTENSITY_BUCKETS = (0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class Histogram:
    buckets: tuple[float, ...]  # upper bounds (value <= bound), ascending; +Inf follows the last
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; one more for +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """`value` seen `times` times."""
        # NaN (a step of zero seconds) lands in +Inf, like any value above every bound.
        index = bisect.bisect_left(self.buckets, value) if value == value else len(self.buckets)
        self.counts[index] += times
        self.sum += value * times
        self.count += times

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound), ending with (inf, count): Prometheus' bucket series."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append((float(bound), running))
        return out


@dataclass
class StepHistograms:
    """Per step: tokens run, and where the step sat on the roofline (server/engine/roofline.py)."""

    tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    bandwidth_utilization: Histogram = field(default_factory=lambda: Histogram(UTILIZATION_BUCKETS))
    compute_utilization: Histogram = field(default_factory=lambda: Histogram(UTILIZATION_BUCKETS))
    intensity: Histogram = field(default_factory=lambda: Histogram(INTENSITY_BUCKETS))

    def observe(self, num_tokens: int, roofline) -> None:
        self.tokens.observe(num_tokens)
        self.bandwidth_utilization.observe(roofline.bandwidth_utilization)
        self.compute_utilization.observe(roofline.compute_utilization)
        self.intensity.observe(roofline.intensity)

    def copy(self) -> StepHistograms:
        return StepHistograms(
            self.tokens.copy(),
            self.bandwidth_utilization.copy(),
            self.compute_utilization.copy(),
            self.intensity.copy(),
        )
