"""The loader: model sources, sharded safetensors, dtypes, eos ids, and clear errors on bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from models_paged_harness import PagedHarness
from pagoda.server.engine import cpu
from pagoda.server.engine.loader import (
    ModelSource,
    default_gguf_path,
    load_model,
    resolve_dtype,
    resolve_model_source,
)
from safetensors.torch import load_file, save_file
from support.tiny_models import IM_END, make_tiny_model


def _state(loaded) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in loaded.model.state_dict().items()}


def test_sharded_folder_loads_identically(tmp_path):
    single = make_tiny_model("qwen2", tmp_path / "single", seed=5)
    sharded = make_tiny_model("qwen2", tmp_path / "sharded", seed=5, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _state(load_model(single)), _state(load_model(sharded))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_hf_folder_fields(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.name == tiny_llama_dir.name
    assert loaded.max_model_len == 512
    auto = resolve_dtype("auto", torch.device("cpu"))
    assert loaded.dtype == auto and loaded.model.dtype == auto
    assert loaded.device == torch.device("cpu")
    # config's eos plus generation_config's (which adds the chat end token)
    assert loaded.eos_token_ids == {
        loaded.tokenizer.eos_token_id,
        loaded.tokenizer.convert_tokens_to_ids(IM_END),
    }
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_dtype_choice(tiny_llama_dir, monkeypatch):
    # auto on CPU follows the hardware; a CPU of each kind is stood in for by its flags.
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(cpu, "cpu_flags", lambda flag=flag: frozenset({"avx2", flag}))
        assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp8", torch.device("cpu"))
    loaded = load_model(tiny_llama_dir, dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    # rope frequencies stay fp32 whatever the weights are
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32
    # bf16 runs end to end: logits (in bf16, as transformers' head gives them) close to the fp32 model's
    prompt = list(range(3, 23))
    low = PagedHarness(loaded.model, block_size=16, num_blocks=4).step({"s": prompt}, {})["s"]
    full = PagedHarness(load_model(tiny_llama_dir, dtype="float32").model, block_size=16, num_blocks=4).step(
        {"s": prompt}, {}
    )["s"]
    assert low.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert (low.float() - full).abs().max().item() < 0.2 < full.abs().max().item()


def test_default_source_is_embedded_smollm2():
    source = resolve_model_source(None)
    assert source == ModelSource("gguf", default_gguf_path(), "SmolLM2-135M-Instruct")


def test_gguf_file_and_folder_with_one_gguf(tmp_path):
    gguf = default_gguf_path()
    assert resolve_model_source(str(gguf)).path == gguf
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "my-model.Q8_0.gguf").symlink_to(gguf)
    assert resolve_model_source(folder) == ModelSource("gguf", folder / "my-model.Q8_0.gguf", "my-model")


def test_bad_sources_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=re.escape("not a folder, a .gguf file")):
        resolve_model_source(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_source("no-such-org/no-such-model")
    with pytest.raises(ValueError, match=re.escape("no config.json and no .gguf")):
        resolve_model_source(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape("not a .gguf file")):
        resolve_model_source(tmp_path / "weights.bin")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape("2 .gguf files")):
        resolve_model_source(tmp_path)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_give_clear_errors(tiny_llama_dir, tmp_path):
    no_weights = _copy(tiny_llama_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=re.escape("no .safetensors weights")):
        load_model(no_weights)

    missing = _copy(tiny_llama_dir, tmp_path / "missing_tensor")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.self_attn\.k_proj"):
        load_model(missing)

    bad_index = _copy(tiny_llama_dir, tmp_path / "bad_index")
    (bad_index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="shards that do not exist"):
        load_model(bad_index)

    unsupported = _copy(tiny_llama_dir, tmp_path / "unsupported")
    config = json.loads((unsupported / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (unsupported / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported"):
        load_model(unsupported)


def test_hub_id_resolves_from_local_cache_only(tiny_llama_dir, tmp_path, monkeypatch):
    """`org/name` and `hf://org/name` resolve to a snapshot already in the HF cache (no network)."""
    import huggingface_hub.constants

    snapshot = tmp_path / "models--acme--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_llama_dir, snapshot)
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    for model_id in ("acme/tiny-llama", "hf://acme/tiny-llama"):
        assert resolve_model_source(model_id) == ModelSource("hf", snapshot, "tiny-llama")
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_source("acme/not-cached")
