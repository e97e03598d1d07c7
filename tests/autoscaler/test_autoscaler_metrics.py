"""Metrics collection: parsing the exposition text, scraping pods over HTTP, the docs/metrics.md contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pagoda.operator.autoscaling import metrics
from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH
from pagoda.operator.autoscaling.metrics import MetricsError, PodSample, PodTarget, parse_metrics, scrape_pods
from support.autoscaler_pods import FakePodFarm, metrics_text

ROOT = Path(__file__).resolve().parents[2]


def test_parse_pod_metrics() -> None:
    sample = parse_metrics(metrics_text(kv=0.625, waiting=3, running=5, num_blocks=64, block_size=16))
    assert sample == PodSample(kv_cache_usage=0.625, waiting=3.0, running=5.0, capacity_tokens=1024,
                               block_size=16, num_blocks=64)
    assert sample.values() == {KV_CACHE_USAGE: 0.625, QUEUE_DEPTH: 3.0}


def test_parse_refuses_incomplete_or_garbage_text() -> None:
    without_queue = "\n".join(line for line in metrics_text(0.5, 1).splitlines()
                              if "num_requests_waiting" not in line)
    with pytest.raises(MetricsError, match="pagoda_num_requests_waiting"):
        parse_metrics(without_queue)
    with pytest.raises(MetricsError):
        parse_metrics("pagoda_kv_cache_usage_ratio{ this is not exposition format\n")


def test_metric_names_are_in_the_contract() -> None:
    """Every pagoda_* name the autoscaler reads is listed in docs/metrics.md."""
    documented = set(re.findall(r"`(pagoda_[a-z_]+)`", (ROOT / "docs/metrics.md").read_text()))
    used = set(re.findall(r'"(pagoda_[a-z_]+)"', Path(metrics.__file__).read_text()))
    assert used, "no metric names found in the module"
    assert used <= documented, used - documented


async def test_scrape_pods_concurrently_with_a_short_timeout(fake_pods: FakePodFarm) -> None:
    good = await fake_pods.start(metrics_text(kv=0.5, waiting=2))
    failing = await fake_pods.start("")
    failing.status = 500
    slow = await fake_pods.start(metrics_text(kv=0.9, waiting=9))
    slow.delay = 1.0
    empty = await fake_pods.start("# nothing here\n")
    targets = [PodTarget("good", good.url), PodTarget("failing", failing.url), PodTarget("slow", slow.url),
               PodTarget("empty", empty.url), PodTarget("gone", "http://127.0.0.1:9/metrics")]

    result = await scrape_pods(targets, timeout=0.3)

    assert isinstance(result["good"], PodSample) and result["good"].kv_cache_usage == 0.5
    assert result["failing"] == "HTTP 500"
    assert "Timeout" in result["slow"]
    assert "metrics missing" in result["empty"]
    assert "ClientConnectorError" in result["gone"]
