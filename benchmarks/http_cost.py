"""Where the HTTP / offline gap goes: the main workload through five paths, in the same minutes.

    .venv/bin/python benchmarks/http_cost.py [--runs 6]

Each run takes a prompt set of its own (`peer_serve.py`'s main workload: 32 requests, concurrency 16,
the GGUF defaults) through:
- offline: the engine stepped in a loop, in a process of its own (`peer_serve.py`'s offline run);
- the engine front: `AsyncLLMEngine` in a process of its own, each request an asyncio task on its
  event loop, as the server's handlers are: the step thread and the hand-off of outputs, no HTTP;
- HTTP, whole bodies: `pagoda serve`, the requests with `stream: false` (no per-token writes);
- HTTP, streamed: another `pagoda serve`, the bench client (one SSE event per token);
- HTTP, streamed, lean reader: a third `pagoda serve`, the same streams read at a proxy's pace
  (`lean_run`): what the server costs with a client beside it that costs next to nothing.
Each server sees every prompt set once (the prefix cache gains nothing); the paths take turns leading
a run. Prints each run, the medians, each path against offline, and the CPU seconds the served runs'
client and the server's event loop took.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagoda.server.bench.client import Target
from pagoda.server.bench.dataset import BenchRequest
from pagoda.server.bench.report import summarize
from pagoda.server.bench.runner import run_benchmark
from peer_serve import WORKLOADS, child_run, cpu_seconds, free_port, offline_main_run, wait_ready, warm_up

MAIN = WORKLOADS[0]
MODEL = "SmolLM2-135M-Instruct"
PATHS = ["offline", "engine front", "HTTP, whole bodies", "HTTP, streamed", "HTTP, streamed, lean reader"]


async def front_run(requests: list[BenchRequest]) -> float:
    """Output tokens per second of `requests` through AsyncLLMEngine, `MAIN.concurrency` at a time."""
    from pagoda.server.engine.async_engine import AsyncLLMEngine
    from pagoda.server.engine.sampling_params import SamplingParams

    engine = AsyncLLMEngine()
    await engine.start()
    ids = itertools.count()
    limit = asyncio.Semaphore(MAIN.concurrency)
    tokens = 0

    async def one(prompt: str | list[int], max_tokens: int) -> None:
        nonlocal tokens
        async with limit:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            request = engine.make_request(f"front-{next(ids)}", prompt, params)
            async for _, output in engine.stream_all([request]):
                tokens += sum(len(choice.token_ids) for choice in output.outputs)

    try:
        await one("warm up", 4)
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(r.prompt, r.output_len) for r in requests))
        return tokens / (time.perf_counter() - start)
    finally:
        await engine.shutdown()


class _Reader(asyncio.Protocol):
    """One keep-alive connection; a response ends with the chunked body's last chunk. A response
    that is not a 200 fails the run (its body would not end so)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.ended: asyncio.Future[None] | None = None
        self._tail = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def expect(self) -> asyncio.Future[None]:
        """A new response is on its way: the future it ends."""
        self.ended, self._tail = asyncio.get_running_loop().create_future(), b""
        return self.ended

    def data_received(self, data: bytes) -> None:
        if self.ended is None or self.ended.done():
            return
        if not self._tail and not data.startswith(b"HTTP/1.1 200"):
            status = data.split(b"\r\n", 1)[0]
            self.ended.set_exception(RuntimeError(f"the server answered {status!r}"))
            return
        self._tail = (self._tail + data)[-7:]
        if self._tail.endswith(b"\r\n0\r\n\r\n"):
            self.ended.set_result(None)

    def connection_lost(self, exc) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(ConnectionError("the server closed the connection"))


async def lean_run(port: int, requests: list[BenchRequest], model: str, streams: int) -> None:
    """`requests` streamed, `streams` at a time over keep-alive connections, read at a proxy's pace:
    nothing parsed but the end of each response (what the server costs, with a client that costs
    next to nothing)."""
    loop = asyncio.get_running_loop()
    todo = list(reversed(requests))

    async def worker() -> None:
        _, reader = await loop.create_connection(_Reader, "127.0.0.1", port)
        while todo:
            request = todo.pop()
            body = json.dumps({"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
                               "ignore_eos": True, "stream": True}).encode()  # fmt: skip
            ended = reader.expect()
            reader.transport.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            await ended
        reader.transport.close()

    await asyncio.gather(*(worker() for _ in range(streams)))


