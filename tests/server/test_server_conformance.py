"""Every body and stream chunk the server returns fits OpenAI's response shapes (tests/server/openai_schema.py):
no field OpenAI does not define, every field its spec requires (chat's `refusal: null` included)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai_schema import shape_errors

CHAT = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "ignore_eos": True}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response]
    frames = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(frame) for frame in frames[:-1]]


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "temperature": 0.9, "seed": 3}],
    ids=["plain", "logprobs", "n2"],
)
def test_chat_bodies_and_chunks_fit_openai(server, http_request, extra):
    body = {**CHAT, **extra}
    result = http_request(server.url, "POST", "/v1/chat/completions", body)
    assert result.status == 200, result.text
    response = result.json()
    assert shape_errors(ChatCompletion, response) == []
    assert all(choice["message"]["refusal"] is None for choice in response["choices"])
    chunks = stream_chunks(server.url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert shape_errors(ChatCompletionChunk, chunk, stream=True) == [], chunk
    openers = [c["choices"][0]["delta"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(openers) == body.get("n", 1) and all(d["refusal"] is None for d in openers)


@pytest.mark.parametrize(
    "extra",
    [{}, {"logprobs": 2}, {"prompt": ["a", "b"], "n": 2}, {"echo": True, "logprobs": 1},
     {"echo": True, "max_tokens": 0, "logprobs": 0}, {"best_of": 2, "logit_bias": {"5": 3}}],
    ids=["plain", "logprobs", "prompts-n", "echo", "score-only", "best_of"],
)  # fmt: skip
def test_completion_bodies_and_chunks_fit_openai(server, http_request, extra):
    body = {**COMPLETION, **extra}
    result = http_request(server.url, "POST", "/v1/completions", body)
    assert result.status == 200, result.text
    echo = body.get("echo", False)
    assert shape_errors(Completion, result.json(), echo=echo) == []
    if body.get("max_tokens") != 0 and "best_of" not in body:  # these are not streamed
        for chunk in stream_chunks(server.url, "/v1/completions", body):
            assert shape_errors(Completion, chunk, stream=True, echo=echo) == [], chunk


def test_the_check_itself_catches_a_missing_refusal_and_an_unknown_field(server, http_request):
    response = http_request(server.url, "POST", "/v1/chat/completions", CHAT).json()
    del response["choices"][0]["message"]["refusal"]
    assert any("refusal" in e for e in shape_errors(ChatCompletion, response))
    response["choices"][0]["message"]["refusal"] = None
    response["choices"][0]["surprise"] = 1
    assert any("surprise" in e for e in shape_errors(ChatCompletion, response))
