"""The tiny model folders are real HF checkpoints: transformers loads and runs them offline."""

from __future__ import annotations

import torch
from support.tiny_models import IM_END, make_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def test_transformers_loads_and_generates(tiny_family_dir):
    _family, path = tiny_family_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert AutoConfig.from_pretrained(path).max_position_embeddings >= 256
    assert tokenizer.convert_tokens_to_ids(IM_END) in GenerationConfig.from_pretrained(path).eos_token_id
    # Unit-scale weights: logits are O(1), so a 1e-4 parity tolerance is meaningful.
    assert 0.3 < model(ids).logits.std().item() < 5


def test_same_seed_same_folder(tmp_path):
    a = make_tiny_model("qwen3", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3", tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
