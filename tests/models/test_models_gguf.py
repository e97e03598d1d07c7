"""The GGUF path on tiny llama and qwen2 files (F32, written here like llama.cpp's converter does):
our loader gives exactly the HF folder's weights and transformers' own GGUF weights, and AutoTokenizer's
tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from models_gguf_writer import write_gguf
from pagoda.server.engine.loader import load_model
from support.tiny_models import tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_loads_the_folder_weights(family, tmp_path, tmp_path_factory):
    folder = tiny_model_dir(family, tmp_path_factory)
    gguf = write_gguf(folder, tmp_path / f"tiny-{family}.F32.gguf")
    from_folder, from_gguf = load_model(folder, dtype="float32"), load_model(str(gguf), dtype="float32")
    assert from_gguf.name == f"tiny-{family}"
    assert from_gguf.hf_config.architectures == from_folder.hf_config.architectures
    # Family switches read back from GGUF metadata (which stores eps as float32).
    gguf_cfg, folder_cfg = from_gguf.model.cfg, from_folder.model.cfg
    assert gguf_cfg.rms_norm_eps == pytest.approx(folder_cfg.rms_norm_eps, rel=1e-6)
    assert replace(gguf_cfg, rms_norm_eps=folder_cfg.rms_norm_eps) == folder_cfg
    ours, expected = from_gguf.model.checkpoint_targets(), from_folder.model.checkpoint_targets()
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in ours)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = reference.state_dict()
    assert all(torch.equal(ours[name], state[name]) for name in ours)
    assert from_gguf.tokenizer.decode(from_gguf.tokenizer("The capital")["input_ids"]) == "The capital"
    # The tokenizer is the one AutoTokenizer makes (the loader skips its second parse of the file).
    auto = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert type(from_gguf.tokenizer) is type(auto)
    assert from_gguf.tokenizer.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert from_gguf.tokenizer.special_tokens_map == auto.special_tokens_map
