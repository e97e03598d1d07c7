"""Stand-in serving pods for the autoscaler tests: small aiohttp servers on loopback.

They serve a fixed, settable Prometheus text at /metrics (the names of docs/metrics.md), so the scraper
and the timer handler run over real HTTP without a model. The real server's output is tested too
(test_autoscaler_metrics.py) when `pagoda serve` is importable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp.web


def metrics_text(
    kv: float,
    waiting: float,
    running: float = 0.0,
    num_blocks: int = 64,
    block_size: int = 16,
    model: str = "tiny",
) -> str:
    """Exposition text as a pagoda serving pod writes it (prometheus_client format)."""
    labels = f'model_name="{model}"'
    return "\n".join(
        [
            "# HELP pagoda_kv_cache_usage_ratio KV blocks in use / total blocks",
            "# TYPE pagoda_kv_cache_usage_ratio gauge",
            f"pagoda_kv_cache_usage_ratio{{{labels}}} {kv}",
            "# TYPE pagoda_num_requests_waiting gauge",
            f"pagoda_num_requests_waiting{{{labels}}} {waiting}",
            "# TYPE pagoda_num_requests_running gauge",
            f"pagoda_num_requests_running{{{labels}}} {running}",
            "# TYPE pagoda_kv_cache_blocks_total gauge",
            f"pagoda_kv_cache_blocks_total{{{labels}}} {num_blocks}",
            "# TYPE pagoda_kv_cache_capacity_tokens gauge",
            f"pagoda_kv_cache_capacity_tokens{{{labels}}} {num_blocks * block_size}",
            "# TYPE pagoda_engine_info gauge",
            f'pagoda_engine_info{{{labels},block_size="{block_size}",num_blocks="{num_blocks}",'
            'max_model_len="512",dtype="float32"} 1.0',
            "# TYPE pagoda_preemptions_total counter",
            f"pagoda_preemptions_total{{{labels}}} 3.0",
            "",
        ]
    )


@dataclass
class FakePod:
    """A stand-in serving pod: `text` is what /metrics answers; `status` and `delay` simulate trouble."""

    port: int
    text: str
    status: int = 200
    delay: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


class FakePodFarm:
    """Starts stand-in pods on loopback (port 0: the OS picks a free one) and stops them all at the end."""

    def __init__(self) -> None:
        self.pods: list[FakePod] = []
        self._runners: list[aiohttp.web.AppRunner] = []

    async def start(self, text: str) -> FakePod:
        pod = FakePod(0, text)

        async def handle(_: aiohttp.web.Request) -> aiohttp.web.Response:
            if pod.delay:
                await asyncio.sleep(pod.delay)
            return aiohttp.web.Response(text=pod.text, status=pod.status, content_type="text/plain")

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", handle)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        pod.port = runner.addresses[0][1]
        self._runners.append(runner)
        self.pods.append(pod)
        return pod

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
