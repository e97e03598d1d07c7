"""The embedded SmolLM2-135M-Instruct GGUF: our loader's weights are transformers' own dequantized
weights, bit for bit, and our paged model's logits match transformers' at every position.

Tolerance 3e-4 (not the tiny models' 1e-4): with |logits| up to ~36 after 30 layers, float32 rounding
alone moves logits by ~1e-4, depending on how rows are batched into each matmul. Measured here:
transformers' sdpa vs its own eager attention differ by up to 1.3e-4; over the schedule our worst row
is 1.26e-4 from eager (1.9e-4 while our prefill attention was an einsum; torch's fused attention
rounds less). A real bug (rope, mask, a wrong weight) moves logits by >1e-2.
"""

from __future__ import annotations

import pytest
import torch
from models_paged_harness import PagedHarness, max_logits_diff, run_schedule, schedule_token_counts
from pagoda.server.engine.loader import load_model, resolve_model_source
from transformers import AutoModelForCausalLM

TOLERANCE = 3e-4
TEXTS = {
    "a": "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
    "b": "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "c": "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
    "to anyone who would listen. Every evening the children gathered around him to hear about storms, "
    "sea monsters and the lighthouse keeper's daughter.",
    "d": "Hi",
}


@pytest.fixture(scope="module")
def smollm2():
    ours = load_model(None, dtype="float32")  # parity is measured in fp32
    source = resolve_model_source(None)
    reference = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, reference


@pytest.fixture(scope="module")
def sequences_and_reference(smollm2):
    ours, reference = smollm2
    sequences = _sequences(ours.tokenizer)
    with torch.no_grad():
        expected = {seq: reference(torch.tensor([ids])).logits[0].float() for seq, ids in sequences.items()}
    return sequences, expected


def _sequences(tokenizer) -> dict[str, list[int]]:
    """Each text's tokens, repeated to the length the schedule feeds (prompt + continuation)."""
    out = {}
    for seq, count in schedule_token_counts().items():
        ids = tokenizer(TEXTS[seq])["input_ids"]
        out[seq] = (ids * (count // len(ids) + 1))[:count]
    return out


def test_weights_are_transformers_dequantized_weights(smollm2):
    ours, reference = smollm2
    targets = ours.model.checkpoint_targets()
    state = reference.state_dict()
    assert set(targets) == set(state) - {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(targets[name], state[name]) for name in targets)
    ignore = {"_name_or_path", "architectures", "dtype", "quantization_config"}  # set by the load itself
    ours_config = {k: v for k, v in ours.hf_config.to_dict().items() if k not in ignore}
    assert ours_config == {k: v for k, v in reference.config.to_dict().items() if k not in ignore}
    assert ours.hf_config.architectures == ["LlamaForCausalLM"]
    assert ours.name == "SmolLM2-135M-Instruct"
    assert ours.max_model_len == 8192
    assert ours.eos_token_ids == {ours.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    chat = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_logits_match_transformers(smollm2, sequences_and_reference, block_size):
    ours, _ = smollm2
    sequences, expected = sequences_and_reference
    results = run_schedule(PagedHarness(ours.model, block_size=block_size, num_blocks=64), sequences)
    worst = max_logits_diff(results, expected)
    print(f"SmolLM2 block_size={block_size}: max |logits diff| = {worst:.2e}")
    assert worst <= TOLERANCE


def test_greedy_decode_matches_transformers_generate(smollm2):
    ours, reference = smollm2
    prompt = ours.tokenizer("The capital of France is")["input_ids"]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    harness = PagedHarness(ours.model, block_size=16, num_blocks=8)
    logits = harness.step({"s": prompt}, {})["s"][-1]
    tokens = []
    for _ in range(8):
        tokens.append(int(logits.argmax()))
        logits = harness.step({}, {"s": tokens[-1]})["s"][-1]
    assert tokens == expected.tolist()
    assert "Paris" in ours.tokenizer.decode(tokens)
