"""Server-sent events in OpenAI's streaming format: `data: {json}` frames, `data: [DONE]` last.

Frames are not written one at a time. An engine step wakes the handler of every stream in one event
loop turn; each queues its frames on its `EventStream`, and once those handlers have run, the loop's
outbox writes every stream's frames back to back, one write per stream. A client that reads many
streams (a gateway, a benchmark) then wakes about once a step instead of once a frame, and where it
shares the host (loopback, a node's veth pair) the sender pays for each of those wake-ups: the kernel
runs the receiver's side of TCP inside the send (`benchmarks/stream_cost.py` measures it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from aiohttp import hdrs, web
from pagoda.server.protocol import APIError

logger = logging.getLogger(__name__)

# A client that reads slower than its tokens come gets nothing more queued until its socket has taken
# what is buffered: the outbox never waits for one client, and what waits for it stays bounded.
CONGESTED_BYTES = 64 * 1024
CONGESTION_POLL_S = 0.01
DONE = b"data: [DONE]\n\n"
# Made once: `json.dumps` with options builds an encoder per call, a tenth of a token's event-loop CPU.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def frame(payload: dict[str, Any]) -> bytes:
    return f"data: {_encode(payload)}\n\n".encode()


class EventStream:
    """One response's events: `send` queues a frame for the outbox, `close` ends the response."""

    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport) -> None:
        self.response = response
        self._transport = transport
        self._outbox = _outbox()
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"  # HTTP/1.0: raw
        self._queued: list[bytes] = []

    async def send(self, payload: dict[str, Any]) -> None:
        """Queue one event; waits only while the client is congested. Raises ConnectionResetError
        once the client has gone."""
        while True:
            if self._transport.is_closing():
                raise ConnectionResetError("the client closed the stream")
            if self._transport.get_write_buffer_size() <= CONGESTED_BYTES:
                break
            await asyncio.sleep(CONGESTION_POLL_S)
        if not self._queued:
            self._outbox.add(self)
        self._queued.append(frame(payload))

    def flush(self) -> None:
        """Write what is queued (the outbox calls this): one chunk, however many frames."""
        if not self._queued or self._transport.is_closing():  # a gone client: the next send raises
            self._queued.clear()
            return
        data = b"".join(self._queued)
        self._queued.clear()
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    async def close(self, error: APIError | None = None) -> None:
        """What is still queued, `error` as one more event (after the headers it can only travel so),
        then [DONE]: one write, with the end of the response."""
        if error is not None:
            self._queued.append(frame(error.body()))
        data = b"".join(self._queued) + DONE
        self._queued.clear()
        await self.response.write_eof(data)


async def open_stream(request: web.Request) -> EventStream:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("the client closed the stream")
    return EventStream(response, transport)


class _Outbox:
    """The streams of one event loop with events queued since its last flush."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._streams: list[EventStream] = []

    def add(self, stream: EventStream) -> None:
        if not self._streams:
            # Runs behind the handlers this turn has already woken: they queue first.
            self.loop.call_soon(self._flush)
        self._streams.append(stream)

    def _flush(self) -> None:
        streams, self._streams = self._streams, []
        for stream in streams:
            try:
                stream.flush()
            except Exception:  # one broken stream must not hold back the others' events
                logger.exception("writing a stream's events failed")


_this_thread = threading.local()  # an event loop runs on one thread: its outbox lives there


def _outbox() -> _Outbox:
    loop = asyncio.get_running_loop()
    outbox = getattr(_this_thread, "outbox", None)
    if outbox is None or outbox.loop is not loop:
        outbox = _this_thread.outbox = _Outbox(loop)
    return outbox
