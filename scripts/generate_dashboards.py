"""Write the chart's Grafana dashboards (charts/pagoda/dashboards/*.json) from one description.

Why generated: every panel and query must point at the `${datasource}` variable and share the same
label selectors, so a dashboard loaded by Grafana's sidecar (no import wizard, no `${DS_...}` inputs to
fill) still finds its data. Writing them from one place keeps that true for every panel.

    .venv/bin/python scripts/generate_dashboards.py          # rewrite the JSON files
    .venv/bin/python scripts/generate_dashboards.py --check  # exit 1 if a file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagoda.operator.crd import section_defaults

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "charts" / "pagoda" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The autoscaler's default `targetKVCacheUsage` (the CRD schema's); drawn as a threshold line.
KV_CACHE_TARGET = section_defaults("autoscaling")["targetKVCacheUsage"]
# Serving pods: labels from the metric (`model_name`) and from the scrape (`namespace`, `pod`).
SERVING = 'namespace=~"$namespace", model_name=~"$model_name", pod=~"$pod"'
# The operator's gauge of the replicas it wants per InferenceService (pagoda_operator_* metrics).
OPERATOR_DESIRED_REPLICAS = "pagoda_operator_desired_replicas"
DCGM_ABSENT = "No DCGM metrics: is NVIDIA's dcgm-exporter installed and scraped?"


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": query,
            "query": query,  # the classic string form: every Grafana version reads it
            "refresh": 2,  # on time range change: pods come and go with autoscaling
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "current": {},
            "hide": 0,
        },
        query_var("namespace", "Namespace", "label_values(pagoda_engine_info, namespace)"),
        query_var(
            "model_name", "Model", 'label_values(pagoda_engine_info{namespace=~"$namespace"}, model_name)'
        ),
        query_var(
            "pod",
            "Pod",
            'label_values(pagoda_engine_info{namespace=~"$namespace", model_name=~"$model_name"}, pod)',
        ),
    ]


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def quantile_targets(histogram: str) -> list[dict[str, Any]]:
    return [
        target(
            f"histogram_quantile({q}, sum by (model_name, le) "
            f"(rate({histogram}_bucket{{{SERVING}}}[$__rate_interval])))",
            f"{{{{model_name}}}} p{round(q * 100)}",
            ref,
        )
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]


class Layout:
    """Places panels left to right on Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self._add({"type": "row", "title": title, "collapsed": False, "panels": []}, 24, 1)
        self._newline()

    def add(self, panel: dict[str, Any], width: int = 12, height: int = 8) -> None:
        if self.x + width > 24:
            self._newline()
        self._add(panel, width, height)

    def _add(self, panel: dict[str, Any], width: int, height: int) -> None:
        panel = {"id": len(self.panels) + 1, "datasource": DATASOURCE, **panel}
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": width, "h": height}
        self.panels.append(panel)
        self.x += width
        self.row_height = max(self.row_height, height)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x = self.row_height = 0


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    *,
    min_value: float | None = 0,
    max_value: float | None = None,
    threshold: float | None = None,
    no_value: str | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"},
    }
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    if threshold is not None:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}, {"color": "red", "value": threshold}],
        }
        defaults["custom"]["thresholdsStyle"] = {"mode": "line+area"}
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, targets: list[dict[str, Any]], unit: str) -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def kv_usage_panel() -> dict[str, Any]:
    return timeseries(
        "KV-cache usage per pod",
        "KV blocks in use / blocks in the pool (pagoda_kv_cache_usage_ratio). The red line is the "
        f"autoscaler's default target ({KV_CACHE_TARGET:.0%}, spec.autoscaling.targetKVCacheUsage): "
        "pods above it for long are what the autoscaler scales out on. Near 100% new requests wait "
        "and running ones are preempted.",
        [target(f"max by (pod) (pagoda_kv_cache_usage_ratio{{{SERVING}}})", "{{pod}}", "A")],
        "percentunit",
        max_value=1,
        threshold=KV_CACHE_TARGET,
    )


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


