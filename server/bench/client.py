"""One streamed request against an OpenAI-compatible server, timed event by event."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.server.bench.dataset import BenchRequest
from pagoda.server.bench.http import Connection, Pool, ProtocolError, ResponseParser


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0  # seconds to the first chunk with text
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between chunks with text


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return f"{base}/chat/completions" if self.endpoint == "chat" else f"{base}/completions"

    def body(self, request: BenchRequest) -> dict[str, Any]:
        common = {
            "model": self.model,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # exact output lengths (vLLM and pagoda extension; others may refuse it)
            common["ignore_eos"] = True
        if self.endpoint == "chat":
            messages = [{"role": "user", "content": request.prompt_text}]
            return {**common, "messages": messages, "max_completion_tokens": request.output_len}
        return {**common, "prompt": request.prompt, "max_tokens": request.output_len}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


class _Stream:
    """A streamed response's body, line by line as it arrives: each `data:` event timed and counted
    into `result` (the rest of a non-200 response's body kept for its error)."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result, self.start, self.last = result, start, start
        self.chunks_with_text = 0
        self.error_body = b""
        self._partial = b""

    def body(self, status: int, piece: bytes) -> None:
        if status != 200:
            self.error_body = (self.error_body + piece)[:2000]
            return
        lines = (self._partial + piece).split(b"\n")
        self._partial = lines.pop()
        now = time.perf_counter()  # one read's events arrived together
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:") and not self.result.error:
                self._event(line[5:].strip(), now)

    def _event(self, data: bytes, now: float) -> None:
        result = self.result
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if _chunk_text(chunk):
            if self.chunks_with_text == 0:
                result.ttft = now - self.start
            else:
                result.itl.append(now - self.last)
            self.chunks_with_text += 1
            self.last = now
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"].get("completion_tokens", 0)


async def send_request(
    pool: Pool, target: Target, request: BenchRequest, t0: float, timeout: float
) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    start = time.perf_counter()
    result.start = start - t0
    stream = _Stream(result, start)
    payload = pool.post(json.dumps(target.body(request)).encode(), target.headers())
    connection: Connection | None = None

    async def exchange() -> ResponseParser:
        nonlocal connection
        connection = await pool.acquire()
        return await connection.exchange(payload, stream.body)

    try:
        response = await asyncio.wait_for(exchange(), timeout)  # connecting included
        pool.release(connection, response.keep_alive)
        connection = None
        if response.status != 200:
            result.error = f"HTTP {response.status}: {stream.error_body.decode(errors='replace')[:200]}"
            return result
        if result.error:
            return result
        result.latency = time.perf_counter() - start
        if not result.output_tokens:  # server without usage in streams: one token per chunk
            result.output_tokens = stream.chunks_with_text
        result.success = True
    except (OSError, ProtocolError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if connection is not None:
            pool.release(connection, reusable=False)
    return result
