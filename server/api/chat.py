"""POST /v1/chat/completions: messages through the model's chat template, OpenAI's chat shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from pagoda.server.api.generation import Delta, TokenText, chosen_logprob, top_entries
from pagoda.server.api.serving import ResponseIds, serve_generation
from pagoda.server.protocol import bad_request, parse_chat_request

if TYPE_CHECKING:
    from pagoda.server.api.state import ServerState


class ChatFormatter:
    def __init__(self, ids: ResponseIds, token_text: TokenText, top_logprobs: int | None) -> None:
        self._ids = ids
        self._token_text = token_text
        self._top_logprobs = top_logprobs

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if self._top_logprobs is None or delta.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=False):
            item = self._entry(token_id, chosen_logprob(entry, token_id))
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in top_entries(entry, self._top_logprobs)]
            content.append(item)
        return {"content": content, "refusal": None}

    def stream_chunks(self, index: int, delta: Delta, first: bool) -> list[dict[str, Any]]:
        chunks = []
        envelope = self._ids.envelope("chat.completion.chunk")
        if first:  # OpenAI opens every choice with the role
            role = {"role": "assistant", "content": "", "refusal": None}
            chunks.append({**envelope, "choices": [{"index": index, "delta": role, "logprobs": None,
                                                    "finish_reason": None}]})  # fmt: skip
        if delta.text or delta.token_ids or delta.finish_reason:
            content = {"content": delta.text} if delta.text else {}
            choice = {"index": index, "delta": content, "logprobs": self._logprobs(delta),
                      "finish_reason": delta.finish_reason}  # fmt: skip
            chunks.append({**envelope, "choices": [choice]})
        return chunks

    def response(self, choices: list[tuple[int, Delta]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._ids.envelope("chat.completion"),
            "choices": [
                {
                    "index": index,
                    # OpenAI's schema requires `refusal`; this model never refuses by itself.
                    "message": {"role": "assistant", "content": delta.text, "refusal": None},
                    "logprobs": self._logprobs(delta),
                    "finish_reason": delta.finish_reason,
                }
                for index, delta in sorted(choices, key=lambda c: c[0])
            ],
            "usage": usage,
        }


async def create_chat_completion(request: web.Request, state: ServerState, body: Any) -> web.StreamResponse:
    req = parse_chat_request(body)
    state.check_model(req.model)
    with state.admit() as engine:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            # The same tokens as the offline `LLM.chat`.
            prompt = engine.encode_chat(messages)
        except Exception as exc:  # templates raise on conversations they do not support
            raise bad_request(f"messages: the chat template refused them: {exc}", param="messages") from None
        ids = ResponseIds("chatcmpl", state.model_name)
        formatter = ChatFormatter(ids, TokenText(engine.tokenizer), req.top_logprobs)
        return await serve_generation(request, state, req, [prompt], ids, formatter, "chat.completion.chunk")