GPU_TEXT = """\
### Why a GPU can read 90% "utilised" while its KV cache is 5% used

**`DCGM_FI_DEV_GPU_UTIL` is not a measure of how full the GPU is.** It is the fraction of time in the
sample window during which *at least one kernel* was running — one small kernel on one of the GPU's
100+ streaming multiprocessors counts as "busy". A serving loop that decodes a single sequence
launches kernels back to back, so the counter reads 90%+ with a batch of one.

**`pagoda_kv_cache_usage_ratio` is how much of the memory reserved for concurrent requests is in
use.** At 5% the pod could hold about twenty times as many tokens in flight.

Decoding is bound by memory bandwidth, not by arithmetic: each step reads all the weights once,
whatever the batch size. Adding sequences to the batch costs little extra time per step, so
throughput grows almost linearly with batch size until the KV cache (or compute) runs out. A pod at
90% "utilisation" and 5% KV usage has most of its capacity left.

**What it means for scaling**
- Do **not** scale on GPU utilisation: it saturates at low load and would add GPUs that the existing
  pods could have absorbed by batching more.
- Scale on **KV-cache usage** and the **waiting queue** (what pagoda's autoscaler does): they rise
  only when a pod really cannot admit more work; preemptions above zero confirm it.
- **Framebuffer use** (`DCGM_FI_DEV_FB_USED`) is also no load signal: the KV pool is allocated at
  start-up, so memory reads nearly full from the first second.

Panels stay empty with a message when the DCGM exporter is absent (e.g. CPU pods).
"""


def dcgm(metric: str) -> str:
    """A DCGM gauge per serving pod. dcgm-exporter attaches the GPU's pod as `pod`/`namespace` when
    scraped with honorLabels, or as `exported_pod`/`exported_namespace` otherwise; accept both."""
    exported = (
        f'label_replace(label_replace({metric}{{exported_namespace=~"$namespace", exported_pod=~"$pod"}}, '
        '"pod", "$1", "exported_pod", "(.+)"), "namespace", "$1", "exported_namespace", "(.+)")'
    )
    # exported_pod="" (absent): otherwise `pod` would be the exporter's own pod.
    direct = f'{metric}{{exported_pod="", namespace=~"$namespace", pod=~"$pod"}}'
    return f"avg by (pod) ({exported} or {direct})"


ROOFLINE_TEXT = """\
### Memory-bound or compute-bound? Why "GPU utilisation" and the roofline can both be true

For every engine step pagoda counts the bytes it **had to move** (every weight once, each sequence's
K/V once, the new K/V written) and the FLOPs it **had to do**, from the model and the step's shape,
and divides by the step's time (formulas: docs/metrics.md).

- **Bandwidth utilisation** = achieved bytes/s ÷ the device's peak bandwidth; **compute
  utilisation** = achieved FLOP/s ÷ peak FLOP/s (datasheet peaks for H200/H100/A100/L4, a start-up
  probe elsewhere).
- A step whose FLOPs per byte (**arithmetic intensity**) are below the device's **ridge** (peak
  FLOP/s ÷ peak bytes/s) is **memory-bound**: no kernel could run it faster than bytes ÷ bandwidth.
  Decode steps at small batch sit far left of the ridge (about 1 FLOP/byte against a ridge of
  ~200 on an H100): the GPU waits on memory.

DCGM's GPU utilisation says only that *a kernel was running*. A decode loop at batch 1 keeps a
kernel running almost all the time (90 % "utilised") while it uses a few % of the compute and,
with a small model, well below the peak bandwidth: both readings are true. Batching more sequences
per step raises the intensity (the weights are read once for all of them) and moves the steps
toward the ridge; the KV-cache usage says how many more sequences fit.
"""


