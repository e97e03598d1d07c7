"""Torch reference implementations: the CPU path and the oracle for the Triton kernels.

Keys and values are read from the paged cache through the block tables (a batched gather), never
from a per-sequence contiguous cache kept on the side.
"""

from __future__ import annotations

import torch


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, num_kv_heads, head_dim] view of one sequence's cached tokens, via its block table."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [q_len, H, D], k/v [kv_len, KVH, D]; GQA by repeating KV heads. Computes in fp32."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def _causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Query i sits at absolute position kv_len - q_len + i; it sees keys at positions <= its own."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


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
        self, query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None
    ):
        # Batched: gather every sequence's blocks at once, mask the tail past each context length.
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
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, KVH, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len].masked_fill(~visible[:, :, None, None], 0)
        compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        q = query.to(compute).view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k.to(compute).permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v.to(compute).permute(0, 2, 1, 3))  # [B, KVH, G, D]
        return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)

    def paged_prefill_attention(
        self, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window=None
    ):
        out = torch.empty_like(query)
        starts = cu_seqlens_q.tolist()
        for i, length in enumerate(context_lens.tolist()):
            start, end = starts[i], starts[i + 1]
            k = _gather_context(k_cache, block_tables[i], length)
            v = _gather_context(v_cache, block_tables[i], length)
            mask = _causal_mask(end - start, length, sliding_window, query.device)
            out[start:end] = _attend(query[start:end], k, v, scale, mask)
        return out
