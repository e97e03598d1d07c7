"""Server-sent events in OpenAI's streaming format: `data: {json}` frames, `data: [DONE]` last."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pagoda.server.protocol import APIError


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


async def send_error(response: web.StreamResponse, error: APIError) -> None:
    """After the headers went out, an error can only travel as one more event."""
    await send_event(response, error.body())


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
