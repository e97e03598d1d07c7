"""Request parsing without a server: shapes that are accepted and how they map to SamplingParams."""

from __future__ import annotations

import pytest
from pagoda.server.engine.validation import RequestError
from pagoda.server.protocol import (
    APIError,
    error_from_validation,
    parse_chat_request,
    parse_completion_request,
)


def test_completion_prompt_shapes_and_defaults():
    assert parse_completion_request({"prompt": "hi"}).prompts == ["hi"]
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    req = parse_completion_request({"prompt": "hi", "user": "bob"})
    assert req.params.max_tokens == 16 and not req.max_tokens_given and req.params.n == 1


def test_completion_maps_sampling_fields():
    req = parse_completion_request(
        {"prompt": "x", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7,
         "stop": "\n", "logprobs": 2, "n": 3, "ignore_eos": True, "presence_penalty": 0.5,
         "stream": True, "stream_options": {"include_usage": True}}
    )  # fmt: skip
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.0, 0.5, 3, 0.1, 7)
    assert (p.stop, p.logprobs, p.n, p.ignore_eos, p.presence_penalty) == (["\n"], 2, 3, True, 0.5)
    assert req.stream and req.include_usage and req.max_tokens_given


def test_chat_max_completion_tokens_and_logprobs():
    req = parse_chat_request(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                      {"role": "user", "content": "b"}],
         "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3}
    )  # fmt: skip
    assert [(m.role, m.content) for m in req.messages] == [("system", "a"), ("user", "b")]
    assert req.params.max_tokens == 9 and req.params.logprobs == 3 and req.top_logprobs == 3
    plain = parse_chat_request({"messages": [{"role": "user", "content": "b"}]})
    assert plain.params.max_tokens is None and plain.params.logprobs is None and plain.top_logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # bool is not an int
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "stop": ["ok", ""]}, "stop"),
        ({"prompt": "x", "foo": 1}, "foo"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
    ],
)
def test_completion_errors_name_the_parameter(body, param):
    with pytest.raises(APIError) as info:
        parse_completion_request(body)
    assert info.value.status == 400 and info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_engine_rule_error_becomes_param_and_code():
    error = error_from_validation(RequestError("top_k", "must be -1 (off), 0 (off) or a positive integer"))
    assert error.param == "top_k" and error.status == 400 and error.message.startswith("top_k: ")
    long = error_from_validation(RequestError("prompt", "too long", "context_length_exceeded"))
    assert long.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": 2.5}, "temperature"),
    ],
)
def test_chat_errors_name_the_field_the_client_sent(body, param):
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "b"}], **body})
    assert info.value.param == param and info.value.message.startswith(f"{param}: ")
