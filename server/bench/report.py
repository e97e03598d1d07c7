"""Summary numbers of a benchmark run: the printed table, the JSON result, the latency plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pagoda.server.bench.client import RequestResult


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats_ms(name: str, values: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"p99_{name}_ms": _percentile(ms, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
    }
    summary |= _stats_ms("ttft", [r.ttft for r in ok])
    summary |= _stats_ms("tpot", tpot)
    summary |= _stats_ms("itl", [gap for r in ok for gap in r.itl])
    summary |= _stats_ms("e2el", [r.latency for r in ok])
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def format_table(summary: dict[str, Any], title: str = "Serving benchmark result") -> str:
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{summary['successful_requests']}"),
        ("Failed requests", f"{summary['failed_requests']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total generated tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
    ]
    for key, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                       ("itl", "Inter-token Latency")):  # fmt: skip
        rows.append((f"-- {label} --", ""))
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)", f"{summary[f'{stat}_{key}_ms']:.2f}"))
    if "offline_output_throughput" in summary:
        rows.append(("-- Offline engine, same workload --", ""))
        rows.append(("Output token throughput (tok/s)", f"{summary['offline_output_throughput']:.2f}"))
        rows.append(("HTTP / offline throughput ratio", f"{summary['http_offline_ratio']:.3f}"))
    width = 50
    lines = [f"{f' {title} ':=^{width}}"]
    for label, value in rows:
        lines.append(f"{label:<{width - 12}}{value:>12}" if value else f"{label:^{width}}")
    lines.append("=" * width)
    for error in summary.get("errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)


def save_result(
    path: Path, runs: list[tuple[dict[str, Any], list[RequestResult]]], config: dict[str, Any]
) -> None:
    """One JSON file: the config, then per run its summary and per-request results."""
    fields = ("success", "error", "prompt_len", "output_tokens", "start", "ttft", "latency")
    payload = {
        "config": config,
        "runs": [
            {"summary": summary, "requests": [{k: getattr(r, k) for k in fields} for r in results]}
            for summary, results in runs
        ],
    }
    Path(path).write_text(json.dumps(payload, indent=2, default=str))


def plot(path: Path, results: list[RequestResult]) -> None:
    """Latency vs time: each request's TTFT and end-to-end latency at its start time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.scatter([r.start for r in ok], [r.latency for r in ok], s=10, label="end-to-end latency")
    ax.scatter([r.start for r in ok], [r.ttft for r in ok], s=10, label="time to first token")
    ax.set_xlabel("request start (s since benchmark start)")
    ax.set_ylabel("seconds")
    ax.set_title(f"{len(ok)} requests, {len(results) - len(ok)} failed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
