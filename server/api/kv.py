"""The live KV views of one pod: `/kv` (a static page), `/kv/state` (a JSON snapshot) and `/kv/events`
(server-sent block-manager events). Docs: docs/kv.md.

The event stream reads the engine's ring with its own cursor: a client that does not keep up stalls
only its own handler (aiohttp's write waits for the socket), and when it resumes it is told how many
events the ring overwrote meanwhile. Nothing here can slow the step loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from aiohttp import web
from pagoda.server.api.kv_snapshot_cache import SharedSnapshot
from pagoda.server.api.state import ServerState
from pagoda.server.engine.kv_events import KVEventLog
from pagoda.server.engine.kv_state import kv_snapshot
from pagoda.server.protocol import APIError

PAGE_DIR = Path(__file__).resolve().parent / "kv_page"
PAGE_FILES = {"": ("index.html", "text/html"), "kv.js": ("kv.js", "text/javascript"),
              "kv.css": ("kv.css", "text/css")}  # fmt: skip
POLL_SECONDS = 0.1  # how often a stream looks for new events
KEEPALIVE_SECONDS = 15.0
BATCH = 512  # events per read, so one client cannot hold the ring's lock for long


def _engine(state: ServerState):
    if state.engine is None:
        raise APIError(503, "The model is still loading.", type="service_unavailable", code="loading")
    return state.engine


async def page(request: web.Request) -> web.Response:
    name, content_type = PAGE_FILES[request.match_info.get("file", "")]
    return web.Response(
        body=(PAGE_DIR / name).read_bytes(), content_type=content_type, headers={"Cache-Control": "no-cache"}
    )


def _start_cursor(request: web.Request, next_seq: int) -> int:
    """`?since=N`: from event N on; `Last-Event-ID` (an EventSource reconnecting): after it; else new ones."""
    try:
        if "since" in request.query:
            return int(request.query["since"])
        if "Last-Event-ID" in request.headers:
            return int(request.headers["Last-Event-ID"]) + 1
    except ValueError:
        raise APIError(400, "since: must be an event id", param="since") from None
    return next_seq


def _timed_snapshot(engine, target: float) -> tuple[dict, float]:
    started = time.perf_counter()
    return kv_snapshot(engine, target), time.perf_counter() - started


def state_handler(state_key):
    async def kv_state(request: web.Request) -> web.Response:
        state: ServerState = request.app[state_key]
        engine = _engine(state)
        if state.kv_snapshots is None:
            target = state.config.kv_usage_target
            state.kv_snapshots = SharedSnapshot(lambda: engine.inspect(lambda e: _timed_snapshot(e, target)))
        body = await state.kv_snapshots.get()
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-cache"})

    return kv_state


def _frame(event: str, data: dict, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class _EncodedFrames:
    """Each event is encoded once, however many streams send it (a GIL-light loop for many viewers)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._frames: OrderedDict[int, bytes] = OrderedDict()

    def encode(self, event: dict) -> bytes:
        frame = self._frames.get(event["id"])
        if frame is None:
            frame = self._frames[event["id"]] = _frame("kv", event, event["id"])
            if len(self._frames) > self.capacity:
                self._frames.popitem(last=False)
        return frame


_FRAMES: weakref.WeakKeyDictionary[KVEventLog, _EncodedFrames] = weakref.WeakKeyDictionary()


def _frames_of(log: KVEventLog) -> _EncodedFrames:
    """Streams run on the server's event loop thread: no lock needed."""
    if log not in _FRAMES:
        _FRAMES[log] = _EncodedFrames(log.capacity)
    return _FRAMES[log]


def events_handler(state_key):
    async def kv_events(request: web.Request) -> web.StreamResponse:
        log = _engine(request.app[state_key]).kv_events
        frames = _frames_of(log)
        cursor = _start_cursor(request, log.next_seq)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     "X-Accel-Buffering": "no"}
        )  # fmt: skip
        await response.prepare(request)
        quiet = 0.0
        while True:
            events, dropped = log.read(cursor, BATCH)
            if dropped:
                await response.write(_frame("dropped", {"dropped": dropped, "total": log.dropped}))
            if events:
                chunk = b"".join(frames.encode(e) for e in events)
                await response.write(chunk)  # waits while the client is slow: only this stream waits
                cursor = events[-1]["id"] + 1
                quiet = 0.0
                continue
            await asyncio.sleep(POLL_SECONDS)
            quiet += POLL_SECONDS
            if quiet >= KEEPALIVE_SECONDS:
                await response.write(b": keep-alive\n\n")
                quiet = 0.0

    return kv_events


def add_routes(app: web.Application, state_key) -> None:
    app.router.add_get("/kv", page)
    app.router.add_get("/kv/{file:kv\\.(?:js|css)}", page)
    app.router.add_get("/kv/state", state_handler(state_key))
    app.router.add_get("/kv/events", events_handler(state_key))
