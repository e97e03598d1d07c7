"""Write the chart's Grafana dashboards (charts/pagoda/dashboards/*.json) from one description.

Why generated: every panel and query must point at the `${datasource}` variable and share the same
label selectors, so a dashboard loaded by Grafana's sidecar (no import wizard, no `${DS_...}` inputs to
fill) still finds its data. Writing them from one place keeps that true for every panel: the building
blocks are `dashboard_panels.py`, the GPU board's panels `dashboard_gpu.py`, the serving board's here.

    .venv/bin/python scripts/generate_dashboards.py          # rewrite the JSON files
    .venv/bin/python scripts/generate_dashboards.py --check  # exit 1 if a file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, also under PYTHONSAFEPATH

from dashboard_gpu import memory_vs_compute_panels
from dashboard_panels import (
    OPERATOR_DESIRED_REPLICAS,
    SERVING,
    Layout,
    kv_usage_panel,
    quantile_targets,
    target,
    timeseries,
    variables,
)

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "charts" / "pagoda" / "dashboards"
def serving_panels() -> list[dict[str, Any]]:
    grid = Layout()
    grid.row("Load and KV cache")
    grid.add(
        timeseries(
            "Requests running and waiting",
            "Running: sequence groups in the batch (pagoda_num_requests_running). Waiting: queued, not "
            "admitted yet, including preempted ones (pagoda_num_requests_waiting). A waiting queue that "
            "grows while KV usage is high means the pods are out of KV memory.",
            [
                target(f"sum by (pod) (pagoda_num_requests_running{{{SERVING}}})", "{{pod}} running", "A"),
                target(f"sum by (pod) (pagoda_num_requests_waiting{{{SERVING}}})", "{{pod}} waiting", "B"),
            ],
        )
    )
    grid.add(kv_usage_panel())
    grid.add(
        timeseries(
            "KV-cache capacity (tokens)",
            "Tokens each pod's KV pool can hold: blocks × block size (pagoda_kv_cache_capacity_tokens). "
            "Fixed at start-up from the memory given to the cache; the ceiling on concurrent context.",
            [target(f"max by (pod) (pagoda_kv_cache_capacity_tokens{{{SERVING}}})", "{{pod}}", "A")],
        ),
        width=8,
    )
    grid.add(
        timeseries(
            "Preemptions / s",
            "Sequences evicted from the KV cache (to be recomputed) for lack of free blocks "
            "(rate of pagoda_preemptions_total). Anything above zero costs recomputation: scale out.",
            [
                target(
                    f"sum by (pod) (rate(pagoda_preemptions_total{{{SERVING}}}[$__rate_interval]))",
                    "{{pod}}",
                    "A",
                )
            ],
            "ops",
        ),
        width=8,
    )
    grid.add(
        timeseries(
            "Prefix-cache hit rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up: "
            "rate(pagoda_prefix_cache_hits_total) / rate(pagoda_prefix_cache_queries_total). "
            "Empty while no prompt is looked up (prefix caching off or no traffic).",
            [
                target(
                    f"sum by (pod) (rate(pagoda_prefix_cache_hits_total{{{SERVING}}}[$__rate_interval]))"
                    f" / sum by (pod) (rate(pagoda_prefix_cache_queries_total{{{SERVING}}}"
                    "[$__rate_interval]))",
                    "{{pod}}",
                    "A",
                )
            ],
            "percentunit",
            max_value=1,
        ),
        width=8,
    )
    grid.row("Latency")
    for title, histogram, what in (
        ("Time to first token", "pagoda_time_to_first_token_seconds", "arrival → first generated token"),
        ("Inter-token latency", "pagoda_inter_token_latency_seconds", "gap between two output tokens"),
        ("End-to-end request latency", "pagoda_e2e_request_latency_seconds", "arrival → finish"),
    ):
        grid.add(
            timeseries(
                f"{title} p50 / p90 / p99",
                f"{what}: quantiles from the {histogram} histogram over the selected pods.",
                quantile_targets(histogram),
                "s",
            ),
            width=8,
        )
    grid.row("Throughput and replicas")
    grid.add(
        timeseries(
            "Tokens / s",
            "Prompt tokens processed (prefilled or served from the prefix cache) and tokens generated, "
            "per second (pagoda_prompt_tokens_total, pagoda_generation_tokens_total).",
            [
                target(
                    f"sum by (model_name) (rate(pagoda_prompt_tokens_total{{{SERVING}}}[$__rate_interval]))",
                    "{{model_name}} prompt",
                    "A",
                ),
                target(
                    "sum by (model_name) "
                    f"(rate(pagoda_generation_tokens_total{{{SERVING}}}[$__rate_interval]))",
                    "{{model_name}} generation",
                    "B",
                ),
            ],
            "short",
        ),
        width=8,
    )
    grid.add(
        timeseries(
            "Finished requests / s by reason",
            "rate of pagoda_requests_finished_total by finished_reason (stop, length, abort, error).",
            [
                target(
                    "sum by (finished_reason) "
                    f"(rate(pagoda_requests_finished_total{{{SERVING}}}[$__rate_interval]))",
                    "{{finished_reason}}",
                    "A",
                )
            ],
            "reqps",
        ),
        width=8,
    )
    grid.add(
        timeseries(
            "Replicas: desired vs serving",
            "Desired: the operator's decision per InferenceService "
            f"({OPERATOR_DESIRED_REPLICAS}; needs the chart's serviceMonitor.enabled). Serving: pods "
            "of the model whose /metrics Prometheus scraped successfully (count of pagoda_engine_info), "
            "i.e. up and answering — the replicas actually taking load.",
            [
                target(
                    f'sum by (namespace, name) ({OPERATOR_DESIRED_REPLICAS}{{namespace=~"$namespace"}})',
                    "{{name}} desired",
                    "A",
                ),
                target(
                    f"count by (model_name) (pagoda_engine_info{{{SERVING}}})",
                    "{{model_name}} serving",
                    "B",
                ),
            ],
        ),
        width=8,
    )
    return grid.panels


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pagoda", "llm", "kv-cache"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        "pagoda-serving.json": dashboard(
            "pagoda-serving",
            "Pagoda / Serving",
            "Load, KV cache, latency and throughput of pagoda serving pods (metrics: docs/metrics.md).",
            serving_panels(),
        ),
        "pagoda-memory-vs-compute.json": dashboard(
            "pagoda-memory-vs-compute",
            "Pagoda / Memory vs compute",
            "KV-cache usage beside DCGM GPU utilisation and memory: what limits a serving pod.",
            memory_vs_compute_panels(),
        ),
    }


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if a file differs instead of writing")
    args = parser.parse_args()
    stale = []
    for name, board in dashboards().items():
        path = DASHBOARD_DIR / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print("stale (run scripts/generate_dashboards.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
