"""Prefix caching, LRU eviction, preemption by recompute, chunked prefill, beam search."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from pagoda.server.engine.outputs import OutputCollector
from pagoda.server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts_with_shared_prefix(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 300) for _ in range(prefix_len)]
    return [system + [rng.randrange(5, 300) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def run_all(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_shared_prefix_prefills_only_the_suffix_with_identical_output(llama):
    first, second = prompts_with_shared_prefix(2, prefix_len=40)
    cold = run_all(llama.llm(enable_prefix_caching=False), [second])
    llm = llama.llm(block_size=8)
    engine = llm.engine
    (out1,) = llm.generate([first], GREEDY)
    assert out1.num_cached_tokens == 0
    before = engine.stats().step_histograms.tokens
    (out2,) = llm.generate([second], GREEDY)
    after = engine.stats().step_histograms.tokens
    assert out2.num_cached_tokens == 40  # five full blocks of the shared 40-token prefix
    steps = after.count - before.count  # the prefill, then one token per decode step
    assert after.sum - before.sum == len(second) - 40 + steps - 1  # the prefill ran the suffix only
    assert out2.outputs[0].token_ids == cold[0]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 40 and stats.prefix_cache_queries == len(first) + len(second)


def test_fully_cached_prompt_recomputes_its_last_token(llama):
    prompt = list(range(10, 42))  # 32 tokens = 4 full blocks of 8
    llm = llama.llm(block_size=8)
    (a,) = llm.generate([prompt], GREEDY)
    (b,) = llm.generate([prompt], GREEDY)
    assert b.num_cached_tokens == 24 and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_lru_eviction_keeps_serving_correctly_with_a_small_pool(llama):
    groups = [prompts_with_shared_prefix(3, prefix_len=24, seed=g) for g in range(4)]
    # Pairs of one prefix hit the cache; the third of each comes back after the others evicted it.
    prompts = [p for g in groups for p in g[:2]] + [g[2] for g in groups]
    reference = run_all(llama.llm(enable_prefix_caching=False), prompts)
    llm = llama.llm(block_size=8, num_blocks=12, max_num_seqs=2)  # working set of cached prefixes > pool
    got = []
    for prompt in prompts:
        got += run_all(llm, [prompt])
    assert got == reference
    bm = llm.engine.block_manager
    assert bm.num_evictions > 0 and llm.engine.stats().prefix_cache_hits > 0
    assert bm.num_used_blocks == 0


def test_forced_preemption_completes_everything_with_identical_greedy_output(llama):
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randrange(4, 30))] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = run_all(llama.llm(enable_prefix_caching=False), prompts, params)
    llm = llama.llm(block_size=4, num_blocks=24, enable_prefix_caching=False)  # 96 slots for ~10 × 37
    assert run_all(llm, prompts, params) == reference
    assert llm.engine.stats().preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_matches_unchunked_and_decodes_keep_going(llama):
    long_prompt = [random.Random(1).randrange(5, 300) for _ in range(120)]
    short = [7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = run_all(
        llama.llm(max_num_batched_tokens=512, enable_chunked_prefill=False), [short, long_prompt], params
    )
    llm = llama.llm(max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("short", short, params)
    outputs = OutputCollector()  # the engine hands out deltas
    outputs.add(engine.step())  # short is now decoding
    engine.add_request("long", long_prompt, params)
    short_tokens_during_prefill = 0
    while "long" not in outputs or not outputs["long"].outputs[0].token_ids:
        ran_before = engine.stats().step_histograms.tokens.sum
        step_outputs = {o.request_id: o for o in engine.step()}
        assert engine.stats().step_histograms.tokens.sum - ran_before <= 16
        if "short" in step_outputs and not step_outputs.get("long"):
            short_tokens_during_prefill += 1
        outputs.add(step_outputs.values())
    assert short_tokens_during_prefill >= 7  # 120 tokens at 15 per step: the decode never waited
    while engine.has_unfinished():
        outputs.add(engine.step())
    assert [outputs["short"].outputs[0].token_ids, outputs["long"].outputs[0].token_ids] == reference


@pytest.mark.parametrize(("family", "width", "length_penalty"), [("llama", 4, 1.0), ("qwen2", 3, 0.5)])
def test_beam_search_equals_transformers(tiny, family, width, length_penalty):
    pair = tiny(family)
    llm = pair.llm(block_size=4)
    prompt = [random.Random(2).randrange(5, 300) for _ in range(11)]
    params = SamplingParams(
        n=2,
        use_beam_search=True,
        best_of=width,
        temperature=0.0,
        max_tokens=10,
        length_penalty=length_penalty,
    )
    (out,) = llm.generate([prompt], params)
    with torch.inference_mode():
        expected = pair.hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=10,
            length_penalty=length_penalty,
            early_stopping=False,
            pad_token_id=pair.tokenizer.pad_token_id,
        )
    pad = pair.tokenizer.pad_token_id
    for output, row in zip(out.outputs, expected.tolist(), strict=True):
        generated = row[len(prompt) :]
        while generated and generated[-1] == pad:
            generated.pop()
        assert output.token_ids == generated
    assert llm.engine.block_manager.num_used_blocks == 0


def test_beam_search_shares_blocks_and_prunes(llama):
    llm = llama.llm(block_size=4)
    engine = llm.engine
    params = SamplingParams(use_beam_search=True, best_of=4, temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("beam", list(range(20, 38)), params)
    peak_shared = 0
    while engine.has_unfinished():
        engine.step()
        request = engine.requests.get("beam")
        if request is not None and len(request.seqs) == 4:
            used = engine.block_manager.num_used_blocks
            assert used < sum(len(s.block_table) for s in request.seqs)  # shared, not copied
            peak_shared = max(peak_shared, engine.block_manager.num_shared_blocks)
    assert peak_shared >= 4  # at least the prompt's full blocks
    assert engine.block_manager.num_used_blocks == 0


def test_engine_logs_capacity_at_start(llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagoda.server.engine.llm_engine"):
        llama.llm(block_size=16, num_blocks=100)
    text = caplog.text
    assert "KV cache capacity: 1,600 tokens" in text and "bytes per token" in text


def test_a_request_the_whole_pool_cannot_hold_is_aborted_and_the_engine_goes_on(llama, monkeypatch):
    """The up-front size check refuses such requests; this bypasses it to exercise the scheduler's
    backstop, which must drop the request (finish_reason "abort", blocks freed), not raise."""
    llm = llama.llm(block_size=4, num_blocks=4, enable_prefix_caching=False)  # 16 slots
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    monkeypatch.setattr(engine, "_check_fits", lambda *args: None)
    engine.add_request("too-long", list(range(5, 15)), params)  # 10 + 30 tokens > 16 slots
    outputs = OutputCollector()  # the engine hands out deltas
    while engine.has_unfinished():
        outputs.add(engine.step())
    dropped = outputs["too-long"]
    assert dropped.finished and dropped.outputs[0].finish_reason == "abort"
    assert 0 < len(dropped.outputs[0].token_ids) < 30
    assert engine.block_manager.num_used_blocks == 0
    monkeypatch.undo()
    fits = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(fits[0].outputs[0].token_ids) == 8
