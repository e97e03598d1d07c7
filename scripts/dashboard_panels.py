"""The building blocks of the chart's Grafana dashboards: variables, queries, panels and their layout.

Every panel and query points at the `${datasource}` variable and shares the serving pods' label
selectors (`SERVING`), so a dashboard loaded by Grafana's sidecar still finds its data.
"""

from __future__ import annotations

from typing import Any

from pagoda.operator.crd import section_defaults

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


def text_panel(title: str, markdown: str) -> dict[str, Any]:
    return {"type": "text", "title": title, "options": {"mode": "markdown", "content": markdown}}


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
