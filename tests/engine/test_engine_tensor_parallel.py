"""Tensor parallelism on CPU (gloo): two ranks give the tokens of one, and logits within 1e-5.

Each TP=2 engine starts a real worker process (`parallel/worker.py`) that loads its own shard from
the safetensors; the TP=1 reference is the plain engine on the same folder. Every step's logits are
recorded on both and compared row by row, so a wrong shard or a missing all-reduce shows at once.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams
from support.tiny_models import tiny_model_dir

PROMPTS = [[7, 8, 9, 10, 11], list(range(5, 40)), [30, 31, 32]]
LOGITS_TOL = 1e-5


def engine_on(folder, tp: int, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=8, **kw)


def record_logits(llm: LLM) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def recording(out):
        logits, sampled = execute(out)
        seen.append(logits.clone())
        return logits, sampled

    llm.engine.runner.execute = recording
    return seen


def run_both(folder, prompts, params, *, warm_up=None, **kw):
    """Per TP size 1 and 2: (outputs, per-step logits, stats, rank 0's KV caches). `warm_up`
    prompts run first, to completion (their blocks stay in the prefix cache)."""
    results = []
    for tp in (1, 2):
        llm = engine_on(folder, tp, **kw)
        try:
            logits = record_logits(llm)
            if warm_up:
                llm.generate(warm_up, params[0])
            outputs = llm.generate(prompts, params)
            assert llm.engine.block_manager.num_used_blocks == 0
            results.append((outputs, logits, llm.engine.stats(), llm.engine.runner.kv_caches))
        finally:
            llm.engine.shutdown()
    return results


def assert_same(one, two) -> None:
    (out1, logits1, _, _), (out2, logits2, _, _) = one, two
    for a, b in zip(out1, out2, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(logits1) == len(logits2)
    for step, (x, y) in enumerate(zip(logits1, logits2, strict=True)):
        assert x.shape == y.shape, step
        if x.numel():
            assert (x - y).abs().max().item() < LOGITS_TOL, step


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_mha_greedy_tokens_and_logits_equal_one_rank(tmp_path_factory):
    """llama: MHA, untied head; rank 0's KV cache holds exactly its two heads of the four."""
    folder = tiny_model_dir("llama", tmp_path_factory)
    one, two = run_both(folder, PROMPTS, GREEDY)
    assert_same(one, two)
    (k1, v1), (k2, v2) = one[3][0], two[3][0]  # layer 0, same block tables on both
    assert k2.shape[2] == k1.shape[2] // 2
    assert torch.allclose(k2, k1[:, :, :2], atol=1e-5) and torch.allclose(v2, v1[:, :, :2], atol=1e-5)


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path_factory):
    """Multi-query attention (1 KV head < 2 ranks): each rank holds the one KV head, whole."""
    folder = tiny_model_dir("qwen2", tmp_path_factory, num_kv_heads=1)
    one, two = run_both(folder, PROMPTS, GREEDY)
    assert_same(one, two)
    assert two[3][0][0].shape[1:] == one[3][0][0].shape[1:]  # the KV head is not split


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3"])
def test_gqa_families_greedy_tokens_and_logits_equal_one_rank(tmp_path_factory, family):
    """GQA with 2 KV heads on 2 ranks (kv_heads < 2·ranks: one KV head each), tied heads, biases,
    q/k norms, sliding windows."""
    one, two = run_both(tiny_model_dir(family, tmp_path_factory), PROMPTS, GREEDY)
    assert_same(one, two)


def test_n_beams_prefix_cache_and_preemption_under_two_ranks(tmp_path_factory):
    """A pool too small for the batch (preemption by recompute), shared prompt prefixes (prefix
    cache hits), n = 2 seeded sampling and beam search: the same outputs as one rank."""
    folder = tiny_model_dir("llama3", tmp_path_factory)
    shared = list(range(5, 29))  # three full 8-token blocks
    prompts = [[*shared, 40], [*shared, 41], [*shared, 42, 43], list(range(50, 70))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, n=2, use_beam_search=True, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    one, two = run_both(folder, prompts, params, warm_up=[[*shared, 39]], num_blocks=11, max_num_seqs=8)
    assert_same(one, two)
    stats = two[2]
    assert stats.preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_blocks_total == 11
    assert (stats.preemptions, stats.prefix_cache_hits) == (one[2].preemptions, one[2].prefix_cache_hits)
