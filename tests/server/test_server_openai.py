"""The official `openai` client against the real server (tiny random Llama, real engine, real HTTP)."""

from __future__ import annotations

import pytest
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
EXACT = {"ignore_eos": True}  # random weights may pick EOS early; exact lengths make usage checkable


@pytest.fixture(scope="module")
def offline(tiny_dir, tiny_engine) -> LLM:
    return LLM(str(tiny_dir), **tiny_engine)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.state.model_name] and models[0].object == "model"
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_greedy_completion_equals_offline_engine(client, offline):
    response = client.completions.create(
        model=model_name(client), prompt=PROMPT, max_tokens=12, temperature=0, extra_body=EXACT
    )
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    assert response.object == "text_completion" and response.id.startswith("cmpl-")


def test_greedy_chat_equals_offline_chat(client, offline):
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    response = client.chat.completions.create(
        model=model_name(client), messages=messages, max_completion_tokens=10, temperature=0, extra_body=EXACT
    )
    expected = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.object == "chat.completion"


def test_streaming_completion_with_usage_matches_non_streaming(client):
    kwargs = {
        "model": model_name(client),
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": EXACT,
    }
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len(chunks) >= 2
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_chat_opens_with_role_and_ends_with_usage(client):
    stream = client.chat.completions.create(
        model=model_name(client),
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content and chunks[-1].usage.completion_tokens == 8


def test_n_choices(client):
    response = client.completions.create(
        model=model_name(client), prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=5, extra_body=EXACT
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 18
    streamed = list(
        client.completions.create(
            model=model_name(client), prompt=PROMPT, max_tokens=6, n=3, stream=True, extra_body=EXACT
        )
    )
    assert {c.choices[0].index for c in streamed} == {0, 1, 2}


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        response = client.completions.create(
            model=model_name(client),
            prompt=PROMPT,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=EXACT,
        )
        return response.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_string_cuts_the_text(client):
    kwargs = {
        "model": model_name(client),
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": EXACT,
    }
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    response = client.completions.create(stop=[stop], **kwargs)
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_completion_logprobs_match_offline(client, offline):
    response = client.completions.create(
        model=model_name(client), prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, extra_body=EXACT
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    expected = offline.generate(
        PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    )
    choice = expected[0].outputs[0]
    tokenizer = offline.tokenizer
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=True) for t in choice.token_ids]
    for lp, top, token_id, entry in zip(
        logprobs.token_logprobs, logprobs.top_logprobs, choice.token_ids, choice.logprobs, strict=True
    ):
        assert lp == pytest.approx(entry[token_id], abs=1e-4) and lp <= 0.0
        assert len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: chosen = top
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=model_name(client),
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=EXACT,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode(errors="replace") == item.token


def test_usage_reports_cached_prompt_tokens(client, tiny_engine):
    # 3 full blocks of prompt: the second request finds them in the prefix cache.
    block = tiny_engine["block_size"]
    prompt = list(range(10, 10 + 3 * block + 5))
    kwargs = {"model": model_name(client), "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= 3 * block
    assert second.choices[0].text == first.choices[0].text


def test_several_prompts_in_one_request(client):
    response = client.completions.create(
        model=model_name(client), prompt=["Hello", "Once upon a time"], max_tokens=3, n=2, extra_body=EXACT
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12


def test_several_prompts_streamed(client):
    kwargs = {"model": model_name(client), "prompt": ["Hello", "Once upon a time"], "max_tokens": 4, "n": 2,
              "temperature": 0, "extra_body": EXACT}  # fmt: skip
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in full.choices}  # greedy: both n=2 choices alike per prompt
    assert reasons == dict.fromkeys(range(4), "length")
