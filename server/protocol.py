"""OpenAI request parsing and error bodies: JSON in, typed requests (or an `APIError`) out.

This module reads shapes and types (an int, a list of strings, OpenAI's four prompt shapes) and the
rules of the HTTP API itself (echo with max_tokens 0, stream_options only with stream, ...). The
bounds on values are the engine's (`engine/validation.py`, the same for the offline API): the
`SamplingParams` built here are checked there, and a `RequestError` becomes a 400 naming the field
as the client spelt it. Unknown top-level fields are refused (like OpenAI does) except a few harmless
ones that only carry client bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.validation import RequestError, check_choices, check_logprobs, is_int, is_number

# Fields OpenAI clients may send that change nothing about generation.
_IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_from_validation(exc: RequestError, wire_names: dict[str, str] | None = None) -> APIError:
    """A broken engine rule as a 400; `wire_names`: SamplingParams field -> the request's field name."""
    param = (wire_names or {}).get(exc.param, exc.param)
    return bad_request(f"{param}: {exc.message}", param=param, code=exc.code)


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class GenerationRequest:
    """What the completions and chat endpoints share once validated."""

    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    # False: max_tokens is the endpoint's default (16 for completions, none for chat), which the
    # server shrinks to what fits in the context; an explicit value that does not fit is a 400.
    max_tokens_given: bool = False
    # Choices returned per prompt. With best_of > n the engine runs params.n = best_of sequences and
    # the server keeps the n with the highest cumulative logprob (never streamed).
    n: int = 1
    # max_tokens 0 with echo: only the prompt is scored. The engine runs one token, which is dropped.
    score_only: bool = False
    # SamplingParams field -> the name this request gave it (chat: max_completion_tokens, top_logprobs)
    wire_names: dict[str, str] = field(default_factory=dict)


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False  # prompt text (and, with logprobs, prompt-token logprobs) before each choice
    prompt_logprobs: int | None = None  # vLLM's extension: `prompt_logprobs` on each choice


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = field(default_factory=list)
    top_logprobs: int | None = None  # None = logprobs off


# ---------------------------------------------------------------------------------------------------
# Typed field readers: each raises a 400 naming the parameter.


