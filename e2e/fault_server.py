"""Faults inside one serving process (`pagoda serve` as a subprocess, the OpenAI client as the users).

- engine-death: the engine loop dies mid-load (the test-only hook PAGODA_FAULT_STEP_RAISE makes the
  next model step raise). Wanted: /health 503 within a second, every in-flight and queued request
  ends at once with a 5xx error body (code engine_dead), the process exits non-zero (the kubelet
  restarts it).
- drain: SIGTERM with 50 requests in flight. Wanted: all 50 finish, new requests get 503 (code
  draining) while it drains, /ready is 503 at once, the process exits 0 within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from pagoda.operator.autoscaling.collect import MetricsError, parse_metrics
from pagoda.server.engine.fault_injection import ENV as FAULT_ENV
from support.prometheus import free_port

from e2e.fault_plot import plot_fault
from e2e.load import Load, outcome

MODEL = "tiny"


class ServeProcess:
    def __init__(self, model_dir: Path, out: Path, extra_args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out / "serve.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", *extra_args],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log, stderr=subprocess.STDOUT, cwd=out)
        log.close()

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"pagoda serve exited: see {self.log_path}"
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{self.url}/ready") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"pagoda serve not ready within {timeout:.0f} s")

    async def in_flight(self, session: aiohttp.ClientSession) -> float:
        """Requests the engine holds (running + waiting), from its /metrics."""
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, MetricsError):
            async with session.get(f"{self.url}/metrics") as response:
                sample = parse_metrics(await response.text())
                return sample.running + sample.waiting
        return 0.0

    async def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.process.poll()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


async def probe(session: aiohttp.ClientSession, url: str) -> int:
    """The HTTP status, 0 when nothing answers (the process is gone)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=0.5)) as response:
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