def front_main_run(run: int) -> float:
    return child_run(__file__, "--front-run", str(run))["front_output_throughput"]


async def whole_bodies_run(base_url: str, requests: list[BenchRequest]) -> float:
    """Output tokens per second of `requests` sent with `stream: false`, `MAIN.concurrency` at a time."""
    limit = asyncio.Semaphore(MAIN.concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, request: BenchRequest) -> None:
        nonlocal tokens
        body = {"model": MODEL, "prompt": request.prompt, "max_tokens": request.output_len,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        async with limit, session.post(f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            tokens += (await response.json())["usage"]["completion_tokens"]

    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, r) for r in requests))
        return tokens / (time.perf_counter() - start)


def start_server(log: Path, *serve_args: str, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    """`pagoda serve` (its defaults, and `serve_args`) on a free port, ready and warm: (process, base URL)."""
    port = free_port()
    pagoda = Path(sys.executable).parent / "pagoda"
    process = subprocess.Popen(
        [str(pagoda), "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(f"{base_url}/v1/models", process, log)
    asyncio.run(warm_up(Target(base_url, model, ignore_eos=True)))
    return process, base_url


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--logs", type=Path, default=Path("benchmarks/results/http_cost"), help="server logs")
    parser.add_argument("--front-run", type=int, help=argparse.SUPPRESS)  # front_main_run's child
    args = parser.parse_args()
    if args.front_run is not None:
        throughput = asyncio.run(front_run(MAIN.requests(args.front_run)))
        print(json.dumps({"front_output_throughput": throughput}))
        return 0
    args.logs.mkdir(parents=True, exist_ok=True)
    whole, whole_url = start_server(args.logs / "whole_bodies.log")
    streamed, streamed_url = start_server(args.logs / "streamed.log")
    lean, lean_url = start_server(args.logs / "lean_reader.log")
    results: dict[str, list[float]] = {path: [] for path in PATHS}
    cpu: list[dict[str, float]] = []
    try:
        for run in range(args.runs):
            prompts = 2000 + run  # prompt sets of their own: no run meets another's prefix cache
            requests = MAIN.requests(prompts)
            for path in PATHS[run % len(PATHS) :] + PATHS[: run % len(PATHS)]:
                if path == "offline":
                    value = offline_main_run(prompts)["offline_output_throughput"]
                elif path == "engine front":
                    value = front_main_run(prompts)
                elif path == "HTTP, whole bodies":
                    value = asyncio.run(whole_bodies_run(whole_url, requests))
                elif path == "HTTP, streamed, lean reader":
                    start = time.perf_counter()  # ignore_eos: every request gets its output_len tokens
                    asyncio.run(lean_run(int(lean_url.rsplit(":", 1)[1]), requests, MODEL, MAIN.concurrency))
                    value = sum(r.output_len for r in requests) / (time.perf_counter() - start)
                else:
                    before = cpu_seconds(streamed.pid)
                    target = Target(streamed_url, MODEL, ignore_eos=True)
                    served, duration = asyncio.run(
                        run_benchmark(target, requests, max_concurrency=MAIN.concurrency, progress=False)
                    )
                    value = summarize(served, duration)["output_throughput"]
                    cpu.append(
                        {k: v - before[k] for k, v in cpu_seconds(streamed.pid).items()} | {"run_s": duration}
                    )
                results[path].append(value)
                print(f"run {run}: {path:28s} {value:7.1f} tok/s", flush=True)
    finally:
        for process in (whole, streamed, lean):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    offline = statistics.median(results["offline"])
    print(f"\n{'path':28s} {'median tok/s':>12s}  {'/ offline':>9s}  runs")
    for path, values in results.items():
        runs = " ".join(f"{v:.1f}" for v in values)
        print(
            f"{path:28s} {statistics.median(values):12.1f}  {statistics.median(values) / offline:9.2f}  {runs}"
        )
    print(
        f"streamed runs (median): client {statistics.median(c['client_cpu_s'] for c in cpu):.2f} CPU-s, "
        f"the server's event loop {statistics.median(c['server_main_thread_cpu_s'] for c in cpu):.2f}, "
        f"in {statistics.median(c['run_s'] for c in cpu):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
