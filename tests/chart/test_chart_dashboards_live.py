"""The "No data" bug cannot come back: a real Prometheus scrapes a real `pagoda serve` (tiny random
model, a KV pool small enough to preempt) under load, and every dashboard query — Grafana's variables
substituted as Grafana would — returns at least one series with a finite value.

Scrape labels: in a cluster `namespace` and `pod` come from the operator's ServiceMonitor; here the
static scrape config attaches the same labels. The replicas panel's `pagoda_operator_desired_replicas`
comes from the operator's real metrics module, served here by prometheus_client with the value the
autoscaler would set: a stand-in for a running operator (which needs a Kubernetes API). DCGM queries
cannot have data without an NVIDIA GPU and are checked for syntax only (test_chart_dashboards.py).

PAGODA_DASHBOARD_PNG=docs/img/dashboard-serving.png also plots the serving panels' queries there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from chart_support import REPO, load_dashboards, panels, queries, substitute
from support.pagoda_serve import pagoda_serve
from support.prometheus import PrometheusServer, free_port, prometheus_binary
from support.tiny_models import tiny_model_dir

NAMESPACE, POD, MODEL = "pagoda-test", "tiny-0", "tiny"
# A pool of 32 blocks x 4 tokens (128 tokens) and 10 clients sending ~30-token prompts for 16 tokens:
# requests queue and get preempted, so every gauge and counter moves.
SERVE_FLAGS = ["--num-blocks", "32", "--block-size", "4", "--max-num-seqs", "8", "--max-model-len", "64"]
SHARED_PREFIX = "The capital of France is Paris."
LOAD_SECONDS = 10.0
VALUES = {"namespace": NAMESPACE, "model_name": MODEL, "pod": POD}
RATE_INTERVAL = "30s"  # covers the whole load at the end of it


class LabelledPrometheus(PrometheusServer):
    """The test-support Prometheus, one scrape job per target group, with the labels Kubernetes
    discovery would add and each job's own settings (e.g. honor_labels)."""

    def __init__(self, jobs: dict[str, dict], workdir: Path) -> None:
        targets = [t for job in jobs.values() for t in job["static_configs"][0]["targets"]]
        super().__init__(targets, workdir, scrape_interval=0.5)
        self.jobs = jobs

    def _write_config(self) -> Path:
        path = super()._write_config()
        config = json.loads(path.read_text())
        (base,) = config["scrape_configs"]
        config["scrape_configs"] = [{**base, "job_name": name, **job} for name, job in self.jobs.items()]
        path.write_text(json.dumps(config))
        return path

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        params = {"query": promql, "start": start, "end": end, "step": step}
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{urllib.parse.urlencode(params)}") as r:
            return json.load(r)["data"]["result"]


@pytest.fixture(scope="module")
def serving_pod(tmp_path_factory):
    model = tiny_model_dir("llama", tmp_path_factory)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    flags = ["--served-model-name", MODEL, "--enable-prefix-caching", *SERVE_FLAGS]
    with pagoda_serve(model, flags, log) as url:
        yield url


@pytest.fixture(scope="module")
def operator_metrics():
    """The operator's real metrics module on a free port, valued as the autoscaler sets it."""
    from pagoda.operator.operator_metrics import DESIRED_REPLICAS
    from prometheus_client import start_http_server

    DESIRED_REPLICAS.labels(namespace=NAMESPACE, name=MODEL).set(1)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    yield f"127.0.0.1:{port}"
    server.shutdown()
    thread.join(5)


def complete(url: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def drive_load(url: str, seconds: float, concurrency: int = 10) -> int:
    """Requests sharing a prompt prefix (prefix-cache hits), more at once than the pool holds."""
    deadline = time.monotonic() + seconds
    sent = 0
    lock = threading.Lock()

    def worker(worker_id: int) -> None:
        nonlocal sent
        i = 0
        while time.monotonic() < deadline:
            complete(url, f"{SHARED_PREFIX} Request {worker_id}-{i}:", max_tokens=16)
            i += 1
            with lock:
                sent += 1

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker, n) for n in range(concurrency)]:
            future.result()
    return sent


@pytest.fixture(scope="module")
def loaded_prometheus(serving_pod, operator_metrics, render, tmp_path_factory):
    if prometheus_binary() is None:
        pytest.fail("`prometheus` not found: run scripts/setup.sh --dev (installs Debian's prometheus)")
    (monitor,) = [
        obj for obj in render("--set", "serviceMonitor.enabled=true") if obj["kind"] == "ServiceMonitor"
    ]
    jobs = {
        "pagoda": {
            "static_configs": [
                {
                    "targets": [serving_pod.removeprefix("http://")],
                    "labels": {"namespace": NAMESPACE, "pod": POD},
                }
            ],
        },
        # as the chart's ServiceMonitor scrapes the operator
        "pagoda-operator": {
            "honor_labels": monitor["spec"]["endpoints"][0].get("honorLabels", False),
            "static_configs": [
                {"targets": [operator_metrics], "labels": {"namespace": "pagoda-system", "pod": "operator-0"}}
            ],
        },
    }
    with LabelledPrometheus(jobs, tmp_path_factory.mktemp("prometheus")) as prometheus:
        prometheus.wait_for(f'pagoda_engine_info{{pod="{POD}"}}')
        start = time.time()
        sent = drive_load(serving_pod, LOAD_SECONDS)
        time.sleep(1.5)  # a last scrape after the load
        prometheus.load_window = (start - 2, time.time())
        prometheus.requests_sent = sent
        yield prometheus


