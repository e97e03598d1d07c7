"""A real Prometheus scrapes a server under load; PromQL for every metric in docs/metrics.md has data."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from support.prometheus import PrometheusServer, prometheus_binary

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
pytestmark = pytest.mark.skipif(prometheus_binary() is None, reason="Debian's prometheus is not installed")


def documented() -> dict[str, str]:
    """metric name -> type, from the contract table."""
    rows = re.findall(r"^\| `(pagoda_[a-z0-9_]+)` \| ([a-z]+)", DOC.read_text(), flags=re.MULTILINE)
    return dict(rows)


async def load(url: str, model: str) -> None:
    """Concurrent streams with a shared prefix (prefix-cache hits), n=2 (shared blocks), one abort."""
    prefix = "Once upon a time there was a small model that served tokens from a paged cache. " * 2
    async with aiohttp.ClientSession() as session:

        async def one(i: int, n: int = 1, abort: bool = False) -> None:
            body = {"model": model, "prompt": prefix + f"Story {i}:", "max_tokens": 80, "n": n,
                    "ignore_eos": True, "temperature": 0.8, "stream": True}  # fmt: skip
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                lines = 0
                async for _ in response.content:
                    lines += 1
                    if abort and lines > 10:
                        return  # leaving the block closes the connection mid-stream

        await one(-1)  # fills the prefix cache: the concurrent requests below hit it
        # Rounds for at least 2 s: several 0.5 s scrapes must see requests running, however fast a
        # round is.
        deadline = asyncio.get_running_loop().time() + 2.0
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.gather(*(one(i) for i in range(5)), one(5, n=2), one(6, abort=True))


async def test_prometheus_scrapes_every_documented_metric(server, tmp_path):
    host_port = server.url.removeprefix("http://")
    model = server.state.model_name
    with PrometheusServer([host_port], tmp_path / "prometheus", scrape_interval=0.5) as prom:
        await asyncio.to_thread(prom.wait_for, "pagoda_engine_info")
        await load(server.url, model)
        await asyncio.sleep(1.5)  # a scrape after the load
        assert prom.targets_health() == ["up"]

        for name, kind in documented().items():
            queries = [f"{name}_count", f"{name}_sum", f"{name}_bucket"] if kind == "histogram" else [name]
            for query in queries:
                result = await asyncio.to_thread(prom.wait_for, f'{query}{{model_name="{model}"}}', 10)
                assert result, query

        def value(promql: str) -> float:
            result = prom.query(promql)
            assert result, promql
            return float(result[0]["value"][1])

        window = "[2m]"
        assert value(f"max_over_time(pagoda_num_requests_running{window})") >= 1
        assert 0 < value(f"max_over_time(pagoda_kv_cache_usage_ratio{window})") <= 1
        assert value("pagoda_generation_tokens_total") >= 7 * 80
        assert value("pagoda_prompt_tokens_total") > 0
        assert value("pagoda_prefix_cache_hits_total") > 0
        assert value("pagoda_prefix_cache_queries_total") >= value("pagoda_prefix_cache_hits_total")
        assert value('pagoda_requests_finished_total{finished_reason="abort"}') >= 1
        assert value('pagoda_requests_finished_total{finished_reason="length"}') >= 7
        assert value("pagoda_time_to_first_token_seconds_count") >= 7
        assert value("pagoda_iteration_tokens_count") > 0
        assert value("pagoda_inter_token_latency_seconds_count") > 0
        p50 = value("histogram_quantile(0.5, sum by (le) (pagoda_inter_token_latency_seconds_bucket))")
        assert 0 < p50 < 10
        assert value("pagoda_kv_cache_capacity_tokens") == value("pagoda_kv_cache_blocks_total") * 16
        info = prom.query("pagoda_engine_info")[0]["metric"]
        assert info["block_size"] == "16" and info["num_blocks"] == "64" and info["dtype"] == "float32"
        assert info["quantization"] == "none"  # an HF folder: dense unless asked
        assert value("pagoda_kv_cache_blocks_used") == 0  # all finished or aborted: nothing held
