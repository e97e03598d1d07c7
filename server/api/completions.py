"""POST /v1/completions: OpenAI's legacy text-completion shapes, with echo and vLLM's prompt_logprobs.

With `echo` each choice starts with its prompt: the text, and with `logprobs` the prompt tokens'
logprobs (the first token's is null) ahead of the generated ones, as OpenAI's legacy API and vLLM
return them; `max_tokens: 0` with echo scores the prompt only (what evaluation harnesses send).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from pagoda.server.api.generation import Delta, TokenText, chosen_logprob, json_logprob, top_entries
from pagoda.server.api.serving import ResponseIds, serve_generation
from pagoda.server.protocol import CompletionRequest, parse_completion_request

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState


class CompletionFormatter:
    def __init__(self, ids: ResponseIds, token_text: TokenText, req: CompletionRequest) -> None:
        self._ids = ids
        self._token_text = token_text
        self._top_k = req.params.logprobs
        self._echo = req.echo
        self._prompt_logprobs = req.prompt_logprobs
        self._offsets: dict[int, int] = {}  # chars already emitted per choice, for text_offset

    def _logprobs(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if self._top_k is None or delta.logprobs is None:
            return None
        pairs = list(zip(delta.token_ids, delta.logprobs, strict=False))
        if self._echo and delta.prompt is not None:
            pairs = list(zip(delta.prompt.token_ids, delta.prompt.logprobs or [], strict=True)) + pairs
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for token_id, entry in pairs:
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(chosen_logprob(entry, token_id) if entry is not None else None)
            top: dict[str, float] = {}
            for top_id, top_lp in top_entries(entry or {}, self._top_k):
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

    def _vllm_prompt_logprobs(self, delta: Delta) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's shape: per prompt token null (the first) or {"<token id>": {logprob, rank, decoded_token}}."""
        assert self._prompt_logprobs is not None and delta.prompt is not None
        part = delta.prompt
        out: list[dict[str, dict[str, Any]] | None] = []
        for token_id, entry, rank in zip(part.token_ids, part.logprobs or [], part.ranks or [], strict=True):
            if entry is None:
                out.append(None)
                continue
            ranked = top_entries(entry, self._prompt_logprobs)
            position: dict[str, dict[str, Any]] = {
                str(t): {"logprob": lp, "rank": i + 1, "decoded_token": self._token_text(t)}
                for i, (t, lp) in enumerate(ranked)
            }
            position[str(token_id)] = {"logprob": json_logprob(entry[token_id]), "rank": rank,
                                       "decoded_token": self._token_text(token_id)}  # fmt: skip
            out.append(position)
        return out

    def _choice(self, index: int, delta: Delta) -> dict[str, Any]:
        text = delta.prompt.text + delta.text if self._echo and delta.prompt is not None else delta.text
        choice = {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(index, delta),
            "finish_reason": delta.finish_reason,
        }
        if self._prompt_logprobs is not None and delta.prompt is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(delta)
        return choice

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
        ids = ResponseIds("cmpl", state.model_name)
        formatter = CompletionFormatter(ids, TokenText(engine.tokenizer), req)
        repeat_prompt = req.echo or req.prompt_logprobs is not None
        return await serve_generation(
            request, state, req, list(req.prompts), ids, formatter, "text_completion", repeat_prompt
        )
