"""Load for the fault scenarios: closed-loop clients of the official OpenAI client, one record per request.

Every request streams a completion of a fixed length (`ignore_eos`), so "succeeded" means every
token arrived and the stream ended with usage; anything else is a failure with where and how it
ended: the backend that served it (the front's `x-pagoda-backend` header, or the server itself),
the HTTP status or the error the client raised, and when. The client never retries
(`max_retries=0`): a fault must show, not be hidden by a retry.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import openai

from e2e.front import BACKEND_HEADER


@dataclass
class RequestRecord:
    client: int
    start: float  # seconds on the scenario's clock
    end: float = 0.0
    ok: bool = False
    backend: str | None = None
    status: int | None = None  # the HTTP status when the server refused or failed it
    code: str | None = None  # the error body's `code` (e.g. draining, engine_dead)
    error: str | None = None
    tokens: int = 0
    ttft: float | None = None

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "start": round(self.start, 3), "end": round(self.end, 3)}


class Load:
    def __init__(self, base_url: str, model: str, clock: Any, *, prompt_words: int = 40, max_tokens: int = 32,
                 timeout_s: float = 60.0) -> None:
        """`clock()` returns the scenario's time in seconds (records use it)."""
        self.client = openai.AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="none", max_retries=0,
                                         timeout=timeout_s)
        self.default_backend = base_url
        self.model = model
        self.clock = clock
        self.prompt = "hello " * prompt_words
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []

    async def one(self, client: int) -> RequestRecord:
        record = RequestRecord(client, self.clock())
        self.records.append(record)
        started = time.monotonic()
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=self.prompt, max_tokens=self.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            record.backend = stream.response.headers.get(BACKEND_HEADER, self.default_backend)
            usage = None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    if record.ttft is None:
                        record.ttft = time.monotonic() - started
                    record.tokens += 1  # so far: a fault scenario picks a stream with most of it to come
                if chunk.usage is not None:
                    usage = chunk.usage
            if usage is not None:  # else the count of chunks with text stands
                record.tokens = usage.completion_tokens
            record.ok = usage is not None and usage.completion_tokens == self.max_tokens
            if not record.ok:
                record.error = f"stream ended after {record.tokens} of {self.max_tokens} tokens"
        except openai.APIStatusError as exc:
            record.backend = exc.response.headers.get(BACKEND_HEADER, self.default_backend)
            record.status, record.code = exc.status_code, _code(exc.body)
            record.error = f"HTTP {exc.status_code}: {exc.message}"[:300]
        except openai.APIError as exc:  # connection lost, timeout, or an error event inside the stream
            record.code = _code(exc.body)
            record.error = f"{type(exc).__name__}: {exc.message}"[:300]
        except Exception as exc:  # the transport broke mid-stream (httpx raises its own errors there)
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.end = self.clock()
        return record

    async def closed_loop(self, clients: int, stop: asyncio.Event, think_s: float = 0.0) -> None:
        """`clients` users, each sending its next request a random 0..think_s after the last one
        ended, until `stop`. Without think time, users whose requests share a batch finish together
        and come back together, so the servers are idle for an instant in step: real users are not."""

        async def user(client: int) -> None:
            rng = random.Random(client)
            while not stop.is_set():
                await self.one(client)
                if think_s:
                    await asyncio.sleep(rng.uniform(0.0, think_s))

        await asyncio.gather(*(user(c) for c in range(clients)))

    async def burst(self, count: int) -> list[RequestRecord]:
        return list(await asyncio.gather(*(self.one(c) for c in range(count))))

    async def close(self) -> None:
        await self.client.close()


def _code(body: object) -> str | None:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("code") is not None:
            return str(inner["code"])
    return None


def outcome(records: Sequence[RequestRecord], lo: float = float("-inf"), hi: float = float("inf")) -> dict[str, Any]:
    """sent / succeeded / failed of the requests started in [lo, hi), failures by backend and kind."""
    chosen = [r for r in records if lo <= r.start < hi]
    failed = [r for r in chosen if not r.ok]
    by_backend: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    for r in failed:
        by_backend[r.backend or "none"] = by_backend.get(r.backend or "none", 0) + 1
        kind = r.code or (f"HTTP {r.status}" if r.status else (r.error or "?").split(":")[0])
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return {"sent": len(chosen), "succeeded": len(chosen) - len(failed), "failed": len(failed),
            "failed_by_backend": by_backend, "failed_by_kind": by_kind,
            "longest_failed_s": round(max((r.end - r.start for r in failed), default=0.0), 2)}
