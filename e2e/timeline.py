"""The e2e timeline: one row per sample (replicas, KV usage, queue, TTFT), a table and a PNG plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Sample:
    t: float  # seconds since the scenario started
    phase: str  # idle / load / cooldown
    desired: int  # InferenceService spec.replicas (what the autoscaler wrote)
    ready: int  # serving processes answering /ready
    kv_usage: float | None  # mean over ready servers, scraped by the harness itself
    waiting: float | None  # summed over ready servers
    recommended: int | None = None  # the autoscaler's highest proposal (status.autoscaling.proposals)
    ttft_p99: float | None = None  # of the requests that started within this sample's period

    def row(self) -> dict[str, Any]:
        return asdict(self)


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def attach_ttft(samples: list[Sample], requests: Sequence[dict[str, Any]], bench_t0: float) -> None:
    """Each sample gets the p99 TTFT of the requests that started between it and the next sample."""
    for sample, following in zip(samples, [*samples[1:], None], strict=True):
        end = following.t if following else sample.t + 1.0
        ttfts = [r["ttft"] for r in requests
                 if r.get("success") and r.get("ttft") is not None and sample.t <= bench_t0 + r["start"] < end]
        sample.ttft_p99 = p99(ttfts)


def table(samples: Sequence[Sample], every: int = 1) -> str:
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{'t (s)':>6} {'phase':<9} {'proposal':>8} {'desired':>7} {'ready':>5} {'KV use':>6} {'queue':>5} "
             f"{'p99 TTFT (s)':>12}"]
    for s in samples[::every]:
        lines.append(f"{s.t:6.0f} {s.phase:<9} {fmt(s.recommended, '8d')} {s.desired:7d} {s.ready:5d} "
                     f"{fmt(s.kv_usage, '6.2f')} {fmt(s.waiting, '5.0f')} {fmt(s.ttft_p99, '12.2f')}")
    return "\n".join(lines)


def plot(samples: Sequence[Sample], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    axes[0].step(t, [s.desired for s in samples], where="post", label="desired (spec.replicas)")
    axes[0].step(t, [s.ready for s in samples], where="post", label="ready", linestyle="--")
    axes[0].plot(t, [s.recommended if s.recommended is not None else float("nan") for s in samples], ".",
                 label="proposal (max over metrics)", alpha=0.5)
    axes[0].set_ylabel("replicas")
    axes[0].legend(loc="upper right")
    axes[1].plot(t, [s.kv_usage if s.kv_usage is not None else float("nan") for s in samples])
    axes[1].set_ylabel("KV usage (mean)")
    axes[1].set_ylim(0, 1.05)
    axes[2].plot(t, [s.waiting if s.waiting is not None else float("nan") for s in samples])
    axes[2].set_ylabel("waiting requests")
    axes[3].plot(t, [s.ttft_p99 if s.ttft_p99 is not None else float("nan") for s in samples], marker=".",
                 linestyle="none")
    axes[3].set_ylabel("p99 TTFT (s)")
    axes[3].set_xlabel("time (s)")
    for ax in axes:
        load = [s.t for s in samples if s.phase == "load"]
        if load:
            ax.axvspan(min(load), max(load), color="orange", alpha=0.1)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