async def watch(session: aiohttp.ClientSession, server: ServeProcess, clock: Any, stop: asyncio.Event,
                series: dict[str, list[tuple[float, float]]]) -> None:
    """/health and /ready every 0.1 s (1 = 200, 0 = anything else) and the engine's in-flight count."""
    while not stop.is_set():
        t = clock()
        health, ready = await probe(session, f"{server.url}/health"), await probe(session, f"{server.url}/ready")
        series["/health 200"].append((t, float(health == 200)))
        series["/health 503"].append((t, float(health == 503)))
        series["/ready 200"].append((t, float(ready == 200)))
        series["in flight (engine)"].append((t, await server.in_flight(session) if health else 0.0))
        await asyncio.sleep(0.1)


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Until `predicate()` (a value or an awaitable) is true."""
    deadline = time.monotonic() + timeout
    while not ((await value) if inspect.isawaitable(value := predicate()) else value):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.05)


def new_series() -> dict[str, list[tuple[float, float]]]:
    return {"/health 200": [], "/health 503": [], "/ready 200": [], "in flight (engine)": []}


def panels(series: dict[str, list[tuple[float, float]]]) -> list[tuple[str, dict]]:
    counts = {"in flight (engine)": series["in flight (engine)"]}
    return [("probe (1 = yes)", {k: v for k, v in series.items() if k not in counts}), ("requests", counts)]


def first_at(points: list[tuple[float, float]], after: float) -> float | None:
    return next((t for t, v in points if t >= after and v), None)


@contextlib.asynccontextmanager
async def watched(server: ServeProcess) -> Any:
    """Wait for `server` to be ready, then poll its probes and metrics until the block ends; stop it after.
    Yields (session, clock, series): the clock counts seconds since the process started."""
    t0 = time.monotonic()

    def clock() -> float:
        return round(time.monotonic() - t0, 3)

    series = new_series()
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        try:
            await server.wait_ready(session)
            watcher = asyncio.create_task(watch(session, server, clock, stop, series))
            try:
                yield session, clock, series
            finally:
                stop.set()
                await watcher
        finally:
            server.stop()


async def engine_death(model_dir: Path, out: Path, running: int = 4, queued: int = 8) -> dict[str, Any]:
    trigger = out / "kill-the-engine-loop"
    trigger.unlink(missing_ok=True)
    server = ServeProcess(model_dir, out, ["--max-num-seqs", str(running), "--num-blocks", "256"],
                          {FAULT_ENV: str(trigger)})
    async with watched(server) as (_session, clock, series):
        load = Load(server.url, MODEL, clock, prompt_words=10, max_tokens=400, timeout_s=60)
        burst = asyncio.create_task(load.burst(running + queued))
        await wait_for(lambda: sum(r.ttft is not None for r in load.records) >= running
                       or any(r.error for r in load.records), 120, "the running requests streaming")
        assert not any(r.error for r in load.records), load.records  # a request failed before the fault
        await asyncio.sleep(0.5)
        t_fault = clock()
        trigger.write_text("fault")
        records = await asyncio.wait_for(burst, 60)
        code = await server.wait_exit(30)
        t_exit = clock()
        await asyncio.sleep(0.3)  # the probes after the exit
        await load.close()
    failed_after = [round(r.end - t_fault, 3) for r in records if not r.ok]
    health_503 = first_at(series["/health 503"], t_fault)
    result = {
        **outcome(records), "fault_at_s": t_fault, "exit_code": code, "exit_after_s": round(t_exit - t_fault, 2),
        "health_503_after_s": round(health_503 - t_fault, 3) if health_503 is not None else None,
        "slowest_error_after_fault_s": max(failed_after, default=None),
        "codes": sorted({r.code or r.error or "?" for r in records if not r.ok}),
    }
    result["checks"] = {
        "/health 503 within 1 s": result["health_503_after_s"] is not None and result["health_503_after_s"] <= 1.0,
        "every in-flight and queued request failed with engine_dead": result["failed"] == len(records)
        and all(r.code == "engine_dead" for r in records),
        "the errors came at once (within 2 s)": bool(failed_after) and max(failed_after) <= 2.0,
        "the process exited non-zero": code not in (None, 0),
    }
    plot_fault(out / "engine-death.png",
               f"Engine loop dies under load: {running} running + {queued} queued requests", records,
               [(t_fault, "step raises"), (t_exit, f"exit {code}")],
               panels(series))
    return result


async def drain(model_dir: Path, out: Path, in_flight: int = 50) -> dict[str, Any]:
    server = ServeProcess(model_dir, out, ["--max-num-seqs", str(in_flight), "--num-blocks", "1024",
                                           "--drain-timeout", "60"], {})
    async with watched(server) as (session, clock, series):
        load = Load(server.url, MODEL, clock, prompt_words=20, max_tokens=96, timeout_s=90)
        late = Load(server.url, MODEL, clock, prompt_words=5, max_tokens=4, timeout_s=10)
        burst = asyncio.create_task(load.burst(in_flight))
        async def all_in() -> bool:
            return await server.in_flight(session) >= in_flight

        await wait_for(all_in, 120, f"{in_flight} in flight")
        t_term = clock()
        server.process.send_signal(signal.SIGTERM)
        refused = []
        while not burst.done():  # newcomers while draining
            refused.append(await late.one(0))
            await asyncio.sleep(0.2)
        records = burst.result()
        code = await server.wait_exit(60)
        t_exit = clock()
        await load.close()
        await late.close()
    ready_503 = next((t for t, v in series["/ready 200"] if t >= t_term and not v), None)
    last_end = max(r.end for r in records)
    result = {
        **outcome(records), "sigterm_at_s": t_term, "exit_code": code, "drained_in_s": round(t_exit - t_term, 2),
        "newcomers": outcome(refused), "newcomer_codes": sorted({r.code or r.error or "?" for r in refused}),
        "ready_503_after_s": round(ready_503 - t_term, 3) if ready_503 is not None else None,
    }
    result["checks"] = {
        f"all {in_flight} in-flight requests finished": result["sent"] == in_flight and result["failed"] == 0,
        # Until the last in-flight request ended (the port closes right after it — its client notes the
        # end a moment later — and a newcomer then finds the port closed, as it finds no endpoint).
        "newcomers refused with 503 draining": bool(refused) and all(
            r.status == 503 and r.code == "draining" for r in refused if r.end < last_end - 0.5),
        "/ready 503 within 1 s": result["ready_503_after_s"] is not None and result["ready_503_after_s"] <= 1.0,
        "exit 0 within the grace period": code == 0 and t_exit - t_term < 60,
    }
    plot_fault(out / "drain.png", f"SIGTERM with {in_flight} requests in flight", [*records, *refused],
               [(t_term, "SIGTERM"), (t_exit, f"exit {code}")], panels(series))
    return result

