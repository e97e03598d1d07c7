"""One `/kv/state` snapshot shared by every viewer, rebuilt at most as often as it stays cheap.

A snapshot is built on the engine's step thread (between two steps) and encoded on the event loop;
both hold the GIL the step loop needs. However many pages and `pagoda top`s watch, the snapshot is
rebuilt only when the last one is older than COST_FACTOR × what it cost to build, so viewers take
at most 1 / COST_FACTOR of the step loop's time: fresh on a small pool, every few seconds on a
pool of 100 000 blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

COST_FACTOR = 20  # snapshots take at most 5 % of the time


class SharedSnapshot:
    def __init__(self, build: Callable[[], Any]) -> None:
        """`build`: a coroutine function returning (snapshot, seconds spent on the step thread)."""
        self._build = build
        self._body: bytes | None = None
        self._built_at = 0.0
        self._cost = 0.0
        self._pending: asyncio.Future | None = None

    @property
    def min_interval(self) -> float:
        return COST_FACTOR * self._cost

    async def get(self) -> bytes:
        if self._body is not None and time.monotonic() - self._built_at < self.min_interval:
            return self._body
        if self._pending is None or self._pending.done():  # one build at a time; the rest wait for it
            self._pending = asyncio.ensure_future(self._rebuild())
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None

    async def _rebuild(self) -> bytes:
        snapshot, step_thread_seconds = await self._build()
        started = time.perf_counter()
        body = json.dumps(snapshot).encode()
        self._cost = step_thread_seconds + time.perf_counter() - started
        self._body, self._built_at = body, time.monotonic()
        return body
