"""The engine end to end on the Triton kernels (interpreter) gives the reference path's greedy tokens."""

from collections import Counter

import pytest
from pagoda.kernels.triton_backend import TritonBackend
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.loader import load_model
from pagoda.server.engine.sampling_params import SamplingParams
from support.tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _greedy_tokens(model_dir, backend: str) -> list[list[int]]:
    loaded = load_model(str(model_dir), dtype="float32", device="cpu")
    # 8-token blocks and 16-token steps: the 30-token prompt is prefilled in chunks, and the second
    # call's prompt reuses the first one's cached prefix blocks.
    llm = LLM(loaded=loaded, device="cpu", block_size=8, max_num_batched_tokens=16, kv_cache_memory=8 << 20,
              attention_backend=backend)
    prefix = list(range(10, 34))
    first = llm.generate([[*prefix, 40, 41, 42, 43, 44, 45]], GREEDY)
    second = llm.generate([[*prefix, 50, 51], [60, 61, 62]], GREEDY)
    return [out.outputs[0].token_ids for out in first + second]


@pytest.mark.parametrize("family", ["llama3", "mistral"])  # GQA + tied embeddings; sliding window 8
def test_engine_greedy_tokens_match_reference(family, tmp_path_factory, monkeypatch):
    model_dir = tiny_model_dir(family, tmp_path_factory)
    calls: Counter[str] = Counter()
    for name in ("store_kv", "paged_prefill_attention", "paged_decode_attention"):
        original = getattr(TritonBackend, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TritonBackend, name, counted)

    expected = _greedy_tokens(model_dir, "torch")
    assert not calls  # the reference run never touched the Triton kernels
    actual = _greedy_tokens(model_dir, "triton")

    assert actual == expected
    assert all(len(tokens) == 5 for tokens in actual)
    assert calls["store_kv"] and calls["paged_prefill_attention"] and calls["paged_decode_attention"]
