"""Arrivals (Poisson or all at once), a concurrency cap, and a progress bar."""

from __future__ import annotations

import asyncio
import math
import random
import time

from pagoda.server.bench.client import RequestResult, Target, send_request
from pagoda.server.bench.dataset import BenchRequest
from pagoda.server.bench.http import Pool
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
    pool = Pool(target.url)
    t0 = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send_request(pool, target, request, t0, timeout)
        else:
            async with limit:
                result = await send_request(pool, target, request, t0, timeout)
        bar.update(1)
        return result

    try:
        tasks = []
        for i, request in enumerate(requests):
            tasks.append(asyncio.create_task(one(request)))
            if math.isfinite(request_rate) and i < len(requests) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    finally:
        pool.close()
    bar.close()
    return list(results), duration
