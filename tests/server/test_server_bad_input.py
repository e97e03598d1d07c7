"""Malformed requests: each gets its 4xx and OpenAI's error JSON; afterwards the server still serves
correctly and holds no KV block."""

from __future__ import annotations

import time

import pytest
from pagoda.server.api.state import ServerConfig

BODY_LIMIT = 64 * 1024
OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, method, path, body (dict -> JSON, bytes -> raw), status, error param, error code)
CASES = [
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": "x",', 400, None, "invalid_json"),
    ("body not an object", "POST", "/v1/completions", b"[1, 2]", 400, None, None),
    ("empty body", "POST", "/v1/completions", b"", 400, None, "invalid_json"),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 2}, 400, "prompt", None),
    ("prompt of wrong type", "POST", "/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("max_tokens a string", "POST", "/v1/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens", None),
    ("max_tokens a bool", "POST", "/v1/completions", {**OK, "max_tokens": True}, 400, "max_tokens", None),
    ("max_tokens negative", "POST", "/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens", None),
    ("max_tokens absurd", "POST", "/v1/completions", {**OK, "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt over the context", "POST", "/v1/completions", {"prompt": [5] * 300}, 400, "prompt",
     "context_length_exceeded"),
    ("temperature negative", "POST", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature", None),
    ("temperature a string", "POST", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", None),
    ("top_p above 1", "POST", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", None),
    ("top_k below -1", "POST", "/v1/completions", {**OK, "top_k": -5}, 400, "top_k", None),
    ("n zero", "POST", "/v1/completions", {**OK, "n": 0}, 400, "n", None),
    ("n absurd", "POST", "/v1/completions", {**OK, "n": 1000}, 400, "n", None),
    ("logprobs too many", "POST", "/v1/completions", {**OK, "logprobs": 50}, 400, "logprobs", None),
    ("stop of ints", "POST", "/v1/completions", {**OK, "stop": [1, 2]}, 400, "stop", None),
    ("presence_penalty out of range", "POST", "/v1/completions", {**OK, "presence_penalty": 5}, 400,
     "presence_penalty", None),
    ("seed a float", "POST", "/v1/completions", {**OK, "seed": 1.5}, 400, "seed", None),
    ("best_of below n", "POST", "/v1/completions", {**OK, "n": 3, "best_of": 2}, 400, "best_of", None),
    ("best_of streamed", "POST", "/v1/completions", {**OK, "best_of": 2, "stream": True}, 400, "best_of", None),
    ("echo not a bool", "POST", "/v1/completions", {**OK, "echo": "yes"}, 400, "echo", None),
    ("max_tokens 0 without echo", "POST", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", None),
    ("scoring streamed", "POST", "/v1/completions", {**OK, "max_tokens": 0, "echo": True, "stream": True}, 400,
     "max_tokens", None),
    ("prompt_logprobs too many", "POST", "/v1/completions", {**OK, "prompt_logprobs": 21}, 400,
     "prompt_logprobs", None),
    ("logit_bias above 100", "POST", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("logit_bias below -100", "POST", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": -100.5}}, 400,
     "logit_bias", None),
    ("logit_bias key not a token id", "POST", "/v1/completions", {**OK, "logit_bias": {"the": 1}}, 400,
     "logit_bias", None),
    ("logit_bias token out of vocab", "POST", "/v1/completions", {**OK, "logit_bias": {str(10**9): 1}}, 400,
     "logit_bias", None),
    ("logit_bias out of vocab, streamed", "POST", "/v1/chat/completions",
     {**CHAT, "logit_bias": {str(10**9): 1}, "stream": True}, 400, "logit_bias", None),
    ("unknown field", "POST", "/v1/completions", {**OK, "frobnicate": 1}, 400, "frobnicate", None),
    ("stream_options without stream", "POST", "/v1/completions", {**OK, "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("unknown model", "POST", "/v1/completions", {**OK, "model": "gpt-17"}, 404, "model", "model_not_found"),
    ("body over the size limit", "POST", "/v1/completions", {"prompt": "x" * (2 * BODY_LIMIT)}, 413, None,
     "request_too_large"),
    ("chat: no messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("chat: unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     400, "messages", None),
    ("chat: image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", None),
    ("chat: tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", None),
    ("chat: top_logprobs without logprobs", "POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("chat: json response_format", "POST", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("unknown path", "POST", "/v1/engines", {}, 404, None, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def small_body_server(start_server):
    return start_server(ServerConfig(max_request_body_bytes=BODY_LIMIT))


def test_malformed_requests_get_openai_errors_and_leave_nothing_behind(small_body_server, http_request):
    http = http_request
    assert len(CASES) >= 20
    server = small_body_server
    for name, method, path, body, status, param, code in CASES:
        response = http(server.url, method, path, body)
        assert response.status == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert isinstance(error["message"], str) and error["message"], name
        assert isinstance(error["type"], str) and error["type"], name
        assert error["param"] == param, (name, error)
        if code is not None:
            assert error["code"] == code, (name, error)
    # a streamed request refused before its headers is a plain 400, not an event stream
    refused = http(server.url, "POST", "/v1/completions", {**OK, "stream": True, "temperature": -1})
    assert refused.status == 400 and refused.json()["error"]["param"] == "temperature"

    # the server still answers correctly
    model = http(server.url, "GET", "/v1/models").json()["data"][0]["id"]
    ok = http(server.url, "POST", "/v1/completions", {**OK, "model": model, "ignore_eos": True})
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 2
    chat = http(server.url, "POST", "/v1/chat/completions", {**CHAT, "model": model, "ignore_eos": True})
    assert chat.status == 200 and chat.json()["usage"]["completion_tokens"] == 2
    assert http(server.url, "GET", "/health").status == 200

    # and no KV block is held, nothing runs or waits
    deadline = time.monotonic() + 5
    while (stats := server.stats()).num_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert server.state.engine.alive and server.state.in_flight == 0
