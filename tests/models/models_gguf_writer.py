"""Writes a tiny HF folder as an F32 GGUF file the way llama.cpp's converter lays it out (GGUF tensor
names, q/k rows permuted for the llama architecture, byte-level BPE vocabulary in the metadata), so
the GGUF load path can be tested on families other than the embedded SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, TokenType, get_tensor_name_map
from pagoda.server.engine.loader import safetensors_weights
from transformers import AutoConfig

ARCHES = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2}


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (transformers reverses it on load)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(folder: Path, out: Path) -> Path:
    config = AutoConfig.from_pretrained(folder)
    arch = config.model_type
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    names = get_tensor_name_map(ARCHES[arch], config.num_hidden_layers)
    for hf_name, tensor in safetensors_weights(folder):
        base, _, suffix = hf_name.rpartition(".")
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute(data, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
