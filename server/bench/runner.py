"""Arrivals (Poisson or all at once), a concurrency cap, and a progress bar."""

from __future__ import annotations

import asyncio
import math
import random
import time

import aiohttp
from pagoda.server.bench.client import RequestResult, Target, send_request
from pagoda.server.bench.dataset import BenchRequest
from tqdm import tqdm


async def run_benchmark(
    target: Target,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    timeout: float = 3600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results in request order and the wall time in seconds."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as session:
        t0 = time.perf_counter()

        async def one(request: BenchRequest) -> RequestResult:
            if limit is None:
                result = await send_request(session, target, request, t0)
            else:
                async with limit:
                    result = await send_request(session, target, request, t0)
            bar.update(1)
            return result

        tasks = []
        for i, request in enumerate(requests):
            tasks.append(asyncio.create_task(one(request)))
            if math.isfinite(request_rate) and i < len(requests) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration
