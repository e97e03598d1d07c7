"""Many concurrent clients against one server whose KV pool is too small for them all.

The official async `openai` client sends completions, streams, chats, n > 1 and seeded sampling;
other clients (aiohttp) walk away mid-stream or time out. Preemption, disconnects and aborts then
all happen while the step loop runs. Afterwards nothing is held (no running or waiting request,
no used block, nothing in flight), the loop is alive, and every greedy answer equals the offline
engine's on the same weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import aiohttp
import openai
import pytest
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "blue", "sky", "river", "stone", "light", "tree"]
# 12 blocks x 16 tokens for up to 6 sequences of up to ~75 tokens (n = 2 doubles some): preemption.
SMALL_POOL = {"num_blocks": 12, "max_num_seqs": 6}
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def small_pool_server(start_server):
    return start_server(**SMALL_POOL)


@pytest.fixture(scope="module")
def offline(tiny_dir, tiny_engine) -> LLM:
    return LLM(str(tiny_dir), **tiny_engine)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def complete(client, model, prompt, max_tokens, offline):
    response = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=EXACT
    )
    return response.choices[0].text, offline.generate(prompt, greedy(max_tokens))[0].outputs[0].text


async def stream(client, model, prompt, max_tokens, offline):
    chunks = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=EXACT,
    )  # fmt: skip
    text, usage = "", None
    async for chunk in chunks:
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == max_tokens
    return text, offline.generate(prompt, greedy(max_tokens))[0].outputs[0].text


async def chat(client, model, prompt, max_tokens, offline):
    messages = [{"role": "user", "content": prompt}]
    response = await client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=max_tokens, temperature=0, extra_body=EXACT
    )
    return response.choices[0].message.content, offline.chat(messages, greedy(max_tokens))[0].outputs[0].text


async def two_sampled(client, model, prompt, max_tokens, offline):
    response = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, n=2, temperature=1.0, seed=7, extra_body=EXACT
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 2 * max_tokens
    return None


async def leave_mid_stream(url, prompt, max_tokens):
    async with aiohttp.ClientSession() as session:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **EXACT}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
            events = 0
            while events < 3:
                line = await response.content.readline()
                if not line:
                    break
                events += line.startswith(b"data:")
            # leaving the block closes the connection before the stream ends
    return None


async def give_up_waiting(url, prompt, max_tokens):
    async with aiohttp.ClientSession() as session:
        body = {"prompt": prompt, "max_tokens": max_tokens, **EXACT}
        with contextlib.suppress(TimeoutError):
            await session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))
    return None


async def test_soak_under_preemption_and_disconnects_leaves_nothing_and_answers_right(
    small_pool_server, offline
):
    server, rng = small_pool_server, random.Random(11)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    preemptions_before = server.stats().preemptions
    aborts_before = server.state.metrics.finished["abort"]._value.get()

    async def one(number: int):
        await asyncio.sleep(rng.uniform(0, 0.5))
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 14)))
        max_tokens = rng.randrange(20, 60)
        kind = ["complete", "stream", "chat", "two_sampled", "leave", "complete", "give_up", "stream"][
            number % 8
        ]
        if kind == "leave":  # long enough not to end before the client leaves
            return kind, await leave_mid_stream(server.url, prompt, 150)
        if kind == "give_up":
            return kind, await give_up_waiting(server.url, prompt, 150)
        run = {"complete": complete, "stream": stream, "chat": chat, "two_sampled": two_sampled}[kind]
        return kind, await run(client, model, prompt, max_tokens, offline)

    results = await asyncio.gather(*(one(i) for i in range(48)))

    answered = [pair for kind, pair in results if pair is not None]
    assert len(answered) == 30  # complete, stream and chat: 5 of every 8
    assert all(got == expected for got, expected in answered), [p for p in answered if p[0] != p[1]]
    assert server.stats().preemptions > preemptions_before

    async def idle() -> None:
        while True:
            stats = server.stats()
            if (stats.num_running, stats.num_waiting, stats.num_blocks_used, server.state.in_flight) == (
                0,
            ) * 4:
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(idle(), timeout=30)
    # Walkaways whose whole answer was generated before the server saw them leave end as "length".
    assert server.state.metrics.finished["abort"]._value.get() > aborts_before
    assert server.state.engine.alive
    after = await client.completions.create(model=model, prompt="the cat", max_tokens=5, extra_body=EXACT)
    assert after.usage.completion_tokens == 5
    await client.close()