def _int(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise bad_request(f"{name}: must be an integer, got {value!r}", param=name)
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise bad_request(f"{name}: must be a finite number, got {value!r}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: must be a boolean, got {value!r}", param=name)
    return value


def _stop(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop: must be a string or a list of strings", param="stop")
    return stops or None


def _stop_token_ids(body: dict) -> list[int] | None:
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise bad_request("stop_token_ids: must be a list of integers", param="stop_token_ids")
    return value


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id": bias}: JSON keys are strings of token ids, biases numbers."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise bad_request("logit_bias: must be an object of token ids", param="logit_bias")
    bias = {}
    for key, number in value.items():
        token = key if is_int(key) else int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        if not is_number(number):
            raise bad_request(f"logit_bias: values must be numbers, got {number!r} for token {key}",
                              param="logit_bias")  # fmt: skip
        bias[token] = float(number)
    return bias


def _check_fields(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known and name not in _IGNORED_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)


def _refuse_unsupported(body: dict, name: str, supported: Any = None, why: str = "is not supported") -> None:
    value = body.get(name)
    if value is not None and value != supported and value not in ({}, []):
        raise bad_request(f"{name}: {why}", param=name)


def _common(body: dict, default_max_tokens: int | None) -> tuple[dict, int, bool, bool]:
    """Read the sampling fields both endpoints share: (SamplingParams kwargs, n, stream, include_usage).

    kwargs["n"] is what the engine runs: best_of when given (the server keeps the best n)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model: must be a string, got {model!r}", param="model")
    n = _int(body, "n", 1)
    best_of = _int(body, "best_of", None)
    check_choices(n, best_of)  # best_of here: sampled, of which the server keeps the n best
    kwargs = dict(
        n=best_of or n,
        max_tokens=_int(body, "max_tokens", default_max_tokens),
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int(body, "top_k", -1),
        min_p=_float(body, "min_p", 0.0),
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        logit_bias=_logit_bias(body),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options: must be an object", param="stream_options")
        if not stream:
            raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"stream_options: unknown field {sorted(unknown)[0]}", param="stream_options")
        include_usage = _bool(options, "include_usage", False)
    if stream and kwargs["n"] > n:
        raise bad_request("best_of: cannot be used with stream (the best are known only at the end)",
                          param="best_of")  # fmt: skip
    return kwargs, n, stream, include_usage


_SAMPLING_FIELDS = {
    "model", "n", "best_of", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "include_stop_str_in_output", "stream", "stream_options", "logit_bias",
}  # fmt: skip


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: str, [str], [int] (token ids), [[int]]."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise bad_request(
        "prompt: must be a non-empty string, list of strings, list of token ids or list of token-id lists",
        param="prompt",
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    try:
        return _parse_completion(body)
    except RequestError as exc:
        raise error_from_validation(exc) from None


def _parse_completion(body: Any) -> CompletionRequest:
    body = _require_object(body)
    _check_fields(body, _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "prompt_logprobs"})
    if "prompt" not in body:
        raise bad_request("prompt: is required", param="prompt")
    prompts = _prompts(body["prompt"])
    _refuse_unsupported(body, "suffix", why="is not supported (no insertion models)")
    echo = _bool(body, "echo", False)
    kwargs, n, stream, include_usage = _common(body, default_max_tokens=16)
    score_only = kwargs["max_tokens"] == 0
    if score_only and not echo:
        raise bad_request("max_tokens: 0 is only allowed with echo (scoring the prompt)", param="max_tokens")
    if score_only and stream:
        raise bad_request("max_tokens: 0 (scoring the prompt) cannot be streamed", param="max_tokens")
    logprobs = kwargs["logprobs"] = _int(body, "logprobs", None)
    prompt_logprobs = _int(body, "prompt_logprobs", None)
    # The engine scores prompt tokens for echo with logprobs and for vLLM's prompt_logprobs: the wider
    # wins (each is checked on its own first, so an error names the one the client got wrong).
    check_logprobs("logprobs", logprobs)
    check_logprobs("prompt_logprobs", prompt_logprobs)
    wanted = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    kwargs["prompt_logprobs"] = max(wanted) if wanted else None
    if score_only:
        kwargs["max_tokens"] = 1
    params = SamplingParams(**kwargs)
    params.validate()
    return CompletionRequest(
        model=body.get("model"),
        params=params,
        stream=stream,
        include_usage=include_usage,
        max_tokens_given=body.get("max_tokens") is not None,
        n=n,
        prompts=prompts,
        echo=echo,
        score_only=score_only,
        prompt_logprobs=prompt_logprobs,
    )


_ROLES = {"system", "developer", "user", "assistant"}


def _message(index: int, value: Any) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(value, dict):
        raise bad_request(f"{where}: must be an object", param="messages")
    role = value.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role: must be one of {sorted(_ROLES)}, got {role!r}", param="messages")
    content = value.get("content")
    if isinstance(content, list):  # content parts: only text is understood by a text-only model
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(f"{where}.content: only text parts are supported", param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"{where}.content: must be a string or a list of text parts", param="messages")
    if value.get("tool_calls") or role == "tool":
        raise bad_request(f"{where}: tool calls are not supported", param="messages")
    return ChatMessage(role="system" if role == "developer" else role, content=content)


def parse_chat_request(body: Any) -> ChatRequest:
    body = _require_object(body)
    wire_names = {"max_tokens": _max_tokens_name(body), "logprobs": "top_logprobs"}
    try:
        return _parse_chat(body, wire_names)
    except RequestError as exc:
        raise error_from_validation(exc, wire_names) from None


def _max_tokens_name(body: dict) -> str:
    """max_completion_tokens is the new name of max_tokens; either may come."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _parse_chat(body: dict, wire_names: dict[str, str]) -> ChatRequest:
    _check_fields(
        body,
        _SAMPLING_FIELDS
        | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools",
           "tool_choice", "functions", "function_call"},
    )  # fmt: skip
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list", param="messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    for name in ("tools", "functions"):
        _refuse_unsupported(body, name, why="tool calling is not supported")
    for name in ("tool_choice", "function_call"):
        _refuse_unsupported(body, name, supported="none", why="tool calling is not supported")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad_request("response_format: only {'type': 'text'} is supported", param="response_format")
    limit = _int(body, wire_names["max_tokens"], None)
    kwargs, n, stream, include_usage = _common({**body, "max_tokens": None}, default_max_tokens=None)
    kwargs["max_tokens"] = limit
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", None)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    if logprobs:
        top_logprobs = top_logprobs or 0
        kwargs["logprobs"] = top_logprobs
    params = SamplingParams(**kwargs)
    params.validate()
    return ChatRequest(
        model=body.get("model"),
        params=params,
        stream=stream,
        include_usage=include_usage,
        max_tokens_given=limit is not None,
        n=n,
        messages=parsed,
        top_logprobs=top_logprobs,
        wire_names=wire_names,
    )
