"""AsyncLLMEngine: streaming deltas from the step thread, abort on consumer exit, stats, liveness."""

from __future__ import annotations

import asyncio

import pytest
from pagoda.server.engine.async_engine import AsyncLLMEngine
from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.sampling_params import SamplingParams


@pytest.fixture
async def engine(llama):
    engine = AsyncLLMEngine(EngineArgs(device="cpu", kv_cache_memory=16 << 20), loaded=llama.loaded)
    await engine.start()
    yield engine
    await engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [o async for o in engine.generate(prompt, params, request_id)]


async def test_concurrent_streams_are_deltas_and_match_offline(engine, llama):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [list(range(10, 30)), [5, 6, 7]]
    streams = await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
    expected = llama.llm().generate(prompts, params)
    for deltas, offline in zip(streams, expected, strict=True):
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        # each delta holds only what is new: joined, they are the offline output exactly
        tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
        assert all(len(c.token_ids) == len(c.logprobs) for d in deltas for c in d.outputs)
        assert tokens == offline.outputs[0].token_ids
        assert "".join(c.text for d in deltas for c in d.outputs) == offline.outputs[0].text
        assert [e for d in deltas for c in d.outputs for e in c.logprobs] == offline.outputs[0].logprobs
    stats = engine.stats()
    assert engine.alive and stats.generation_tokens == 24 and stats.num_running == 0
    assert stats.step_histograms.tokens.sum == 20 + 3 + 2 * 11
    assert engine.stats().step_histograms.tokens.sum == 20 + 3 + 2 * 11  # a read drains nothing
    assert engine.health() == (True, "ok")


async def test_consumer_leaving_aborts_and_frees_blocks(engine):
    stream = engine.generate(list(range(10, 40)), SamplingParams(max_tokens=400, ignore_eos=True), "long")
    first = await stream.__anext__()
    assert not first.finished
    await stream.aclose()
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    assert engine.engine.requests == {}


async def test_a_responses_requests_share_one_stream_and_leave_together(engine):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [engine.make_request(f"multi-{i}", p, params) for i, p in enumerate([[5, 6, 7], [8, 9]])]
    seen: dict[int, list[int]] = {0: [], 1: []}
    async for index, output in engine.stream_all(requests):
        seen[index] += [t for c in output.outputs for t in c.token_ids]
    assert [len(tokens) for tokens in seen.values()] == [6, 6]
    # leaving after the first output aborts both requests
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    requests = [engine.make_request(f"gone-{i}", list(range(10, 40)), long) for i in range(2)]
    stream = engine.stream_all(requests)
    await stream.__anext__()
    await stream.aclose()
    for _ in range(200):
        if engine.stats().num_running == 0 and engine.stats().num_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_blocks_used == 0 and engine.engine.requests == {}


async def test_the_event_loop_is_woken_once_per_step_not_once_per_request(engine, monkeypatch):
    """Each wake-up hands the GIL to the event loop's thread while the step thread waits for it:
    16 streams must not cost 16 of them a step."""
    loop = asyncio.get_running_loop()
    wakeups = 0
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        nonlocal wakeups
        wakeups += 1
        return call_soon_threadsafe(*args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    steps_before = engine.stats().step_histograms.tokens.count
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    await asyncio.gather(*(collect(engine, [5 + i, 6, 7], params, f"w{i}") for i in range(16)))
    steps = engine.stats().step_histograms.tokens.count - steps_before
    assert wakeups <= steps < 16 * 8


async def test_explicit_abort(engine):
    async def consume():
        return [
            o async for o in engine.generate([9, 9, 9], SamplingParams(max_tokens=400, ignore_eos=True), "x")
        ]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.stats().num_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_blocks_used == 0


async def test_liveness_is_the_async_fronts_own(llama):
    engine = AsyncLLMEngine(EngineArgs(device="cpu", kv_cache_memory=16 << 20), loaded=llama.loaded)
    assert not engine.alive  # not started
    await engine.start()
    assert engine.alive and engine.health() == (True, "ok")
    await engine.shutdown()
    assert not engine.alive and engine.health() == (False, "engine loop is not running")


async def test_a_busy_loop_that_makes_no_progress_is_unhealthy(engine):
    """Stall detection: work waiting and no step finished for STALL_SECONDS (simulated: the loop is
    parked, so neither its stats nor its progress time move while we set them)."""
    from pagoda.server.engine.async_engine import STALL_SECONDS
    from pagoda.server.engine.outputs import EngineStats

    with engine._lock:
        engine._last_progress -= STALL_SECONDS + 1  # idle that long is fine
    assert engine.health() == (True, "ok")
    with engine._lock:
        engine._stats = EngineStats(num_waiting=1)  # ... but not with work waiting
    alive, why = engine.health()
    assert not alive and "has not finished a step" in why
