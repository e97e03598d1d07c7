"""What the HTTP side costs per streamed token and per request, with the engine's cost taken away.

    .venv/bin/python benchmarks/stream_cost.py [--rounds 6]

`pagoda serve` (its defaults) on the tests' tiny random Llama, whose steps take next to no time, so
the server's event loop is most of the work. Each round sends 64 streamed completions of 128 tokens,
16 at a time, through two clients in turn:
- `pagoda bench serve`'s client (`server/bench/http.py`: every event parsed and timed);
- a lean reader that parses nothing but the end of each response, as fast as a proxy in front of the
  pods would read.
Then 200 one-token requests with ~650-character prompts (the lean reader) for the cost per request.
Prints tokens per second and the CPU the server's event-loop thread and the client spent: per token
and per request (median of the rounds). On a host of few cores this CPU is what served throughput
loses against the offline engine (`http_cost.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from http_cost import lean_run, start_server  # noqa: E402
from pagoda.server.bench.client import Target  # noqa: E402
from pagoda.server.bench.dataset import BenchRequest  # noqa: E402
from pagoda.server.bench.runner import run_benchmark  # noqa: E402
from peer_serve import cpu_seconds  # noqa: E402

MODEL = "tiny"
STREAMS, REQUESTS, TOKENS = 16, 64, 128
WORDS = "the quick brown fox jumps over a lazy dog while " * 13


async def bench_client_run(target: Target, requests: list[BenchRequest]) -> None:
    results, _ = await run_benchmark(target, requests, max_concurrency=STREAMS, progress=False)
    failed = [result.error for result in results if not result.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")


def measure(pid: int, work: Coroutine) -> tuple[float, float, float]:
    """(seconds, server event-loop CPU seconds, this process's CPU seconds) of running `work`."""
    before, start = cpu_seconds(pid), time.perf_counter()
    asyncio.run(work)
    seconds, after = time.perf_counter() - start, cpu_seconds(pid)
    return seconds, *(after[key] - before[key] for key in ("server_main_thread_cpu_s", "client_cpu_s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from support.tiny_models import make_tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="pagoda-stream-cost-")
    folder = Path(scratch.name)
    make_tiny_model("llama", folder / "model", max_position_embeddings=2048)
    model_args = ("--model", str(folder / "model"), "--served-model-name", MODEL)
    server, base_url = start_server(folder / "serve.log", *model_args, model=MODEL)
    port = int(base_url.rsplit(":", 1)[1])
    target = Target(base_url, MODEL)
    rows: dict[str, list[tuple[float, float, float]]] = {"pagoda bench client": [], "lean reader": []}
    per_request = []
    try:
        for round_ in range(args.rounds):
            requests = [BenchRequest(f"{round_} {i} {WORDS}", "", 0, TOKENS) for i in range(REQUESTS)]
            tokens = REQUESTS * TOKENS
            for name in list(rows)[:: 1 if round_ % 2 else -1]:
                work = (
                    bench_client_run(target, requests)
                    if name == "pagoda bench client"
                    else lean_run(port, requests, MODEL, STREAMS)
                )
                seconds, loop_cpu, client_cpu = measure(server.pid, work)
                rows[name].append((tokens / seconds, loop_cpu / tokens * 1e6, client_cpu / tokens * 1e6))
            short = [BenchRequest(f"{round_} {i} short {WORDS}", "", 0, 1) for i in range(200)]
            _, loop_cpu, _ = measure(server.pid, lean_run(port, short, MODEL, STREAMS))
            per_request.append(loop_cpu / len(short) * 1e6)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        scratch.cleanup()
    print(f"{STREAMS} streams, {REQUESTS} x {TOKENS} tokens a round, {args.rounds} rounds (medians)")
    print(f"{'client':22s} {'tok/s':>8s} {'loop CPU µs/token':>18s} {'client CPU µs/token':>20s}")
    for name, values in rows.items():
        tps, loop_us, client_us = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{name:22s} {tps:8.0f} {loop_us:18.1f} {client_us:20.1f}")
    print(f"one-token requests (lean reader): loop CPU {statistics.median(per_request):.0f} µs a request")


if __name__ == "__main__":
    main()
