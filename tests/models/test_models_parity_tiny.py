"""Our model through the paged path vs transformers on the same tiny random weights (fp32 logits).

Every position of every sequence is compared: prefill, chunked prefill after cached context, decode,
and a mixed step (prefill + decode), with block sizes 16 and 8 and scattered physical blocks.
Attention runs on the CPU backend (`--attention-backend auto` on CPU).
"""

from __future__ import annotations

import pytest
import torch
from models_paged_harness import (
    PROMPT_LENGTHS,
    PagedHarness,
    max_logits_diff,
    run_schedule,
    schedule_token_counts,
)
from pagoda.server.engine.layers.rotary import inverse_frequencies, rope_parameters
from pagoda.server.engine.loader import load_model
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4


def _random_sequences(vocab_size: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        seq: torch.randint(0, vocab_size, (count,), generator=gen).tolist()
        for seq, count in schedule_token_counts().items()
    }


@pytest.fixture(scope="module")
def family_models(tiny_family_dir):
    family, path = tiny_family_dir
    ours = load_model(path, dtype="float32")  # parity is measured in fp32
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    reference.eval()
    return family, ours, reference


def _reference_logits(reference, sequences: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {seq: reference(torch.tensor([ids])).logits[0].float() for seq, ids in sequences.items()}


@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_logits_match_transformers(family_models, block_size):
    family, ours, reference = family_models
    sequences = _random_sequences(ours.hf_config.vocab_size, seed=block_size)
    expected = _reference_logits(reference, sequences)
    harness = PagedHarness(ours.model, block_size=block_size, num_blocks=64, seed=block_size)
    results = run_schedule(harness, sequences)
    assert {seq: sum(rows.shape[0] for _, rows in chunks) for seq, chunks in results.items()} == {
        seq: len(ids) for seq, ids in sequences.items()
    }
    worst = max_logits_diff(results, expected)
    print(f"{family} block_size={block_size}: max |logits diff| = {worst:.2e}")
    assert worst <= TOLERANCE


def test_mistral_sliding_window_matters(tiny_mistral_dir):
    """Without the window our logits drift from transformers' past position 8: the test above has teeth."""
    ours = load_model(tiny_mistral_dir, dtype="float32")
    assert set(ours.model.cfg.sliding_windows) == {8}
    assert PROMPT_LENGTHS["c"] > 8
    reference = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()
    sequences = _random_sequences(ours.hf_config.vocab_size, seed=1)
    expected = _reference_logits(reference, sequences)
    for layer in ours.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    results = run_schedule(PagedHarness(ours.model, block_size=8, num_blocks=64), sequences)
    assert max_logits_diff(results, expected) > 1e-2


def test_llama3_rope_scaling_changes_low_frequencies(tiny_llama3_dir):
    params = rope_parameters(load_model(tiny_llama3_dir).hf_config)
    scaled = inverse_frequencies(params, 16)
    plain = inverse_frequencies({**params, "rope_type": "default"}, 16)
    assert torch.equal(scaled[0], plain[0])  # highest frequency kept
    assert torch.allclose(scaled[-1], plain[-1] / params["factor"])  # lowest divided by factor
