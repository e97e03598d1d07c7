"""Greedy parity: the engine's tokens equal transformers `generate(do_sample=False)` token for token,
with requests joining a running batch at different steps."""

from __future__ import annotations

import random

import pytest
import torch
from pagoda.server.engine.outputs import OutputCollector
from pagoda.server.engine.sampling_params import SamplingParams
from support.tiny_models import TINY_FAMILIES

TINY_PROMPT_LENS = [1, 3, 7, 15, 16, 17, 33, 61, 100]


def run_staggered(engine, prompts: list[list[int]], params: SamplingParams, waves=(3, 3)) -> dict[str, list]:
    """Add prompts in waves with a few steps between them; return each request's final output."""
    collected = OutputCollector()  # the engine hands out deltas
    finished = {}
    pending = list(enumerate(prompts))
    for wave in [*waves, len(prompts)]:
        for i, ids in pending[:wave]:
            engine.add_request(str(i), ids, params)
        pending = pending[wave:]
        for _ in range(2):
            for request_id in collected.add(engine.step()):
                finished[request_id] = collected[request_id]
    while engine.has_unfinished():
        for request_id in collected.add(engine.step()):
            finished[request_id] = collected[request_id]
    return finished


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_family_greedy_parity(tiny, family):
    pair = tiny(family)
    llm = pair.llm(block_size=8)
    prompts = random_prompts(pair.loaded.hf_config.vocab_size, TINY_PROMPT_LENS)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    outputs = run_staggered(llm.engine, prompts, params)
    assert len(outputs) == len(prompts)
    for i, ids in enumerate(prompts):
        expected = pair.hf_greedy(ids, 12)
        got = outputs[str(i)].outputs[0]
        assert got.token_ids == expected, f"{family} prompt {i} (len {len(ids)})"
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_chosen_token_logprobs_match_transformers(tiny, family):
    pair = tiny(family)
    llm = pair.llm()
    ids = random_prompts(pair.loaded.hf_config.vocab_size, [20], seed=1)[0]
    (out,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True))
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = pair.hf_model(torch.tensor([ids + tokens])).logits[0].float()
    reference = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        assert entry[token] == pytest.approx(reference[step, token].item(), abs=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_chunked_prefill_and_small_blocks_keep_parity(tiny, family):
    """Mistral's sliding window (8) and Qwen3 across 5-token chunks and 4-token blocks."""
    pair = tiny(family)
    llm = pair.llm(block_size=4, max_num_batched_tokens=5)
    prompts = random_prompts(pair.loaded.hf_config.vocab_size, [9, 23, 40], seed=4)
    outputs = run_staggered(llm.engine, prompts, SamplingParams(temperature=0.0, max_tokens=8), waves=(1, 1))
    for i, ids in enumerate(prompts):
        assert outputs[str(i)].outputs[0].token_ids == pair.hf_greedy(ids, 8)


SMOL_PROMPTS = [
    "The capital of France is",
    "Hi",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three fruits: apple,",
    "In 1969, the first humans to walk on the Moon were Neil Armstrong and Buzz Aldrin. They flew on",
    "Paged attention stores keys and values in",
]


def test_smollm2_greedy_parity(smollm2):
    llm = smollm2.llm()
    prompts = [smollm2.tokenizer.encode(p) for p in SMOL_PROMPTS]
    outputs = run_staggered(llm.engine, prompts, SamplingParams(temperature=0.0, max_tokens=6), waves=(2, 3))
    for i, ids in enumerate(prompts):
        assert outputs[str(i)].outputs[0].token_ids == smollm2.hf_greedy(ids, 6), SMOL_PROMPTS[i]
    assert llm.engine.block_manager.num_used_blocks == 0
