"""The flow both generation endpoints share: checks, engine requests, one JSON body or an SSE stream.

The endpoint-specific part (response and chunk shapes) is a `Formatter`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from pagoda.server.api import sse
from pagoda.server.api.generation import (
    Cursor,
    Delta,
    PromptPart,
    generate_all,
    make_requests,
    prompt_part,
    usage,
)
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
            finals: dict[int, RequestOutput] = {}
            async for index, output in events:
                finals[index] = output
            ordered = [finals[i] for i in range(len(prompts))]
            choices = []
            for i, final in enumerate(ordered):
                for rank, choice in enumerate(best_choices(final.outputs, n)):
                    delta = Cursor().advance(choice, part(i, final)) or Delta("", [], [], "stop", part(i, final))
                    choices.append((i * n + rank, delta.without_output() if req.score_only else delta))
            return web.json_response(formatter.response(choices, usage(ordered, req.score_only)))
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
    # The first snapshot comes before the headers, so a request the engine refuses is still a 4xx.
    first = await anext(events)
    response = await sse.open_stream(request)
    cursors: defaultdict[int, Cursor] = defaultdict(Cursor)
    started: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    async def send(index: int, output: RequestOutput) -> None:
        finals[index] = output
        for choice in output.outputs:
            choice_index = index * n + choice.index
            cursor = cursors[choice_index]
            delta = cursor.advance(choice, None if cursor.started else part(index, output))
            if delta is None:
                continue
            for chunk in formatter.stream_chunks(choice_index, delta, choice_index not in started):
                if usage_object:
                    chunk["usage"] = None
                await sse.send_event(response, chunk)
            started.add(choice_index)

    try:
        await send(*first)
        async for index, output in events:
            await send(index, output)
        if usage_object:
            ordered = [finals[i] for i in sorted(finals)]
            await sse.send_event(
                response, {**ids.envelope(usage_object), "choices": [], "usage": usage(ordered)}
            )
        await sse.send_done(response)
    except APIError as error:
        with contextlib.suppress(ConnectionResetError):
            await sse.send_error(response, error)
            await sse.send_done(response)
    except ConnectionResetError:
        pass  # the client left; leaving the `aclosing` block aborts its engine requests
    return response
