"""Sampling: seeds, stop strings and ids, logprobs, top-k/top-p/min-p, penalties."""

from __future__ import annotations

import math

import pytest
import torch
from pagoda.server.engine.sampler import Sampler, apply_penalties, sample_from_cdf
from pagoda.server.engine.sampling_params import SamplingParams

PROMPT = list(range(30, 50))


def test_same_seed_same_tokens_whatever_the_batch(llama):
    llm = llama.llm()
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], seeded)
    others = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    batch = llm.generate([[5, 6, 7], PROMPT, list(range(60, 100))], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_string_across_token_boundary_is_stripped(llama):
    llm = llama.llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([PROMPT], greedy)
    tokens = full.outputs[0].token_ids
    tok = llm.tokenizer
    # A stop string made of the last char of token 5's text and the first char of token 6's text.
    head = tok.decode(tokens[:6])
    nxt = tok.decode(tokens[:7])[len(head) :]
    assert head and nxt
    stop = head[-1] + nxt[0]
    expected = full.outputs[0].text[: full.outputs[0].text.find(stop)]
    (out,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    assert out.outputs[0].text == expected
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    (kept,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    )
    assert kept.outputs[0].text == expected + stop


def test_stop_token_id_and_max_tokens(llama):
    llm = llama.llm()
    (full,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert full.outputs[0].finish_reason == "length" and len(full.outputs[0].token_ids) == 10
    stop_id = full.outputs[0].token_ids[3]
    first = full.outputs[0].token_ids.index(stop_id)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]))
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_logprobs_are_sane(llama):
    llm = llama.llm()
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=5))
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and 5 <= len(entry) <= 6
        assert all(v <= 0.0 for v in entry.values())
        assert sum(math.exp(v) for v in entry.values()) <= 1.0 + 1e-5
        total += entry[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_top_k_1_tiny_top_p_and_min_p_1_equal_greedy(llama):
    llm = llama.llm()
    (greedy,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        params.max_tokens, params.ignore_eos, params.temperature = 10, True, 1.5
        (out,) = llm.generate([PROMPT], params)
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids, params


def test_sampler_distribution_and_filters():
    """Sampling follows softmax(logits / T); top-k / top-p keep only their tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    sampler = Sampler(seed=0)
    plain = [SamplingParams(temperature=0.7)] * 4000
    out = sampler(logits, plain, [None] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, dim=-1), atol=0.03)
    top_k = sampler(logits, [SamplingParams(top_k=2)] * 4000, [None] * 4000)
    assert set(top_k.token_ids) == {0, 1}
    # probs ~ [0.61, 0.22, 0.14, ...]: top_p 0.7 keeps tokens 0 and 1 (mass before token 2 is 0.83)
    top_p = sampler(logits, [SamplingParams(top_p=0.7)] * 4000, [None] * 4000)
    assert set(top_p.token_ids) == {0, 1}


def test_plain_rows_pass_gives_what_the_general_path_gives(monkeypatch):
    """The native pass for rows that need only a token and its log-probability: the same tokens (seeded
    and unseeded, greedy and sampled, in one batch) and the same log-probabilities as the torch path,
    and the same draws after it (the next step's tokens agree too)."""
    from pagoda.kernels import cpu_native

    if not cpu_native.has_vector_kernels():
        pytest.skip("no vector kernels on this CPU")
    logits = 3 * torch.randn(12, 5000, generator=torch.Generator().manual_seed(1))
    settings = zip([0.0, 0.8, 1.3] * 4, [None, 0] * 6, strict=True)
    params = [SamplingParams(temperature=t, logprobs=lp) for t, lp in settings]

    def run() -> list:
        sampler = Sampler(seed=7)
        generators = [torch.Generator().manual_seed(i) if i % 4 == 1 else None for i in range(12)]
        return [vars(sampler(logits, params, generators)) for _ in range(2)]

    plain = run()
    monkeypatch.setattr(cpu_native, "sample_plain", lambda *args: None)
    assert run() == plain
    assert plain[0]["top_logprobs"][1] == {plain[0]["token_ids"][1]: plain[0]["logprobs"][1]}


def test_sample_from_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    uniform = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0 - 1e-12], dtype=torch.float64)
    assert sample_from_cdf(probs, uniform).tolist() == [1, 1, 3, 3, 3]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [0], [params], [([0], [1, 2, 2])])
    # token 0: prompt only -> 2/2; token 1: -2*2 - 0.25 - 0.5; token 2: 1/2 - 0.5 - 0.5; token 3 untouched
    assert logits[0].tolist() == pytest.approx([1.0, -4.75, -0.5, 0.0])


def test_repetition_penalty_matches_transformers(llama):
    llm = llama.llm()
    prompt = [40, 41, 42, 40, 41, 42, 40, 41]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.5))
    with torch.inference_mode():
        expected = llama.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, repetition_penalty=1.5
        )[0, len(prompt) :].tolist()
    assert out.outputs[0].token_ids == expected
