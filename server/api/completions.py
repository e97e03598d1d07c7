"""POST /v1/completions: OpenAI's legacy text-completion shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from pagoda.server.api.generation import Delta, TokenText, chosen_logprob, top_entries
from pagoda.server.api.serving import ResponseIds, serve_generation
from pagoda.server.protocol import parse_completion_request

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState


class CompletionFormatter:
    def __init__(self, ids: ResponseIds, token_text: TokenText, top_k: int | None) -> None:
        self._ids = ids
        self._token_text = token_text
        self._top_k = top_k
        self._offsets: dict[int, int] = {}  # chars already emitted per choice, for text_offset

    def _logprobs(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if self._top_k is None or delta.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=False):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(chosen_logprob(entry, token_id))
            top: dict[str, float] = {}
            for top_id, top_lp in top_entries(entry, self._top_k):
                top.setdefault(self._token_text(top_id), top_lp)  # tokens may share a text: keep the likelier
            tops.append(top or None)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _choice(self, index: int, delta: Delta) -> dict[str, Any]:
        return {
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(index, delta),
            "finish_reason": delta.finish_reason,
        }

    def stream_chunks(self, index: int, delta: Delta, first: bool) -> list[dict[str, Any]]:
        return [{**self._ids.envelope("text_completion"), "choices": [self._choice(index, delta)]}]

    def response(self, choices: list[tuple[int, Delta]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._ids.envelope("text_completion"),
            "choices": [self._choice(index, delta) for index, delta in sorted(choices, key=lambda c: c[0])],
            "usage": usage,
        }


async def create_completion(request: web.Request, state: ServerState, body: Any) -> web.StreamResponse:
    req = parse_completion_request(body)
    state.check_model(req.model)
    with state.admit() as engine:
        # Tokenized exactly like the engine does for text prompts (an empty one stays empty: a 400).
        prompts = [p if isinstance(p, list) else engine.tokenizer.encode(p) if p else [] for p in req.prompts]
        ids = ResponseIds("cmpl", state.model_name)
        formatter = CompletionFormatter(ids, TokenText(engine.tokenizer), req.params.logprobs)
        return await serve_generation(request, state, req, prompts, ids, formatter, "text_completion")
