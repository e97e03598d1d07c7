"""transformers' own ways to serve a workload, timed for the engine benchmark: one request at a time,
static (padded) batches, and its continuous batching manager (what `generate_batch` drives)."""

from __future__ import annotations

import time

import torch
from bench_workload import Workload, log


def hf_sequential(model, work: Workload, limit: int) -> tuple[float, int]:
    tokens, started = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt, n in list(zip(work.prompts, work.output_lens, strict=True))[:limit]:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
            tokens += out.shape[1] - len(prompt)
    return time.perf_counter() - started, tokens


def hf_static(model, work: Workload, batch_size: int, pad_id: int) -> tuple[float, int]:
    """Padded batches in arrival order; each batch runs to its longest output; useful tokens counted."""
    started, useful = time.perf_counter(), 0
    with torch.inference_mode():
        for start in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[start : start + batch_size]
            lens = work.output_lens[start : start + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            longest = max(lens)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            useful += sum(lens)
    return time.perf_counter() - started, useful


def hf_continuous(model, work: Workload, kv_tokens: int) -> tuple[float, int]:
    """transformers' continuous batching manager (what `generate_batch` drives), with per-request max tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1)
    # Bound its cache like pagoda's (left alone it sizes the pool from free RAM: ~15 GB here).
    tokens_needed = sum(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    cb_config = ContinuousBatchingConfig(
        page_size=256,
        num_blocks=-(-kv_tokens // 256),
        max_batch_tokens=2048,
        max_requests_per_batch=len(work.prompts),
    )
    log(f"transformers continuous batching: cache {kv_tokens} token slots for {tokens_needed} tokens of work")
    started, tokens = time.perf_counter(), 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(work.prompts, work.output_lens, strict=True))
        ]
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching loop stopped")
    return time.perf_counter() - started, tokens
