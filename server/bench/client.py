"""One streamed request against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pagoda.server.bench.dataset import BenchRequest


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


async def send_request(
    session: aiohttp.ClientSession, target: Target, request: BenchRequest, t0: float
) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    chunks_with_text = 0
    try:
        async with session.post(target.url, json=target.body(request), headers=target.headers()) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks_with_text += 1
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
        result.latency = time.perf_counter() - start
        if not result.output_tokens:  # server without usage in streams: one token per chunk
            result.output_tokens = chunks_with_text
        result.success = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