def roofline_panels(grid: Layout) -> None:
    def per_pod_rate(counter: str) -> str:
        return f"sum by (pod) (rate({counter}{{{SERVING}}}[$__rate_interval]))"

    seconds = per_pod_rate("pagoda_step_forward_seconds_total")
    grid.row("memory-bound or compute-bound?")
    grid.add(
        {
            "type": "text",
            "title": "Reading the roofline",
            "options": {"mode": "markdown", "content": ROOFLINE_TEXT},
        },
        width=10,
        height=16,
    )
    grid.add(
        timeseries(
            "Bandwidth and compute utilisation vs GPU utilisation",
            "Achieved bytes/s and FLOP/s of the engine steps as fractions of the device's peaks "
            "(pagoda_step_bytes_total, pagoda_step_flops_total over pagoda_step_forward_seconds_total, "
            "divided by pagoda_step_peak_*), beside DCGM_FI_DEV_GPU_UTIL / 100. GPU lines are missing "
            "without the DCGM exporter.",
            [
                target(
                    f"{per_pod_rate('pagoda_step_bytes_total')} / {seconds} / max by (pod) "
                    f"(pagoda_step_peak_bytes_per_second{{{SERVING}}})",
                    "{{pod}} bandwidth",
                    "A",
                ),
                target(
                    f"{per_pod_rate('pagoda_step_flops_total')} / {seconds} / max by (pod) "
                    f"(pagoda_step_peak_flops_per_second{{{SERVING}}})",
                    "{{pod}} compute",
                    "B",
                ),
                target(f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} / 100", "{{pod}} GPU util", "C"),
            ],
            "percentunit",
        ),
        width=14,
    )
    grid.add(
        timeseries(
            "Steps that are memory-bound",
            "Share of engine steps whose arithmetic intensity is below the device's ridge point "
            '(pagoda_step_bound_total{bound="memory"} / all steps).',
            [
                target(
                    f'sum by (pod) (rate(pagoda_step_bound_total{{bound="memory", {SERVING}}}[$__rate_interval]))'
                    f" / {per_pod_rate('pagoda_step_bound_total')}",
                    "{{pod}}",
                    "A",
                )
            ],
            "percentunit",
            max_value=1,
        ),
        width=7,
    )
    grid.add(
        timeseries(
            "Arithmetic intensity vs the ridge (FLOP/byte)",
            "Median FLOPs per byte of the steps (pagoda_step_arithmetic_intensity) and the device's "
            "ridge point, peak FLOP/s / peak bytes/s: below the ridge a step is memory-bound.",
            [
                target(
                    "histogram_quantile(0.5, sum by (pod, le) "
                    f"(rate(pagoda_step_arithmetic_intensity_bucket{{{SERVING}}}[$__rate_interval])))",
                    "{{pod}} median step",
                    "A",
                ),
                target(
                    f"max by (pod) (pagoda_step_peak_flops_per_second{{{SERVING}}}) / max by (pod) "
                    f"(pagoda_step_peak_bytes_per_second{{{SERVING}}})",
                    "{{pod}} ridge",
                    "B",
                ),
            ],
        ),
        width=7,
    )


def memory_vs_compute_panels() -> list[dict[str, Any]]:
    grid = Layout()
    grid.add(
        {
            "type": "text",
            "title": "Reading these panels",
            "options": {"mode": "markdown", "content": GPU_TEXT},
        },
        width=10,
        height=16,
    )
    grid.add(
        timeseries(
            "KV-cache usage vs GPU utilisation",
            "Both as fractions: KV blocks in use (pagoda_kv_cache_usage_ratio) and the share of time a "
            "kernel ran on the pod's GPU (DCGM_FI_DEV_GPU_UTIL / 100). GPU lines are missing without "
            "the DCGM exporter.",
            [
                target(f"max by (pod) (pagoda_kv_cache_usage_ratio{{{SERVING}}})", "{{pod}} KV cache", "A"),
                target(f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} / 100", "{{pod}} GPU util", "B"),
            ],
            "percentunit",
            max_value=1,
        ),
        width=14,
    )
    grid.add(
        timeseries(
            "GPU utilisation (DCGM)",
            "DCGM_FI_DEV_GPU_UTIL: % of time at least one kernel was running. Not a capacity signal.",
            [target(dcgm("DCGM_FI_DEV_GPU_UTIL"), "{{pod}}", "A")],
            "percent",
            max_value=100,
            no_value=DCGM_ABSENT,
        ),
        width=7,
    )
    grid.add(
        timeseries(
            "GPU framebuffer used (DCGM)",
            "DCGM_FI_DEV_FB_USED (MiB): weights + the KV pool, allocated at start-up, plus activations.",
            [target(dcgm("DCGM_FI_DEV_FB_USED"), "{{pod}}", "A")],
            "decmbytes",
            no_value=DCGM_ABSENT,
        ),
        width=7,
    )
    grid.add(kv_usage_panel(), width=12)
    grid.add(
        timeseries(
            "KV blocks used / total",
            "Physical KV blocks referenced by live sequences (pagoda_kv_cache_blocks_used), shared by "
            "several (pagoda_kv_cache_shared_blocks, prefix caching), and the pool size "
            "(pagoda_kv_cache_blocks_total).",
            [
                target(f"sum by (pod) (pagoda_kv_cache_blocks_used{{{SERVING}}})", "{{pod}} used", "A"),
                target(f"sum by (pod) (pagoda_kv_cache_shared_blocks{{{SERVING}}})", "{{pod}} shared", "B"),
                target(f"sum by (pod) (pagoda_kv_cache_blocks_total{{{SERVING}}})", "{{pod}} total", "C"),
            ],
        ),
        width=12,
    )
    roofline_panels(grid)
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
