"""Engine test fixtures: tiny models of each family and SmolLM2, each loaded once per session.

Our engine and the transformers reference load the same weights; tests build engines on an
already loaded model (`loaded=`) so each test pays only for its KV pool.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.server.engine.llm import LLM
from support.tiny_models import tiny_model_dir


class ModelPair:
    """Our loaded model and the transformers model on the same weights."""

    def __init__(self, loaded, hf_model, tokenizer):
        self.loaded = loaded
        self.hf_model = hf_model
        self.tokenizer = tokenizer

    def llm(self, **engine_args) -> LLM:
        engine_args.setdefault("kv_cache_memory", 64 << 20)
        return LLM(loaded=self.loaded, device="cpu", **engine_args)

    @torch.inference_mode()
    def hf_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        return out[0, len(prompt_ids) :].tolist()


def _pair(source, gguf_file: str | None = None) -> ModelPair:
    from pagoda.server.engine.loader import load_model
    from transformers import AutoModelForCausalLM

    loaded = load_model(source, dtype="float32", device="cpu")
    if gguf_file:
        hf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=gguf_file, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return ModelPair(loaded, hf.eval(), loaded.tokenizer)


_cache: dict[str, ModelPair] = {}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(family) -> ModelPair, built and loaded once per session."""

    def get(family: str) -> ModelPair:
        if family not in _cache:
            _cache[family] = _pair(tiny_model_dir(family, tmp_path_factory))
        return _cache[family]

    return get


@pytest.fixture(scope="session")
def llama(tiny) -> ModelPair:
    return tiny("llama")


@pytest.fixture(scope="session")
def smollm2() -> ModelPair:
    from pagoda.server.engine.loader import default_gguf_path

    if "smollm2" not in _cache:
        path = default_gguf_path()
        _cache["smollm2"] = _pair(path, gguf_file=path.name)
    return _cache["smollm2"]
