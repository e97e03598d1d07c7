"""Bad requests raise a clear ValueError before anything is scheduled; the engine keeps serving."""

from __future__ import annotations

import pytest
from pagoda.server.engine.async_engine import AsyncLLMEngine
from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.validation import MAX_LOGPROBS

BAD = [
    ("", SamplingParams(), "prompt: must not be empty"),
    ([], SamplingParams(), "prompt: must not be empty"),
    ([7] * 512, SamplingParams(), "prompt: 512 tokens leave no room"),
    ([10, 11], SamplingParams(max_tokens=0), "max_tokens: must be an integer >= 1"),
    ([10, 11], SamplingParams(max_tokens=-3), "max_tokens:"),
    ([10, 11], SamplingParams(top_p=0.0), "top_p: must be in (0, 1]"),
    ([10, 11], SamplingParams(top_p=1.5), "top_p:"),
    ([10, 11], SamplingParams(n=0), "n: must be an integer >= 1"),
    ([10, 11], SamplingParams(temperature=-1.0), "temperature: must be >= 0"),
    ([10, 11], SamplingParams(top_k=-2), "top_k:"),
    ([10, 11], SamplingParams(min_p=1.5), "min_p:"),
    ([10, 11], SamplingParams(logprobs=MAX_LOGPROBS + 1), "logprobs:"),
    ([10, 11], SamplingParams(repetition_penalty=0.0), "repetition_penalty:"),
    ([10, 11], SamplingParams(stop=[""]), "stop:"),
    ([10, 11], SamplingParams(best_of=1, n=2), "best_of:"),
    ([10, 10**7], SamplingParams(), "prompt: token ids must be integers"),
]


@pytest.mark.parametrize(("prompt", "params", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_request_raises_before_scheduling_and_engine_keeps_serving(llama, prompt, params, message):
    llm = llama.llm()
    engine = llm.engine
    engine.add_request("good", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError) as info:
        engine.add_request("bad", prompt, params)
    assert message in str(info.value)
    assert "bad" not in engine.requests and all(r.request_id != "bad" for r in engine.scheduler.waiting)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].request_id == "good" and outputs[-1].finished
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert engine.block_manager.num_used_blocks == 0


def test_request_that_can_never_fit_the_pool_is_refused(llama):
    llm = llama.llm(block_size=4, num_blocks=4)  # 16 token slots in all
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        llm.generate([list(range(5, 15))], SamplingParams(max_tokens=10))
    (out,) = llm.generate([list(range(5, 15))], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6


async def test_async_engine_raises_at_first_anext_and_keeps_serving(llama):
    engine = AsyncLLMEngine(EngineArgs(device="cpu", kv_cache_memory=16 << 20), loaded=llama.loaded)
    await engine.start()
    try:
        stream = engine.generate("", SamplingParams(), "bad")
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            await stream.__anext__()
        snapshots = [
            o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "ok")
        ]
        final = snapshots[-1]
        assert final.finished and len(final.outputs[0].token_ids) == 3
    finally:
        await engine.shutdown()


def test_more_sequences_than_batch_seats_is_refused(llama):
    llm = llama.llm(max_num_seqs=2)
    with pytest.raises(ValueError, match="n: 4 sequences exceed max_num_seqs 2"):
        llm.generate([[5, 6, 7]], SamplingParams(n=4))
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=3, seed=0))
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 3 for o in out.outputs)


def test_unchunked_step_budget_below_max_model_len_is_refused_at_start(llama):
    """Without chunked prefill a preempted sequence is recomputed in one step, so a budget below
    max_model_len could stall the waiting queue forever: refuse it up front."""
    with pytest.raises(ValueError, match="max_num_batched_tokens: 64 is below max_model_len 128"):
        llama.llm(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=128)
    llm = llama.llm(max_num_batched_tokens=128, enable_chunked_prefill=False, max_model_len=128)
    assert llm.engine.max_num_batched_tokens == 128
