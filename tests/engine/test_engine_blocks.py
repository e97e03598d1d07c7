"""Block accounting: on-demand allocation, ref counts, forks, copy-on-write, freeing."""

from __future__ import annotations

import random

import pytest
import torch
from pagoda.server.engine.block_manager import BlockManager, NoFreeBlocksError
from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.sequence import Sequence


def bare_seq(tokens: list[int]) -> Sequence:
    """A sequence for block-manager-only tests (no detokenizer needed)."""
    return Sequence(0, list(tokens), len(tokens), detokenizer=None)


def test_blocks_are_allocated_one_at_a_time_and_freed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = bare_seq(range(6))
    assert bm.allocate_slots(seq, 6) == []
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    seq.num_computed_tokens = 6
    for written in range(7, 13):  # decode: one token per step
        bm.allocate_slots(seq, 1)
        seq.num_computed_tokens = written
        assert len(seq.block_table) == -(-written // 4)  # never more than needed
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_pool_exhaustion_raises():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = bare_seq(range(9))
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_slots(seq, 9)


def test_fork_shares_blocks_and_write_into_shared_partial_block_copies_it():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = bare_seq(range(6))
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = bm.fork(parent, index=1)
    assert child.index == 1 and child.block_table == parent.block_table and child.token_ids == parent.token_ids
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    assert bm.num_shared_blocks == 2 and bm.num_used_blocks == 2
    copies = bm.allocate_slots(child, 1)  # writes position 6, inside the shared partial block 1
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.blocks[parent.block_table[1]].ref_count == 1
    assert bm.allocate_slots(parent, 1) == []  # the last holder writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0 and bm.num_shared_blocks == 0


def test_prefix_cache_hashes_chain_and_lru_evicts_oldest_first():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = bare_seq(list(range(9)))
    bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.register_full_blocks(a)
    b = bare_seq([*range(8), 99, 100])
    assert bm.match_prefix(b) == a.block_table[:2]
    c = bare_seq([0, 1, 2, 3, 9, 9, 9, 9, 7])  # same first block, different second
    assert bm.match_prefix(c) == a.block_table[:1]
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    assert bm.match_prefix(b) == a_blocks[:2]  # freed blocks stay cached
    # Taking three blocks evicts: uncached free blocks first, then cached ones, least recent first.
    d = bare_seq(list(range(50, 62)))
    bm.allocate_slots(d, 12)
    assert bm.num_evictions == 1
    assert len(bm.match_prefix(b)) == 1  # the tail block (freed first) went first


def test_waste_bound_and_all_blocks_free_after_run(llama):
    llm = llama.llm(block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(3)
    for i in range(6):
        ids = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 30))]
        engine.add_request(str(i), ids, SamplingParams(max_tokens=rng.randrange(1, 15), ignore_eos=True))
    bs = engine.block_manager.block_size
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        tables = [s.block_table for r in engine.scheduler.running for s in r.live_seqs()]
        for request in engine.scheduler.running:
            for seq in request.live_seqs():
                assert len(seq.block_table) * bs - seq.num_computed_tokens <= bs - 1
        assert engine.block_manager.num_used_blocks == len({b for t in tables for b in t})
    assert steps > 5
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n4_holds_prompt_blocks_once_with_ref_count_4(llama):
    llm = llama.llm(block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompt = list(range(10, 42))  # 32 tokens = two full blocks
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=5))
    engine.step()  # prefill, then fork into 4
    request = engine.requests["r"]
    assert len(request.seqs) == 4
    tables = {tuple(s.block_table) for s in request.seqs}
    assert len(tables) == 1
    assert [engine.block_manager.blocks[b].ref_count for b in tables.pop()] == [4, 4]
    assert engine.block_manager.num_used_blocks == 2
    assert engine.stats().num_shared_blocks == 2
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_copy_on_write_is_observed_and_both_branches_are_right(llama):
    """Prompt of 21 tokens (block 16: one partial block shared by both branches after the fork).
    Each branch's chosen-token logprobs must equal transformers run on that branch's own tokens,
    which fails if a branch read the other's KV or a stale copy."""
    llm = llama.llm(block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    copies = []
    original = engine.runner.copy_blocks

    def spy(pairs):  # records the copy-on-write pairs, then copies for real
        copies.extend(pairs)
        original(pairs)

    engine.runner.copy_blocks = spy
    prompt = list(range(20, 41))
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    assert len(copies) == 1  # one writer copied, the other wrote in place
    branches = [o.token_ids for o in out.outputs]
    assert branches[0] != branches[1]
    for output in out.outputs:
        with torch.inference_mode():
            logits = llama.hf_model(torch.tensor([prompt + output.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            assert entry[token] == pytest.approx(reference[step, token].item(), abs=1e-4)
    assert engine.block_manager.num_used_blocks == 0


def test_block_arithmetic_lives_in_the_block_manager():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    # one sequence: its whole length; n sequences: the prompt once, each tail plus a copied partial block
    assert bm.blocks_for_request(prompt_len=6, max_total=10, num_seqs=1) == 3
    assert bm.blocks_for_request(prompt_len=6, max_total=10, num_seqs=3) == 2 + 3 * (1 + 1)
    seq = bare_seq(range(10))
    assert bm.blocks_to_admit(seq, [], end=10) == 3
