"""Running parsed requests through the engine: engine requests, merged output streams, usage.

A request with several prompts becomes one engine request per prompt; their snapshots are merged into
one stream. Leaving the stream early (client gone, handler cancelled) cancels every engine request,
which aborts it in the engine and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from pagoda.server.engine.async_engine import EngineDeadError
from pagoda.server.engine.validation import RequestError
from pagoda.server.protocol import APIError, GenerationRequest, error_from_validation

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState
    from pagoda.server.engine.outputs import CompletionOutput, RequestOutput
    from pagoda.server.engine.sequence import Request

log = logging.getLogger(__name__)


def make_requests(
    state: ServerState, req: GenerationRequest, prompts: Sequence[str | list[int]], response_id: str
) -> list[Request]:
    """One engine request per prompt, each encoded and checked by the engine (the rules the offline
    API applies too) before any is started; a broken rule is a 400 naming the client's field."""
    engine = state.engine
    assert engine is not None
    try:
        return [
            engine.make_request(f"{response_id}-{i}", prompt, req.params, max_tokens_must_fit=req.max_tokens_given)
            for i, prompt in enumerate(prompts)
        ]
    except RequestError as exc:
        raise error_from_validation(exc, req.wire_names) from None


_DONE = object()


def engine_aborted() -> APIError:
    return APIError(
        503,
        "The engine aborted this request: its sequences no longer fit in the KV cache pool, or the "
        "server is shutting down. Retry, or lower max_tokens / n.",
        type="server_error",
        code="engine_aborted",
    )


async def generate_all(
    state: ServerState, requests: Sequence[Request]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, snapshot) from the engine requests (one per prompt), as snapshots arrive.

    Use inside `contextlib.aclosing` so the engine requests are cancelled as soon as the caller stops.
    """
    engine = state.engine
    metrics = state.metrics
    assert engine is not None and metrics is not None
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        engine_request_id = request.request_id
        tracker = metrics.request_tracker()
        try:
            async for output in engine.stream(request):
                tracker.update(output)
                if output.finished and any(c.finish_reason == "abort" for c in output.outputs):
                    # Not the client's doing (its leaving cancels this task): the engine dropped it.
                    queue.put_nowait((index, engine_aborted()))
                    return
                queue.put_nowait((index, output))
        except asyncio.CancelledError:
            tracker.finish("abort")
            await engine.abort(engine_request_id)  # the generator aborts too; this makes it certain
            raise
        except EngineDeadError:
            tracker.finish("error")
            dead = APIError(
                503, "The engine loop is not running.", type="service_unavailable", code="engine_dead"
            )
            queue.put_nowait((index, dead))
            return
        except Exception as exc:
            tracker.finish("error")
            log.exception("engine request %s failed", engine_request_id)
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, request)) for i, request in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            # Snapshots are cumulative: when the client falls behind, send only the newest per prompt.
            newest = {index: position for position, (index, item) in enumerate(batch) if _is_snapshot(item)}
            for position, (index, item) in enumerate(batch):
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, APIError):
                    raise item
                elif isinstance(item, BaseException):
                    raise APIError(500, f"Generation failed: {item}", type="internal_error") from item
                elif newest[index] == position:
                    yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_snapshot(item: Any) -> bool:
    return item is not _DONE and not isinstance(item, BaseException)


def usage(finals: Sequence[RequestOutput], score_only: bool = False) -> dict[str, Any]:
    """Every sequence the engine ran counts (best_of's discarded ones too); scoring generates nothing."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    completion_tokens = 0 if score_only else sum(len(c.token_ids) for out in finals for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in finals)},
    }


class TokenText:
    """Per-token text for logprobs, decoded once per token id (special tokens hidden, as in the text;
    a token holding part of a multi-byte character shows U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=True)
        return text


# JSON has no -Infinity/NaN (a token outside top-p/top-k has logprob -inf): clamp as vLLM does.
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares False: clamped too


def chosen_logprob(entry: dict[int, float], token_id: int) -> float | None:
    value = entry.get(token_id)
    return None if value is None else json_logprob(value)


def top_entries(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one position (the dict also holds the chosen token)."""
    ranked = sorted(entry.items(), key=lambda item: -item[1] if item[1] == item[1] else float("inf"))
    return [(token_id, json_logprob(value)) for token_id, value in ranked[:k]]


@dataclasses.dataclass
class PromptPart:
    """The prompt a completions choice repeats first (echo) and its tokens' logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # None at position 0; None overall = not asked
    ranks: list[int | None] | None


def prompt_part(text: str, output: RequestOutput) -> PromptPart:
    return PromptPart(text, list(output.prompt_token_ids), output.prompt_logprobs, output.prompt_token_ranks)


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    prompt: PromptPart | None = None  # on a choice's first delta, when the endpoint repeats the prompt

    def without_output(self) -> Delta:
        """Scoring only: the one token the engine had to run is not the client's."""
        return Delta("", [], [] if self.logprobs is not None else None, "length", self.prompt)


@dataclasses.dataclass
class Cursor:
    """How much of one choice the client has already been sent."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False
    started: bool = False  # a delta was sent

    def advance(self, choice: CompletionOutput, prompt: PromptPart | None = None) -> Delta | None:
        """What is new in this cumulative snapshot, or None when nothing is; the first delta carries
        `prompt`."""
        text = choice.text[self.chars :] if len(choice.text) > self.chars else ""
        token_ids = choice.token_ids[self.tokens :]
        logprobs = choice.logprobs[self.tokens :] if choice.logprobs is not None else None
        # "stop" or "length": a request the engine aborts never gets here, it is answered with an error.
        reason = choice.finish_reason if choice.finished and not self.finished else None
        if not text and not token_ids and reason is None:
            return None
        self.chars = max(self.chars, len(choice.text))
        self.tokens = len(choice.token_ids)
        self.finished = choice.finished
        first, self.started = not self.started, True
        return Delta(text, token_ids, logprobs, reason, prompt if first else None)
