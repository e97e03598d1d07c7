"""Torch reference implementations: the CPU path and the oracle for the Triton kernels.

Keys and values are read from the paged cache through the block tables (a batched gather), never
from a per-sequence contiguous cache kept on the side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, num_kv_heads, head_dim] view of one sequence's cached tokens, via its block table."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor):
    """q [q_len, H, D], k/v [kv_len, KVH, D], mask [q_len, kv_len] (True = attend). Computes in fp32
    with torch's fused attention (GQA without repeating K and V), returns q's dtype."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).to(q.dtype)


def _causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Query i sits at absolute position kv_len - q_len + i; it sees keys at positions <= its own."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _decode_padded(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window):
    """Decode attention for a batch at once: gather every sequence's blocks, mask past each length."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    # Table entries past a sequence's last block may hold any value: clamp them into range.
    tables = block_tables[:, : (max_len + block_size - 1) // block_size]
    tables = tables.clamp(min=0, max=k_cache.shape[0] - 1).long()
    positions = torch.arange(max_len, device=query.device)
    lengths = context_lens.to(query.device).long()[:, None]
    visible = positions[None, :] < lengths
    if sliding_window is not None:
        visible &= positions[None, :] >= lengths - sliding_window
    # Slots past each context may hold anything (other sequences' data, NaN). Their scores are
    # overwritten with -inf below, so K needs no cleaning; V does, since 0 * NaN is still NaN.
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    k = k_cache[tables].flatten(1, 2)[:, :max_len].to(compute)  # [B, L, KVH, D], a fresh gather
    v = v_cache[tables].flatten(1, 2)[:, :max_len].to(compute)
    v.masked_fill_(~visible[:, :, None, None], 0)
    q = query.to(compute).view(num_seqs, num_kv_heads, group, head_dim)
    masked_out = ~visible[:, None, :]
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, dtype=compute, device=query.device)
    for head in range(num_kv_heads):
        # k[:, :, head] is a strided [B, L, D] view that batched matmul reads in place (no copy).
        scores = torch.matmul(q[:, head], k[:, :, head].transpose(1, 2)) * scale  # [B, G, L]
        probs = torch.softmax(scores.masked_fill_(masked_out, float("-inf")), dim=-1)
        out[:, head] = torch.matmul(probs, v[:, :, head])
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Rows of a decode batch grouped by context length within 2x. A batch is padded to its longest
    context, so one long sequence would make every short one pay for it."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(max(length - 1, 0).bit_length(), []).append(row)
    return list(groups.values())


class TorchReferenceBackend:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, slot_mapping.long(), key.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping.long(), value.to(v_cache.dtype))

    def paged_decode_attention(
        self, query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, step_cache=None
    ):
        groups = length_groups(context_lens.tolist())
        if len(groups) == 1:
            return _decode_padded(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
        out = torch.empty_like(query)
        for rows in groups:
            index = torch.tensor(rows, device=query.device)
            out[index] = _decode_padded(
                query[index],
                k_cache,
                v_cache,
                block_tables[index],
                context_lens[index],
                scale,
                sliding_window,
            )
        return out

    def paged_prefill_attention(
        self, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window=None,
        step_cache=None,
    ):  # fmt: skip
        out = torch.empty_like(query)
        starts = cu_seqlens_q.tolist()
        for i, length in enumerate(context_lens.tolist()):
            start, end = starts[i], starts[i + 1]
            k = _gather_context(k_cache, block_tables[i], length)
            v = _gather_context(v_cache, block_tables[i], length)
            mask = _causal_mask(end - start, length, sliding_window, query.device)
            out[start:end] = _attend(query[start:end], k, v, scale, mask)
        return out
