"""A randomized soak of the engine: arrivals, aborts, forks and beams on a pool too small for them.

A tiny pool with small blocks forces everything at once: preemption by recompute, chunked prefill,
prefix-cache hits and LRU eviction, copy-on-write, sequences reaching max_model_len. Requests mix
greedy, seeded sampling, n = 2, beams, penalties with logprobs, and stop strings. After every step
the block accounting must be exact; at the end no block is held, and every request that was not
aborted produced the same tokens, text, finish reason and logprobs as when it ran alone on a large
pool.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pagoda.server.engine.outputs import OutputCollector, RequestOutput
from pagoda.server.engine.sampling_params import SamplingParams


def assert_block_accounting(engine) -> None:
    """Ref counts equal the references from live block tables; every block is either referenced or
    on exactly one free list; the shared-block counter and the prefix-cache index are consistent."""
    bm = engine.block_manager
    refs = Counter()
    for request in engine.requests.values():
        for seq in request.live_seqs():
            refs.update(seq.block_table)
    assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == dict(refs)
    free = list(bm._free_ids) + list(bm._cached_free)
    assert len(set(free)) == len(free) and not set(free) & set(refs)
    assert len(free) + len(refs) == bm.num_blocks
    assert bm.num_shared_blocks == sum(1 for count in refs.values() if count > 1)
    for block_hash, block_id in bm._hash_to_block.items():
        assert bm.blocks[block_id].block_hash == block_hash
    assert all(bm.blocks[b].block_hash is not None for b in bm._cached_free)


MAX_MODEL_LEN = 64
NUM_REQUESTS = 54
KINDS = ["greedy", "sampled", "greedy", "n", "greedy", "beam", "penalised", "stop", "unbounded"]


def with_stop_string_from_its_own_text(alone, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """A stop string that the request's greedy text is sure to contain, a few characters in (never
    with U+FFFD: the text of an incomplete UTF-8 byte sequence, which streaming holds back)."""
    text = alone.generate([prompt], params)[0].outputs[0].text
    windows = [text[i : i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    return SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                          stop=windows[:1] or None)  # fmt: skip


def random_request(rng: random.Random, number: int, shared_prefixes: list[list[int]]):
    prompt = list(rng.choice(shared_prefixes)) if rng.random() < 0.5 else []
    prompt += [rng.randrange(5, 300) for _ in range(rng.randrange(1, 14))]
    kind = KINDS[number % len(KINDS)]
    max_tokens = rng.randrange(1, 24)
    if kind == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    elif kind == "sampled":
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(1000), max_tokens=max_tokens)
    elif kind == "n":
        params = SamplingParams(n=2, temperature=1.0, seed=rng.randrange(1000),
                                max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
    elif kind == "penalised":
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=2,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
        )
    elif kind == "stop":  # the stop string is set once the request's own greedy text is known
        params = SamplingParams(temperature=0.0, max_tokens=max(max_tokens, 12), ignore_eos=True)
    elif kind == "unbounded":  # runs until max_model_len
        params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    else:
        params = SamplingParams(
            use_beam_search=True, n=2, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        )
    return kind, prompt, params


@pytest.mark.parametrize(
    ("family", "seed"), [("llama", s) for s in range(5)] + [("mistral", 0), ("qwen3", 0)]
)
def test_soak_keeps_block_accounting_exact_and_outputs_unchanged(tiny, family, seed):
    """mistral: sliding-window attention; qwen3: q/k norms and an explicit head_dim."""
    pair = tiny(family)
    rng = random.Random(seed)
    shared_prefixes = [[rng.randrange(5, 300) for _ in range(rng.randrange(8, 20))] for _ in range(3)]
    engine = pair.llm(block_size=4, num_blocks=28, max_num_seqs=8, max_num_batched_tokens=24,
                      enable_chunked_prefill=True, enable_prefix_caching=True,
                      max_model_len=MAX_MODEL_LEN).engine  # fmt: skip
    alone = pair.llm(enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)  # the reference runs
    submitted: dict[str, tuple[str, list[int], SamplingParams]] = {}
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    collected = OutputCollector()  # the engine hands out deltas
    steps = 0
    while len(submitted) < NUM_REQUESTS or engine.has_unfinished():
        if len(submitted) < NUM_REQUESTS:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):  # bursts and gaps
                request_id = f"r{len(submitted)}"
                kind, prompt, params = random_request(rng, len(submitted), shared_prefixes)
                if kind == "stop":
                    params = with_stop_string_from_its_own_text(alone, prompt, params)
                submitted[request_id] = kind, prompt, params
                engine.add_request(request_id, prompt, params)
        if engine.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(engine.requests))
            output = engine.abort_request(victim)
            # Sequences of the request that had already finished keep their own reason.
            assert output.finished and any(c.finish_reason == "abort" for c in output.outputs)
            aborted.add(victim)
        for request_id in collected.add(engine.step()):
            finished[request_id] = collected[request_id]
        assert_block_accounting(engine)
        steps += 1
        assert steps < 2000, "the engine stopped making progress"

    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and engine.block_manager.num_evictions > 0
    assert engine.block_manager.num_used_blocks == 0
    assert set(finished) | aborted == set(submitted) and not set(finished) & aborted
    for request_id, output in finished.items():
        params = submitted[request_id][2]
        assert len(output.outputs) == params.n
        assert all(0 < len(c.token_ids) <= (params.max_tokens or MAX_MODEL_LEN) for c in output.outputs)

    # Every kind of request got through, and stop strings and max_model_len did end requests.
    assert Counter(submitted[rid][0] for rid in finished) >= Counter(greedy=5, sampled=2, n=2, beam=2, stop=2)
    stopped = [o for rid, o in finished.items() if submitted[rid][0] == "stop" and submitted[rid][2].stop]
    assert stopped and all(o.outputs[0].finish_reason == "stop" for o in stopped)
    for request_id, output in finished.items():
        if submitted[request_id][0] == "unbounded":
            assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == MAX_MODEL_LEN
    # Seeded sampling, forks and beams too: each sequence has its own seeded generator, so running
    # alone must reproduce it (a missed copy-on-write or a stale block would not).
    for request_id in finished:
        _, prompt, params = submitted[request_id]
        expected = alone.generate([prompt], params)[0].outputs
        got = finished[request_id].outputs
        assert [c.token_ids for c in got] == [c.token_ids for c in expected], request_id
        assert [(c.text, c.finish_reason, c.stop_reason) for c in got] == [
            (c.text, c.finish_reason, c.stop_reason) for c in expected
        ]
        if params.logprobs:
            for a, b in zip(got[0].logprobs, expected[0].logprobs, strict=True):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
