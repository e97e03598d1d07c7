"""The offline baseline: the same workload through the engine in this process, no HTTP in between.

At most `max_concurrency` requests are in the engine at once (a new one enters as one finishes), as
the HTTP run's client does, so the ratio of the two throughputs measures what serving over HTTP costs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from pagoda.server.bench.dataset import BenchRequest


class OfflineBaseline:
    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from pagoda.server.engine.llm import LLM

        self.llm = LLM(**engine_kwargs)  # loaded once, reused for every run of a sweep
        self._ids = itertools.count()

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None = None, temperature: float = 0.0
    ) -> dict[str, Any]:
        from pagoda.server.engine.sampling_params import SamplingParams

        engine = self.llm.engine
        prompts = [engine.encode(r.prompt)[1] for r in requests]  # the engine's encoder, untimed
        self.llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, untimed
        pending = deque(zip(prompts, requests, strict=True))
        cap = max_concurrency or len(requests)
        in_flight = tokens = 0
        start = time.perf_counter()
        while pending or in_flight:
            while pending and in_flight < cap:
                prompt, request = pending.popleft()
                params = SamplingParams(
                    max_tokens=request.output_len, ignore_eos=True, temperature=temperature
                )
                engine.add_request(f"bench-{next(self._ids)}", prompt, params)
                in_flight += 1
            for output in engine.step():  # deltas: each holds the tokens new this step
                tokens += sum(len(choice.token_ids) for choice in output.outputs)
                in_flight -= output.finished
        duration = time.perf_counter() - start
        return {
            "offline_duration_s": duration,
            "offline_output_tokens": tokens,
            "offline_output_throughput": tokens / duration,
            "offline_request_throughput": len(requests) / duration,
        }
