"""The flow both generation endpoints share: checks, engine requests, one JSON body or an SSE stream.

The endpoint-specific part (response and chunk shapes) is a `Formatter`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from pagoda.server.api import sse
from pagoda.server.api.generation import Cursor, Delta, check_prompt, generate_all, usage, validate_params
from pagoda.server.protocol import APIError, GenerationRequest

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState
    from pagoda.server.engine.outputs import RequestOutput


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
    prompts: list[list[int]],
    ids: ResponseIds,
    formatter: Formatter,
    usage_object: str,
) -> web.StreamResponse:
    params = [check_prompt(state, prompt, req.params, req.max_tokens_given) for prompt in prompts]
    for prompt_params in params:
        validate_params(prompt_params)
    n = req.params.n
    events = generate_all(state, prompts, params, ids.id)
    async with contextlib.aclosing(events):
        if not req.stream:
            finals: dict[int, RequestOutput] = {}
            async for index, output in events:
                finals[index] = output
            ordered = [finals[i] for i in range(len(prompts))]
            choices = [
                (i * n + choice.index, Cursor().advance(choice) or Delta("", [], [], "stop"))
                for i, final in enumerate(ordered)
                for choice in final.outputs
            ]
            return web.json_response(formatter.response(choices, usage(ordered)))
        return await _stream(request, events, n, formatter, ids, usage_object if req.include_usage else None)


async def _stream(
    request: web.Request,
    events: Any,
    n: int,
    formatter: Formatter,
    ids: ResponseIds,
    usage_object: str | None,
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
            delta = cursors[choice_index].advance(choice)
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
