"""Collect what the autoscaler needs from the serving pods: scrape their `/metrics`, or ask Prometheus.

Metric names come only from docs/metrics.md (a contract; a test checks this module against it).
A pod that does not answer within the timeout, answers garbage, or lacks a metric is simply absent
from the result: the decision treats it as a missing pod (HPA rules), never as zero load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH
from prometheus_client.parser import text_string_to_metric_families

KV_USAGE_METRIC = "pagoda_kv_cache_usage_ratio"
WAITING_METRIC = "pagoda_num_requests_waiting"
RUNNING_METRIC = "pagoda_num_requests_running"
CAPACITY_METRIC = "pagoda_kv_cache_capacity_tokens"
BLOCKS_METRIC = "pagoda_kv_cache_blocks_total"
ENGINE_INFO_METRIC = "pagoda_engine_info"

# A pod annotation that overrides the scrape port (the local e2e harness runs every "pod" on 127.0.0.1,
# each server on its own port); in a cluster the pod's `http` port 8000 is used.
METRICS_PORT_ANNOTATION = "serving.pagoda.dev/metrics-port"
DEFAULT_METRICS_PORT = 8000


class MetricsError(ValueError):
    """A pod's metrics text lacks what the autoscaler needs."""


@dataclass(frozen=True)
class PodSample:
    kv_cache_usage: float  # 0–1
    waiting: float
    running: float
    capacity_tokens: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None

    def values(self) -> dict[str, float]:
        """The per-pod values the decision scales on."""
        return {KV_CACHE_USAGE: self.kv_cache_usage, QUEUE_DEPTH: self.waiting}


@dataclass(frozen=True)
class PodTarget:
    name: str
    url: str  # the full /metrics URL


def parse_metrics(text: str) -> PodSample:
    """A serving pod's Prometheus text exposition → its sample. Raises MetricsError if incomplete."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == ENGINE_INFO_METRIC:
                    info.update(s.labels)
                else:
                    sums[s.name] = sums.get(s.name, 0.0) + s.value
                    counts[s.name] = counts.get(s.name, 0) + 1
    except ValueError as exc:
        raise MetricsError(f"unparsable metrics text: {exc}") from exc
    missing = [m for m in (KV_USAGE_METRIC, WAITING_METRIC) if m not in sums]
    if missing:
        raise MetricsError(f"metrics missing: {', '.join(missing)}")

    def as_int(value: float | str | None) -> int | None:
        return None if value is None else int(float(value))

    return PodSample(
        kv_cache_usage=sums[KV_USAGE_METRIC] / counts[KV_USAGE_METRIC],  # one series per pod; mean if several
        waiting=sums[WAITING_METRIC],
        running=sums.get(RUNNING_METRIC, 0.0),
        capacity_tokens=as_int(sums.get(CAPACITY_METRIC)),
        block_size=as_int(info.get("block_size")),
        num_blocks=as_int(sums.get(BLOCKS_METRIC, info.get("num_blocks"))),
    )


async def scrape_pod(session: aiohttp.ClientSession, target: PodTarget) -> PodSample | str:
    """The pod's sample, or a one-line error saying why there is none."""
    try:
        async with session.get(target.url) as response:
            if response.status != 200:
                return f"HTTP {response.status}"
            return parse_metrics(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, MetricsError) as exc:
        return f"{type(exc).__name__}: {exc}".rstrip(": ")


async def scrape_pods(targets: Iterable[PodTarget], timeout: float) -> dict[str, PodSample | str]:
    """Scrape all pods concurrently; each answer is a PodSample or an error string."""
    targets = list(targets)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        results = await asyncio.gather(*(scrape_pod(session, t) for t in targets))
    return {t.name: r for t, r in zip(targets, results, strict=True)}


async def query_prometheus(url: str, namespace: str, pods: Sequence[str], timeout: float,
                           max_age_s: float) -> dict[str, PodSample | str]:
    """The same samples from Prometheus (`autoscaling.prometheusURL`), by the `namespace`/`pod` labels
    its Kubernetes service discovery attaches. Series older than `max_age_s` count as missing: the
    autoscaler must never scale on stale data, and Prometheus would otherwise return a value up to 5 min old.
    """
    if not pods:
        return {}
    selector = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    window = f"{max(1, round(max_age_s))}s"
    metrics = (KV_USAGE_METRIC, WAITING_METRIC, RUNNING_METRIC, CAPACITY_METRIC, BLOCKS_METRIC)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def instant(metric: str) -> dict[str, float]:
            how = "avg" if metric == KV_USAGE_METRIC else "sum"  # a ratio averages; counts add up
            query = f"{how} by (pod) (last_over_time({metric}{{{selector}}}[{window}]))"
            async with session.get(f"{url.rstrip('/')}/api/v1/query", params={"query": query}) as resp:
                body = await resp.json()
            if body.get("status") != "success":
                raise MetricsError(f"prometheus query failed: {body.get('error', body)}")
            return {r["metric"]["pod"]: float(r["value"][1]) for r in body["data"]["result"]}

        try:
            kv, waiting, running, capacity, blocks = await asyncio.gather(*(instant(m) for m in metrics))
        except (aiohttp.ClientError, asyncio.TimeoutError, MetricsError, KeyError, ValueError) as exc:
            return {p: f"prometheus: {type(exc).__name__}: {exc}" for p in pods}
    return {p: samples_from_series(p, kv, waiting, running, capacity, blocks) for p in pods}


def samples_from_series(pod: str, kv: Mapping[str, float], waiting: Mapping[str, float],
                        running: Mapping[str, float], capacity: Mapping[str, float],
                        blocks: Mapping[str, float]) -> PodSample | str:
    if pod not in kv or pod not in waiting:
        return "no recent series in prometheus"
    num_blocks = int(blocks[pod]) if pod in blocks else None
    capacity_tokens = int(capacity[pod]) if pod in capacity else None
    block_size = capacity_tokens // num_blocks if capacity_tokens and num_blocks else None
    return PodSample(kv[pod], waiting[pod], running.get(pod, 0.0), capacity_tokens, block_size, num_blocks)
