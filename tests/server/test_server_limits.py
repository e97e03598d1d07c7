"""Client disconnects, the API key, the waiting-queue limit, and the probes while loading."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from pagoda.server.api.state import ServerConfig

LONG = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
VERY_LONG = {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True}  # for a server of max_model_len 512


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def open_stream(session: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    """POST a streamed completion and read until its first event: the request is then running."""
    response = await session.post(url + "/v1/completions", json={**body, "stream": True})
    assert response.status == 200, await response.text()
    while not (await response.content.readline()).startswith(b"data:"):
        pass
    return response


def finished(server, reason: str) -> float:
    return server.state.metrics.finished[reason]._value.get()


async def test_client_disconnect_aborts_and_frees_blocks(start_server):
    # the tiny model's whole context (500 tokens): none can finish before its client leaves
    server = start_server(max_model_len=512, num_blocks=160)
    aborted_before = finished(server, "abort")
    async with aiohttp.ClientSession() as session:
        streams = [await open_stream(session, server.url, VERY_LONG) for _ in range(3)]
        stats = server.stats()
        assert stats.num_running + stats.num_waiting >= 1 and stats.num_blocks_used > 0
        for response in streams:  # the client goes away mid-stream
            response.close()
        await wait_until(lambda: server.stats().num_running == 0 and server.stats().num_blocks_used == 0)

        # a non-streamed request whose client gives up
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                server.url + "/v1/completions", json=VERY_LONG, timeout=aiohttp.ClientTimeout(total=0.3)
            )
    await wait_until(lambda: finished(server, "abort") == aborted_before + 4)

    def idle() -> bool:  # the engine drops aborted requests at its next loop turn
        stats = server.stats()
        return (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)

    await wait_until(idle)
    assert server.state.in_flight == 0


def test_api_key_guards_v1_only(start_server, http_request):
    server = start_server(ServerConfig(api_key="sekret"))
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert http_request(server.url, "POST", "/v1/completions", {"prompt": "x"}).status == 401
    good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
    assert good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2).choices
    for path in ("/health", "/ready", "/metrics"):
        assert http_request(server.url, "GET", path).status == 200, path


async def test_queue_over_limit_answers_429_at_once(start_server, http_request):
    server = start_server(ServerConfig(max_queue_len=1), max_num_seqs=1)
    async with aiohttp.ClientSession() as session:
        running = await open_stream(session, server.url, LONG)
        waiting = asyncio.create_task(open_stream(session, server.url, LONG))
        await wait_until(lambda: server.state.in_flight == 2)
        start = time.monotonic()
        refused = await asyncio.to_thread(http_request, server.url, "POST", "/v1/completions", LONG)
        assert refused.status == 429 and time.monotonic() - start < 2.0
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
        running.close()  # frees the running slot: the waiting request gets it
        (await waiting).close()
    await wait_until(lambda: server.state.in_flight == 0 and server.stats().num_blocks_used == 0)
    accepted = await asyncio.to_thread(
        http_request, server.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}
    )
    assert accepted.status == 200


async def test_probes_while_the_model_loads(http_request):
    from pagoda.server.api.lifecycle import PagodaServer

    server = PagodaServer(ServerConfig(), host="127.0.0.1", port=0)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        results = [
            await asyncio.to_thread(http_request, url, method, path, body)
            for method, path, body in [
                ("GET", "/health", None),
                ("GET", "/ready", None),
                ("POST", "/v1/completions", {"prompt": "x"}),
            ]
        ]
        assert [r.status for r in results] == [200, 503, 503]
        assert results[2].json()["error"]["code"] == "loading"
    finally:
        await server.drain_and_stop(timeout=0)


async def test_dead_engine_loop_fails_liveness_and_answers_503(start_server, http_request):
    server = start_server()
    await asyncio.to_thread(server.call, server.state.engine.shutdown())  # the step-loop thread ends
    health = await asyncio.to_thread(http_request, server.url, "GET", "/health")
    assert health.status == 503 and "not running" in health.json()["status"]
    refused = await asyncio.to_thread(http_request, server.url, "POST", "/v1/completions", {"prompt": "x"})
    assert refused.status == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_a_request_the_engine_aborts_is_an_error_not_a_short_answer(start_server, http_request, monkeypatch):
    """The up-front size check answers such requests 400 before they reach the engine; this bypasses it
    to reach the engine's own backstop (a sequence the whole pool cannot hold is aborted)."""
    server = start_server(num_blocks=4)  # 64 token slots
    monkeypatch.setattr(server.state.engine.engine, "_check_fits", lambda *args: None)
    too_long = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
    answer = http_request(server.url, "POST", "/v1/completions", too_long)
    assert answer.status == 503 and answer.json()["error"]["code"] == "engine_aborted"
    streamed = http_request(server.url, "POST", "/v1/completions", {**too_long, "stream": True})
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status == 200 and events[-1] == "[DONE]"
    assert '"engine_aborted"' in events[-2] and all('"error"' not in e for e in events[:-2])
    monkeypatch.undo()
    fits = http_request(server.url, "POST", "/v1/completions", {**too_long, "max_tokens": 5})
    assert fits.status == 200 and fits.json()["usage"]["completion_tokens"] == 5
    assert server.stats().num_blocks_used == 0
