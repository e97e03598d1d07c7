"""GGUF Q4_0 / Q4_1 tensors as `Int4Weight`s (the file's own 4-bit numbers) and a Q8_0 LM head as an
`Int8Weight`, for the few-row steps where low-bit kernels win (`layers/quantized.py`).

The model is first loaded through transformers' dequantizing reader (config, names, every tensor
dense); then each linear layer whose GGUF tensors are all Q4_0/Q4_1 also gets the file's blocks, read
through the file's tensor table alone. llama.cpp stores q/k rows permuted for its rotary layout; the
same row order transformers undoes on the dense weights is applied to the 4-bit rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from pagoda.server.engine.layers.linear import Linear, MergedLinear
from pagoda.server.engine.layers.quantized import Int4Weight, Int8Weight

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per Q4_0/Q4_1 block
INT4_TYPES = ("Q4_0", "Q4_1")
# GGUF tensor of layer i -> (our module under model.layers.i, HF shard name inside a merged module)
GGUF_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", "q_proj"),
    "attn_k": ("self_attn.qkv_proj", "k_proj"),
    "attn_v": ("self_attn.qkv_proj", "v_proj"),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", "gate_proj"),
    "ffn_up": ("mlp.gate_up_proj", "up_proj"),
    "ffn_down": ("mlp.down_proj", None),
}


def unpack_q4_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw: [rows, bytes per row] of Q4_0/Q4_1 blocks -> (q [rows, cols] 0..15, scale, zero
    [rows, cols / 32], fp32) with ``w = (q - 8) * scale + zero``."""
    rows = raw.shape[0]
    header = 2 if kind == "Q4_0" else 4  # fp16 d (Q4_0), fp16 d and m (Q4_1)
    blocks = raw.reshape(rows, -1, header + BLOCK // 2)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[:, :, header:]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    if kind == "Q4_0":  # w = d * (q - 8)
        zero = np.zeros_like(d)
    else:  # w = d * q + m = d * (q - 8) + (m + 8 d)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


def _file_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (ggml type name, its raw data)}, a block type's data as [rows, bytes per row], none of
    it read yet. transformers' header reader takes ~0.4 s on SmolLM2's file; gguf's GGUFReader, the
    fallback for older transformers, ~2.2 s (it parses every metadata string: the vocabulary, the merges)."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

        header = GgufHeader.from_file(str(path))
    except (ImportError, ValueError):  # older transformers, or a tensor type its reader does not take
        return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in GGUFReader(str(path)).tensors}
    found = {}
    for name, tensor in load_gguf_state_dict(header).items():
        kind = GGMLQuantizationType(tensor.ggml_type).name
        found[name] = (kind, tensor.data.reshape(tensor.shape) if kind in INT4_TYPES else tensor.data)
    return found


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' `_reverse_permute_weights`)."""
    dim = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, dim, 2).swapaxes(2, 1).reshape(num_rows)


def quantize_from_gguf(model: torch.nn.Module, path: Path, dtype: torch.dtype) -> int:
    """Add the GGUF file's low-bit weights beside the dense ones; returns how many linear layers
    have 4-bit weights."""
    cfg = model.cfg
    tensors = _file_tensors(path)
    modules = dict(model.named_modules())
    by_module: dict[str, list[tuple[str | None, str]]] = {}  # our module -> its (shard, GGUF name)s
    for gguf_name, (module_name, shard) in GGUF_LINEARS.items():
        by_module.setdefault(module_name, []).append((shard, gguf_name))
    swapped = 0
    for layer in range(cfg.num_layers):
        for module_name, parts in by_module.items():
            shards = [(shard, f"blk.{layer}.{gguf_name}.weight") for shard, gguf_name in parts]
            found = [tensors.get(name) for _, name in shards]
            if any(t is None or t[0] not in INT4_TYPES for t in found):
                continue  # some part is not 4-bit in this file: the layer stays dense
            module = modules[f"model.layers.{layer}.{module_name}"]
            q, scale, zero = _stack(module, shards, found, cfg)
            module.quantize(Int4Weight(q, scale, zero, dtype))
            swapped += 1
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")  # untied, else tied
    if head is not None and head[0] == "Q8_0":  # one-row steps read half of bf16's bytes
        model.lm_head.quantize(Int8Weight(model.lm_head.weight.detach(), dtype))
    logger.info("GGUF low-bit weights for few-row steps: %d linear layers in 4 bits", swapped)
    return swapped


def _stack(module: Linear, shards, found, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, zero) of every shard of `module`, in its stacking order."""
    by_shard = {}
    for (shard, name), (kind, rows) in zip(shards, found, strict=True):
        q, scale, zero = unpack_q4_blocks(rows, kind)
        if ".attn_q." in name or ".attn_k." in name:
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            order = torch.from_numpy(_unpermute_rows(q.shape[0], heads))
            q, scale, zero = q[order], scale[order], zero[order]
        by_shard[shard] = (q, scale, zero)
    order = list(module.shard_sizes) if isinstance(module, MergedLinear) else [None]
    return tuple(torch.cat([by_shard[shard][i] for shard in order]) for i in range(3))
