"""Metrics collection: parsing the exposition text, scraping pods over HTTP, the docs/metrics.md contract."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from pagoda.operator.autoscaling import collect
from pagoda.operator.autoscaling.collect import (
    MetricsError,
    PodSample,
    PodTarget,
    parse_metrics,
    query_prometheus,
    scrape_pods,
)
from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH
from support.autoscaler_pods import FakePodFarm, metrics_text
from support.prometheus import PrometheusServer, prometheus_binary

ROOT = Path(__file__).resolve().parents[2]


def test_parse_pod_metrics() -> None:
    sample = parse_metrics(metrics_text(kv=0.625, waiting=3, running=5, num_blocks=64, block_size=16))
    assert sample == PodSample(
        kv_cache_usage=0.625, waiting=3.0, running=5.0, capacity_tokens=1024, block_size=16, num_blocks=64
    )
    assert sample.values() == {KV_CACHE_USAGE: 0.625, QUEUE_DEPTH: 3.0}


def test_parse_refuses_incomplete_or_garbage_text() -> None:
    without_queue = "\n".join(
        line for line in metrics_text(0.5, 1).splitlines() if "num_requests_waiting" not in line
    )
    with pytest.raises(MetricsError, match="pagoda_num_requests_waiting"):
        parse_metrics(without_queue)
    with pytest.raises(MetricsError):
        parse_metrics("pagoda_kv_cache_usage_ratio{ this is not exposition format\n")


def test_metric_names_are_in_the_contract() -> None:
    """Every pagoda_* name the autoscaler reads is listed in docs/metrics.md."""
    documented = set(re.findall(r"`(pagoda_[a-z_]+)`", (ROOT / "docs/metrics.md").read_text()))
    used = set(re.findall(r'"(pagoda_[a-z_]+)"', Path(collect.__file__).read_text()))
    assert used, "no metric names found in the module"
    assert used <= documented, used - documented


async def test_scrape_pods_concurrently_with_a_short_timeout(fake_pods: FakePodFarm) -> None:
    good = await fake_pods.start(metrics_text(kv=0.5, waiting=2))
    failing = await fake_pods.start("")
    failing.status = 500
    slow = await fake_pods.start(metrics_text(kv=0.9, waiting=9))
    slow.delay = 1.0
    empty = await fake_pods.start("# nothing here\n")
    targets = [
        PodTarget("good", good.url),
        PodTarget("failing", failing.url),
        PodTarget("slow", slow.url),
        PodTarget("empty", empty.url),
        PodTarget("gone", "http://127.0.0.1:9/metrics"),
    ]

    result = await scrape_pods(targets, timeout=0.3)

    assert isinstance(result["good"], PodSample) and result["good"].kv_cache_usage == 0.5
    assert result["failing"] == "HTTP 500"
    assert "Timeout" in result["slow"]
    assert "metrics missing" in result["empty"]
    assert "ClientConnectorError" in result["gone"]


def test_parse_the_real_servers_exposition() -> None:
    """The serving pod's own metrics code (server/pod_metrics.py) with a fixed engine snapshot."""
    from pagoda.server.engine.outputs import EngineStats
    from pagoda.server.pod_metrics import ServerMetrics

    server_metrics = ServerMetrics("tiny")
    with pytest.raises(MetricsError):  # model still loading: no engine gauges yet → a missing pod
        parse_metrics(server_metrics.exposition().decode())
    server_metrics.attach(
        lambda: EngineStats(
            num_running=3,
            num_waiting=5,
            num_blocks_total=64,
            num_blocks_used=48,
            block_size=16,
            capacity_tokens=1024,
            max_model_len=512,
            dtype="float32",
        )
    )
    sample = parse_metrics(server_metrics.exposition().decode())
    assert sample == PodSample(
        kv_cache_usage=0.75, waiting=5.0, running=3.0, capacity_tokens=1024, block_size=16, num_blocks=64
    )


class LabelledPrometheus(PrometheusServer):
    """One static target per pod with the `namespace`/`pod` labels Kubernetes discovery would attach."""

    def __init__(self, pods: dict[str, str], workdir: Path) -> None:
        super().__init__(list(pods.values()), workdir, scrape_interval=0.5)
        self.pods = pods

    def _write_config(self) -> Path:
        path = super()._write_config()
        config = json.loads(path.read_text())
        config["scrape_configs"][0]["static_configs"] = [
            {"targets": [target], "labels": {"namespace": "ns1", "pod": pod}}
            for pod, target in self.pods.items()
        ]
        path.write_text(json.dumps(config))
        return path


@pytest.mark.skipif(prometheus_binary() is None, reason="needs the prometheus binary")
async def test_query_prometheus_instead_of_scraping(fake_pods: FakePodFarm, tmp_path: Path) -> None:
    a = await fake_pods.start(metrics_text(kv=0.25, waiting=1, running=2))
    b = await fake_pods.start(metrics_text(kv=0.75, waiting=6, running=4))
    prom = LabelledPrometheus({"llm-a": f"127.0.0.1:{a.port}", "llm-b": f"127.0.0.1:{b.port}"}, tmp_path)
    await asyncio.to_thread(prom.start)
    try:
        await asyncio.to_thread(prom.wait_for, 'count(pagoda_kv_cache_usage_ratio{namespace="ns1"}) == 2')
        result = await query_prometheus(
            prom.url, "ns1", ["llm-a", "llm-b", "llm-gone"], timeout=5, max_age_s=30
        )
    finally:
        await asyncio.to_thread(prom.stop)
    assert result["llm-a"] == PodSample(0.25, 1.0, 2.0, capacity_tokens=1024, block_size=16, num_blocks=64)
    assert result["llm-b"] == PodSample(0.75, 6.0, 4.0, capacity_tokens=1024, block_size=16, num_blocks=64)
    assert result["llm-gone"] == "no recent series in prometheus"
    unreachable = await query_prometheus("http://127.0.0.1:9", "ns1", ["llm-a"], timeout=1, max_age_s=30)
    assert unreachable["llm-a"].startswith("prometheus: ClientConnectorError")