def live_queries() -> list:
    """Every query of both dashboards except DCGM's (no GPU here)."""
    return [
        query
        for name, board in load_dashboards().items()
        for query in queries(board, name)
        if "DCGM_" not in query.expr
    ]


def finite(series: dict) -> bool:
    return math.isfinite(float(series["value"][1]))


@pytest.mark.parametrize("query", live_queries(), ids=lambda q: q.where)
def test_every_serving_query_returns_data(loaded_prometheus, query):
    expr = substitute(query.expr, VALUES, RATE_INTERVAL)
    result = loaded_prometheus.query(expr)
    assert result, f"No data: {query.where}\n  {expr}"
    assert any(finite(series) for series in result), f"only NaN/Inf: {query.where}\n  {expr}\n  {result}"


def test_variables_offer_the_pod_that_serves(loaded_prometheus):
    for variable, expected in VALUES.items():
        values = {
            s["metric"][variable]
            for s in loaded_prometheus.query(f"count by ({variable}) (pagoda_engine_info)")
        }
        assert values == {expected}, variable


def test_the_load_moved_what_the_panels_show(loaded_prometheus):
    """Data, and data that means something: tokens flowed, latency was measured, the KV cache filled
    and the shared prompt prefix hit the prefix cache."""
    assert loaded_prometheus.requests_sent >= 20

    def value(expr: str) -> float:
        (series,) = loaded_prometheus.query(expr)
        return float(series["value"][1])

    sel = f'pod="{POD}"'
    assert value(f"sum(rate(pagoda_generation_tokens_total{{{sel}}}[{RATE_INTERVAL}]))") > 0
    assert value(f"max(max_over_time(pagoda_kv_cache_usage_ratio{{{sel}}}[1m]))") > 0.3
    assert value(f"sum(increase(pagoda_prefix_cache_hits_total{{{sel}}}[1m]))") > 0
    p99 = f"histogram_quantile(0.99, sum by (le) (rate(pagoda_time_to_first_token_seconds_bucket{{{sel}}}[30s])))"
    assert 0 < value(p99) < 60
    # the roofline row: steps moved bytes at a measurable fraction of the probed peak, on one side
    # of the ridge or the other
    bandwidth = value(
        f"sum(rate(pagoda_step_bytes_total{{{sel}}}[{RATE_INTERVAL}])) / "
        f"sum(rate(pagoda_step_forward_seconds_total{{{sel}}}[{RATE_INTERVAL}])) / "
        f"max(pagoda_step_peak_bytes_per_second{{{sel}}})"
    )
    assert 0.001 < bandwidth < 50, bandwidth
    assert value(f"sum(increase(pagoda_step_bound_total{{{sel}}}[1m]))") >= loaded_prometheus.requests_sent
    # the engine loop: part of its busy time outside the forwards, the hand-off a part of that
    busy = f"sum(rate(pagoda_engine_busy_seconds_total{{{sel}}}[{RATE_INTERVAL}]))"
    outside = value(f"1 - sum(rate(pagoda_step_forward_seconds_total{{{sel}}}[{RATE_INTERVAL}])) / {busy}")
    handoff = value(f"sum(rate(pagoda_engine_handoff_seconds_total{{{sel}}}[{RATE_INTERVAL}])) / {busy}")
    assert 0 < handoff < outside < 1, (handoff, outside)


def test_plot_serving_panels(loaded_prometheus, tmp_path):
    """Draw the serving dashboard's queries over the load: into tmp_path, and where
    PAGODA_DASHBOARD_PNG says (docs/img/dashboard-serving.png is made this way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = load_dashboards()["pagoda-serving.json"]
    graphs = [p for p in panels(board) if p.get("targets")]
    start, end = loaded_prometheus.load_window
    figure, axes = plt.subplots(4, 3, figsize=(15, 13))
    for axis, panel in zip(axes.flat, graphs, strict=False):
        for target_ in panel["targets"]:
            expr = substitute(target_["expr"], VALUES, "5s")
            for series in loaded_prometheus.query_range(expr, start, end, 0.5):
                times = [float(t) - start for t, _ in series["values"]]
                label = target_["legendFormat"]
                for key, val in series["metric"].items():
                    label = label.replace("{{" + key + "}}", val)
                axis.plot(times, [float(v) for _, v in series["values"]], label=label)
        for step in panel["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])[1:]:
            axis.axhline(step["value"], color="red", linestyle="--", label=f"target {step['value']}")
        axis.set_title(panel["title"], fontsize=10)
        axis.set_xlabel("s", fontsize=8)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(graphs) :]:
        axis.axis("off")
    figure.suptitle("Pagoda / Serving — dashboard queries against a live pagoda serve (tiny model, CPU)")
    figure.tight_layout()
    path = tmp_path / "dashboard-serving.png"
    figure.savefig(path, dpi=80)
    plt.close(figure)
    assert path.stat().st_size > 10_000
    if target := os.environ.get("PAGODA_DASHBOARD_PNG"):
        (REPO / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, REPO / target)
