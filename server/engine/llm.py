"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.llm_engine import LLMEngine
from pagoda.server.engine.outputs import OutputCollector, RequestOutput
from pagoda.server.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, *, loaded=None, **engine_args) -> None:
        """`engine_args`: any `EngineArgs` field. `loaded`: an already loaded model (tests)."""
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), loaded=loaded)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order. A bad request raises ValueError
        before anything is scheduled."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} sampling params for {len(prompts)} prompts")
        requests = [
            self.engine.make_request(f"offline-{next(self._ids)}", prompt, p)
            for prompt, p in zip(prompts, params, strict=True)
        ]
        for request in requests:
            self.engine.enqueue(request)
        outputs = OutputCollector()  # the engine hands out deltas: joined here
        left = len(requests)
        while left:
            left -= len(outputs.add(self.engine.step()))
        return [outputs[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template applies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.encode_chat(c) for c in conversations], params)
