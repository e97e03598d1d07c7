"""Decode steps through `DecodeGraphs` (static buffers, padded buckets, sliced outputs) give the same
tokens as eager steps.

CUDA graphs cannot exist on a CPU-only machine, so the capture here is a stand-in: its "replay" runs the
forward again on the static buffers and copies the result into the first call's output tensors, which
is what a replayed graph does. Everything around the graph is the real code: which steps it takes,
the buffers, the padding rows, the buckets and the slicing. The graphs themselves are checked on a GPU
by `benchmarks/engine_gpu_check.py` (greedy tokens with and without them).
"""

from __future__ import annotations

import pytest
import torch
from pagoda.server.engine.block_manager import blocks_for_tokens
from pagoda.server.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pagoda.server.engine.sampling_params import SamplingParams


class ReplayByRerun:
    """The stand-in capture; counts replays so a test can tell the graphs ran."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, forward, pool):
        outputs = forward()

        def replay() -> None:
            self.replays += 1
            for kept, fresh in zip(outputs, forward(), strict=True):
                kept.copy_(fresh)

        return replay, outputs, pool


def with_graphs(llm, max_num_seqs: int) -> ReplayByRerun:
    capture = ReplayByRerun()
    runner = llm.engine.runner
    max_blocks = blocks_for_tokens(llm.engine.max_model_len, runner.spec.block_size)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, max_num_seqs, max_blocks, capture=capture)
    return capture


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    assert capture_sizes(4096)[-1] == 512  # larger batches run eagerly


@pytest.mark.parametrize("family", ["llama3", "mistral"])  # GQA and tied embeddings; sliding window
def test_greedy_tokens_equal_with_decode_graphs(tiny, family):
    pair = tiny(family)
    prompts = [[5 + i, 17, 3 + 2 * i] * (1 + 3 * i) for i in range(5)]  # 3..39 tokens: ragged tables
    # Sequences end one after another: the batch moves down through the buckets 8, 4, 2, 1.
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(5)]
    eager = [out.outputs[0].token_ids for out in pair.llm(max_num_seqs=8).generate(prompts, params)]

    llm = pair.llm(max_num_seqs=8)
    capture = with_graphs(llm, max_num_seqs=8)
    graphed = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert graphed == eager
    assert capture.replays == 27  # every decode step: 28 tokens for the longest, its first from the prefill
    assert llm.engine.block_manager.num_used_blocks == 0


def test_steps_the_graphs_do_not_take_run_eagerly(llama):
    """Prefill steps, prompt scoring and batches above the largest bucket stay on the eager path."""
    llm = llama.llm(max_num_seqs=8)
    capture = with_graphs(llm, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[7, 8, 9, 10]] * 3
    expected = [out.outputs[0].token_ids for out in llama.llm(max_num_seqs=8).generate(prompts, params)]
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
    assert capture.replays == 0  # three sequences decode together: above the largest bucket (2)

    scored = llm.generate([[7, 8, 9, 10]], SamplingParams(max_tokens=3, prompt_logprobs=1, temperature=0.0))
    assert scored[0].prompt_logprobs is not None
    assert capture.replays == 2  # the two decode steps after the scored prompt; the prefill ran eagerly


def test_a_new_pool_drops_the_graphs(llama):
    llm = llama.llm(max_num_seqs=4)
    with_graphs(llm, max_num_seqs=4)
    runner = llm.engine.runner
    runner.allocate(runner.num_blocks)
    assert runner.graphs is None
    assert torch.equal(runner.kv_caches[0][0], torch.zeros_like(runner.kv_caches[0][0]))
