"""What `LlamaFamilyConfig.from_hf` reads off each family's config, and model-level edge cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from models_paged_harness import PagedHarness
from pagoda.server.engine.layers.rotary import MIN_TABLE_POSITIONS, RotaryEmbedding, rope_parameters
from pagoda.server.engine.loader import load_model
from pagoda.server.engine.models.llama import LlamaFamilyConfig, hf_tensor_names
from transformers import AutoConfig, GPT2Config, LlamaConfig

EXPECTED = {  # family: (qkv_bias, o_proj_bias, qk_norm, tied, num_kv_heads, head_dim, windows, rope_type)
    "llama": (False, False, False, False, 4, 16, (None, None), "default"),
    "llama3": (False, False, False, True, 2, 16, (None, None), "llama3"),
    "mistral": (False, False, False, False, 2, 16, (8, 8), "default"),
    "qwen2": (True, False, False, True, 2, 16, (None, None), "default"),
    "qwen3": (False, False, True, False, 2, 32, (None, None), "default"),
}


def test_family_switches(tiny_family_dir):
    family, path = tiny_family_dir
    cfg = LlamaFamilyConfig.from_hf(AutoConfig.from_pretrained(path))
    got = (
        cfg.qkv_bias,
        cfg.o_proj_bias,
        cfg.qk_norm,
        cfg.tie_word_embeddings,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.sliding_windows,
        cfg.rope["rope_type"],
    )
    assert got == EXPECTED[family]


def test_tensor_name_superset_covers_every_family(tiny_family_dir):
    """The GGUF name mapping is built from `hf_tensor_names`; it must cover each family's tensors."""
    _family, path = tiny_family_dir
    model = load_model(path).model
    assert set(model.checkpoint_targets()) <= set(hf_tensor_names(model.num_layers))


def test_legacy_rope_config_is_read():
    """transformers 4.x style: rope_theta + rope_scaling with the old `type` key."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = SimpleNamespace(
        rope_theta=5e5, rope_scaling={**scaling, "original_max_position_embeddings": 8192}
    )
    rope = rope_parameters(config)
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 5e5 and rope["factor"] == 8.0
    assert rope_parameters(SimpleNamespace(rope_theta=1e4)) == {"rope_theta": 1e4, "rope_type": "default"}


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LlamaFamilyConfig.from_hf(GPT2Config())
    with pytest.raises(ValueError, match="partial rotary"):
        rope_parameters(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        LlamaFamilyConfig.from_hf(
            LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
        )


def test_positions_past_max_position_embeddings_run(tiny_llama_dir):
    """The engine's memory-profiling step may feed more positions than the model's context."""
    model = load_model(tiny_llama_dir).model
    harness = PagedHarness(model, block_size=16, num_blocks=40)
    logits = harness.step({"s": [5] * 600}, {})["s"]  # max_position_embeddings is 512
    assert logits.shape[0] == 600 and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_hold_what_a_step_computes(dtype):
    """A step's cos/sin looked up in the CPU tables are the values computed for its positions, bit for
    bit (steps of up to 256 tokens), and a step past the tables grows them: to twice their size, or
    as far as the step goes."""
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e4})
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 16, 256):
        positions = torch.randint(0, 4000, (tokens,), generator=generator)
        for looked_up, computed in zip(rope(positions, dtype), rope.angles(positions, dtype), strict=True):
            assert looked_up.dtype == dtype and torch.equal(looked_up, computed)
    sizes = []
    for far in ([5, 4321], [20000]):
        far = torch.tensor(far)
        assert all(torch.equal(a, b) for a, b in zip(rope(far, dtype), rope.angles(far, dtype), strict=True))
        sizes.append(rope._tables[dtype][0].shape[0])
    assert sizes == [2 * MIN_TABLE_POSITIONS, 20001]
