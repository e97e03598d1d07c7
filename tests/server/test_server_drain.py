"""`pagoda serve` as a real process: PAGODA_* env configuration, and SIGTERM drains then exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
from support.prometheus import free_port


async def wait_status(session: aiohttp.ClientSession, url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url) as response:
                if response.status == status:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        await asyncio.sleep(0.1)


async def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "PAGODA_SERVED_MODEL_NAME": "pagoda/tiny-served", "PAGODA_NUM_BLOCKS": "64",
           "PAGODA_MAX_MODEL_LEN": "256", "PAGODA_DRAIN_TIMEOUT": "30"}  # fmt: skip
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tiny_dir), "--host", "127.0.0.1",
         "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_status(session, url + "/ready", 200, timeout=180)
            async with session.get(url + "/v1/models") as response:
                assert (await response.json())["data"][0][
                    "id"
                ] == "pagoda/tiny-served"  # from the environment
            async with session.get(url + "/v1/models/pagoda/tiny-served") as response:
                assert response.status == 200 and (await response.json())["id"] == "pagoda/tiny-served"
            body = {"model": "pagoda/tiny-served", "prompt": "Hello", "max_tokens": 150, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            stream = await session.post(url + "/v1/completions", json=body)
            assert stream.status == 200
            assert (await stream.content.readline()).startswith(b"data:")

            process.send_signal(signal.SIGTERM)
            await wait_status(session, url + "/ready", 503, timeout=5)  # out of the Service's endpoints
            async with session.post(url + "/v1/completions", json={"prompt": "x"}) as refused:
                assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
            async with session.get(url + "/health") as health:
                assert health.status == 200  # still alive while draining: no liveness kill

            events = [line.strip() async for line in stream.content if line.strip()]
            assert events[-1] == b"data: [DONE]"
            usage = json.loads(events[-2][len(b"data: ") :])["usage"]
            assert usage["completion_tokens"] == 150  # the in-flight request finished in full
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "draining 1 in-flight requests" in text and "stopped (drained)" in text


def test_a_model_that_cannot_load_exits_1(tmp_path):
    """The pod restarts (CrashLoopBackOff shows why) instead of idling unready forever."""
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tmp_path / "missing"), "--host", "127.0.0.1",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "model failed to load" in result.stderr and "missing" in result.stderr
