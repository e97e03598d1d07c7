"""The offline baseline: the same workload through `LLM` in this process, no HTTP in between.

`max_num_seqs` = the HTTP run's `--max-concurrency`, so both runs keep the same number of requests
in flight and the ratio measures what the server costs.
"""

from __future__ import annotations

import time
from typing import Any

from pagoda.server.bench.dataset import BenchRequest


def run_offline(
    requests: list[BenchRequest], engine_kwargs: dict[str, Any], temperature: float = 0.0
) -> dict[str, Any]:
    from pagoda.server.engine.llm import LLM
    from pagoda.server.engine.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs)
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=temperature) for r in requests
    ]
    prompts = [r.prompt if isinstance(r.prompt, list) else llm.tokenizer.encode(r.prompt) for r in requests]
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, untimed
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    tokens = sum(len(choice.token_ids) for out in outputs for choice in out.outputs)
    return {
        "offline_duration_s": duration,
        "offline_output_tokens": tokens,
        "offline_output_throughput": tokens / duration,
        "offline_request_throughput": len(requests) / duration,
    }
