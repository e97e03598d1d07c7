"""Prompt logprobs equal transformers' at every prompt position: in one prefill, chunked over several
steps, after prefix-cache hits (which must not skip a scored position), with n > 1 and with other
requests in the batch. Also logit_bias in the sampler."""

from __future__ import annotations

import pytest
import torch
from pagoda.server.engine.sampling_params import SamplingParams
from test_engine_parity import random_prompts


@torch.inference_mode()
def hf_prompt_logprobs(pair, ids: list[int]) -> torch.Tensor:
    """[len-1] logprob of each prompt token after the first, and [len-1, vocab] full rows."""
    logits = pair.hf_model(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits[:-1], dim=-1)
    return rows.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1), rows


def check(pair, ids: list[int], output, k: int) -> None:
    expected, rows = hf_prompt_logprobs(pair, ids)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    assert output.prompt_token_ranks[0] is None
    for position in range(1, len(ids)):
        entry = got[position]
        token = ids[position]
        assert entry[token] == pytest.approx(expected[position - 1].item(), abs=1e-4), position
        top = rows[position - 1].topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}
        rank = int((rows[position - 1] > rows[position - 1][token]).sum()) + 1
        assert output.prompt_token_ranks[position] == rank


def test_prompt_logprobs_match_transformers_whole_and_chunked(llama):
    vocab = llama.loaded.hf_config.vocab_size
    prompts = random_prompts(vocab, [1, 2, 9, 40, 70], seed=3)
    for budget in (None, 16):  # one prefill, then chunks of 16 tokens over several steps
        extra = {"max_num_batched_tokens": budget} if budget else {}
        llm = llama.llm(block_size=8, **extra)
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        for ids, out in zip(prompts, outputs, strict=True):
            check(llama, ids, out, 3)
        assert llm.engine.block_manager.num_used_blocks == 0


def test_only_requests_that_ask_get_them_and_others_are_unchanged(llama):
    ids = random_prompts(llama.loaded.hf_config.vocab_size, [30], seed=4)[0]
    llm = llama.llm(block_size=8)
    plain, scored = llm.generate([ids, ids], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                             prompt_logprobs=0)])  # fmt: skip
    assert plain.prompt_logprobs is None
    check(llama, ids, scored, 0)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prefix_cache_hits_do_not_skip_scored_positions(llama):
    ids = random_prompts(llama.loaded.hf_config.vocab_size, [50], seed=5)[0]
    llm = llama.llm(block_size=8, enable_prefix_caching=True)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))  # fills the prefix cache
    (again,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    assert again.num_cached_tokens >= 40  # the cache does hold the prompt
    (scored,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert scored.num_cached_tokens == 0
    check(llama, ids, scored, 1)
    (n2,) = llm.generate([ids], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=3, prompt_logprobs=0))
    check(llama, ids, n2, 0)
    assert len(n2.outputs) == 2
    assert llm.engine.block_manager.num_used_blocks == 0


def test_logit_bias_forces_and_bans_tokens(llama):
    ids = random_prompts(llama.loaded.hf_config.vocab_size, [10], seed=6)[0]
    llm = llama.llm()
    (free,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
    first = free.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, logit_bias={7: 100.0})
    (forced,) = llm.generate([ids], params)
    assert forced.outputs[0].token_ids == [7, 7, 7, 7]
    banned_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={first: -100.0})
    (banned,) = llm.generate([ids], banned_params)
    assert banned.outputs[0].token_ids[0] != first
    # sampled rows are biased too
    sampled = SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True, logit_bias={9: 100.0})
    assert llm.generate([ids], sampled)[0].outputs[0].token_ids == [9] * 6


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs:"),
        (SamplingParams(logit_bias={3: 100.5}), "logit_bias:"),
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias: token ids must be in"),
    ],
)
def test_bad_params_are_refused(llama, params, message):
    llm = llama.llm()
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [5, 6, 7], params)
