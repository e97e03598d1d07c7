"""Running parsed requests through the engine: engine requests, merged output streams, usage.

A request with several prompts becomes one engine request per prompt; their outputs (deltas: what is
new each step) are merged into one stream, in the order they come. Leaving the stream early (client
gone, handler cancelled) cancels every engine request, which aborts it in the engine and frees its KV
blocks at once.
"""

from __future__ import annotations

import contextlib
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
    """Yield (prompt index, delta) from the engine requests (one per prompt), as they arrive.

    Use inside `contextlib.aclosing` so the engine requests are cancelled as soon as the caller stops.
    """
    engine = state.engine
    metrics = state.metrics
    assert engine is not None and metrics is not None
    trackers = [metrics.request_tracker() for _ in requests]
    unfinished = "abort"  # how the requests still running when this ends count: the client left
    try:
        async with contextlib.aclosing(engine.stream_all(requests)) as outputs:
            async for index, output in outputs:
                trackers[index].update(output)
                if output.finished and any(c.finish_reason == "abort" for c in output.outputs):
                    raise engine_aborted()  # not the client's doing (its leaving closes this generator)
                yield index, output
    except EngineDeadError:
        unfinished = "error"
        dead = APIError(503, "The engine loop is not running.", type="service_unavailable", code="engine_dead")
        raise dead from None
    except APIError:
        raise
    except Exception as exc:
        unfinished = "error"
        log.exception("engine requests %s failed", [r.request_id for r in requests])
        raise APIError(500, f"Generation failed: {exc}", type="internal_error") from exc
    finally:
        for tracker in trackers:
            tracker.finish(unfinished)  # once per request: a finished one is already counted


def usage(outputs: Sequence[RequestOutput], completion_tokens: int) -> dict[str, Any]:
    """`outputs`: one per prompt (any of its outputs: prompt and cached counts do not change);
    `completion_tokens`: every sequence the engine ran counts (best_of's discarded ones too)."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outputs)},
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
    """What one response chunk (or, whole, one non-streamed choice) says about a choice."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    prompt: PromptPart | None = None  # on a choice's first delta, when the endpoint repeats the prompt

    @classmethod
    def of(cls, choice: CompletionOutput, prompt: PromptPart | None, finish_reason: str | None) -> Delta:
        return cls(choice.text, choice.token_ids, choice.logprobs, finish_reason, prompt)

    def without_output(self) -> Delta:
        """Scoring only: the one token the engine had to run is not the client's."""
        return Delta("", [], [] if self.logprobs is not None else None, "length", self.prompt)
