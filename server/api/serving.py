"""The flow both generation endpoints share: checks, engine requests, one JSON body or an SSE stream.

The endpoint-specific part (response and chunk shapes) is a `Formatter`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from pagoda.server.api import sse
from pagoda.server.api.generation import (
    Delta,
    PromptPart,
    generate_all,
    make_requests,
    prompt_part,
    usage,
)
from pagoda.server.engine.outputs import OutputCollector
from pagoda.server.protocol import APIError, GenerationRequest

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState
    from pagoda.server.engine.outputs import CompletionOutput, RequestOutput
    from pagoda.server.engine.sequence import Request


class Formatter(Protocol):
    def stream_chunks(self, index: int, delta: Delta, first: bool) -> list[dict[str, Any]]: ...

    def response(self, choices: list[tuple[int, Delta]], usage: dict[str, Any]) -> dict[str, Any]: ...


class ResponseIds:
    """id / created / model: the same on the body and on every chunk of one response."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


async def serve_generation(
    request: web.Request,
    state: ServerState,
    req: GenerationRequest,
    prompts: list[str | list[int]],
    ids: ResponseIds,
    formatter: Formatter,
    usage_object: str,
    repeat_prompt: bool = False,
) -> web.StreamResponse:
    """`prompts`: text or token ids, encoded by the engine. `repeat_prompt`: each choice's first delta
    carries its prompt (text, tokens, their logprobs)."""
    requests = make_requests(state, req, prompts, ids.id)
    prompt_texts = [prompt_text(state, r) for r in requests] if repeat_prompt else None
    n = req.n

    def part(index: int, output: RequestOutput) -> PromptPart | None:
        return prompt_part(prompt_texts[index], output) if prompt_texts is not None else None

    events = generate_all(state, requests)
    async with contextlib.aclosing(events):
        if not req.stream:
            collected = OutputCollector()  # one body: the deltas joined
            async for _, output in events:
                collected.add([output])
            finals = [collected[r.request_id] for r in requests]
            choices = []
            for i, final in enumerate(finals):
                for rank, choice in enumerate(best_choices(final.outputs, n)):
                    delta = Delta.of(choice, part(i, final), choice.finish_reason)
                    choices.append((i * n + rank, delta.without_output() if req.score_only else delta))
            generated = 0 if req.score_only else sum(len(c.token_ids) for f in finals for c in f.outputs)
            return web.json_response(formatter.response(choices, usage(finals, generated)))
        return await _stream(request, events, n, formatter, ids, usage_object if req.include_usage else None, part)


def prompt_text(state: ServerState, request: Request) -> str:
    """The prompt as text: as sent, or its token ids decoded (special tokens hidden, as in outputs)."""
    if request.prompt is not None:
        return request.prompt
    assert state.engine is not None
    return state.engine.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)


def best_choices(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of > n: the n with the highest cumulative logprob; otherwise all, in order."""
    if len(outputs) <= n:
        return sorted(outputs, key=lambda c: c.index)
    return sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]


async def _stream(
    request: web.Request,
    events: Any,
    n: int,
    formatter: Formatter,
    ids: ResponseIds,
    usage_object: str | None,
    part: Callable[[int, RequestOutput], PromptPart | None],
) -> web.StreamResponse:
    # The first output comes before the headers, so a request the engine refuses is still a 4xx.
    first = await anext(events)
    stream = await sse.open_stream(request)
    parts: dict[int, PromptPart | None] = {}  # per prompt, from its first output (prompt logprobs)
    started: set[int] = set()  # choices a chunk was sent for
    ended: set[int] = set()  # choices whose finish_reason was sent
    last: dict[int, RequestOutput] = {}  # per prompt, for the usage
    generated = 0

    async def send(index: int, output: RequestOutput) -> None:
        nonlocal generated
        if index not in parts:
            parts[index] = part(index, output)
        last[index] = output
        for choice in output.outputs:  # each holds what is new: sent as it is
            choice_index = index * n + choice.index
            generated += len(choice.token_ids)
            reason = choice.finish_reason if choice_index not in ended else None
            if not choice.text and not choice.token_ids and reason is None:
                continue
            if reason is not None:
                ended.add(choice_index)
            first_chunk = choice_index not in started
            delta = Delta.of(choice, parts[index] if first_chunk else None, reason)
            for chunk in formatter.stream_chunks(choice_index, delta, first_chunk):
                if usage_object:
                    chunk["usage"] = None
                await stream.send(chunk)
            started.add(choice_index)

    try:
        await send(*first)
        async for index, output in events:
            await send(index, output)
        if usage_object:
            outputs = [last[i] for i in sorted(last)]
            await stream.send({**ids.envelope(usage_object), "choices": [], "usage": usage(outputs, generated)})
        await stream.close()
    except APIError as error:
        with contextlib.suppress(ConnectionResetError):
            await stream.close(error)
    except ConnectionResetError:
        pass  # the client left; leaving the `aclosing` block aborts its engine requests
    return stream.response
