"""OpenAI's response shapes as strict JSON schemas, for checking what the server returns.

The schemas come from the `openai` SDK's own models (`model_json_schema()`), tightened two ways the SDK
leaves loose on purpose (it must accept future fields): unknown fields are errors, so every field we
return exists in OpenAI's shape; and the fields OpenAI's published API spec marks required (the SDK
marks only some) must be present, `null` being fine where the type allows it.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

# Required in OpenAI's API spec (CreateCompletionResponse, CreateChatCompletionResponse,
# CreateChatCompletionStreamResponse), per definition name in the SDK's schema.
SPEC_REQUIRED = {
    Completion: {"CompletionChoice": ["finish_reason", "index", "logprobs", "text"]},
    ChatCompletion: {
        "Choice": ["finish_reason", "index", "message", "logprobs"],
        "ChatCompletionMessage": ["content", "refusal", "role"],
        "ChoiceLogprobs": ["content", "refusal"],
        "ChatCompletionTokenLogprob": ["token", "logprob", "bytes", "top_logprobs"],
        "TopLogprob": ["token", "logprob", "bytes"],
    },
    ChatCompletionChunk: {
        "Choice": ["delta", "finish_reason", "index"],
        "ChatCompletionTokenLogprob": ["token", "logprob", "bytes", "top_logprobs"],
        "TopLogprob": ["token", "logprob", "bytes"],
    },
}


def _closed(node: Any) -> Any:
    """Every object schema refuses properties it does not list."""
    if isinstance(node, dict):
        node = {k: _closed(v) for k, v in node.items()}
        if node.get("type") == "object" and "properties" in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def _nullable_items(node: dict[str, Any]) -> None:
    for option in node["anyOf"]:
        if option.get("type") == "array":
            option["items"] = {"anyOf": [option["items"], {"type": "null"}]}


def strict_schema(model: type, stream: bool = False, echo: bool = False) -> dict[str, Any]:
    schema = _closed(copy.deepcopy(model.model_json_schema()))
    for name, required in SPEC_REQUIRED[model].items():
        definition = schema["$defs"][name]
        definition["required"] = sorted(set(definition.get("required", [])) | set(required))
    if stream and model is Completion:
        # Streamed legacy completions reuse the Completion shape, with finish_reason null until the
        # last chunk of a choice (as OpenAI's own streams send it).
        reason = schema["$defs"]["CompletionChoice"]["properties"]["finish_reason"]
        schema["$defs"]["CompletionChoice"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    if echo and model is Completion:
        # With echo the first prompt token has no logprob: OpenAI's legacy API (and vLLM) send null
        # there, which the SDK's types do not spell out (its client parses responses leniently).
        logprobs = schema["$defs"]["Logprobs"]["properties"]
        _nullable_items(logprobs["token_logprobs"])
        _nullable_items(logprobs["top_logprobs"])
    return schema


def shape_errors(model: type, body: dict[str, Any], stream: bool = False, echo: bool = False) -> list[str]:
    """Where `body` leaves OpenAI's shape (empty: it conforms); the SDK's model must parse it too
    (except for the nulls the SDK's types leave out, see `strict_schema`)."""
    validator = jsonschema.Draft202012Validator(strict_schema(model, stream, echo))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
    if not errors and not ((stream or echo) and model is Completion):
        model.model_validate(body)  # raises on anything the pydantic model refuses
    return errors
