"""The CPU attention backend: one fused attention call per layer and length group, in the model dtype.

The reference (`reference.py`) spells attention out op by op in fp32, per KV head; it stays the oracle.
This backend does what the reference does in far fewer torch calls, which is what a CPU step pays for
at serving batch sizes: one gather of the blocks a group of sequences holds, then torch's fused
attention (`scaled_dot_product_attention`: flash attention on CPU, fp32 accumulation for bf16, GQA
without repeating K and V) reading K/V through strided views. Prefill of a prompt with nothing cached
attends causally without building a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.kernels.reference import TorchReferenceBackend, length_groups


def _visible(context_lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """[B, width] True where a decode query sees the key (inside the context and the window)."""
    positions = torch.arange(width, device=context_lens.device)[None, :]
    lengths = context_lens.long()[:, None]
    visible = positions < lengths
    if sliding_window is not None:
        visible &= positions >= lengths - sliding_window
    return visible


def _decode_group(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window):
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    width_blocks = -(-int(context_lens.max()) // block_size)
    # Table entries past a sequence's last block may hold any value: clamp them into range.
    tables = block_tables[:, :width_blocks].clamp(0, num_blocks - 1).long().flatten()
    width = width_blocks * block_size
    visible = _visible(context_lens, width, sliding_window)
    # Slots a sequence does not own (the tail of its last block, clamped entries) may hold anything,
    # NaN included, and a masked score is still NaN if its key is: zero them in the gathered copy.
    hidden = ~visible[:, :, None, None]
    k = k_cache.index_select(0, tables).view(num_seqs, width, num_kv_heads, head_dim).masked_fill_(hidden, 0)
    v = v_cache.index_select(0, tables).view(num_seqs, width, num_kv_heads, head_dim).masked_fill_(hidden, 0)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :].to(k.dtype),  # [B, H, 1, D]
        k.transpose(1, 2),  # [B, KVH, L, D] strided views: no copy
        v.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[:, :, 0, :].to(query.dtype)


class CpuBackend(TorchReferenceBackend):
    """store_kv is the reference's (one index_copy per cache); decode and prefill are fused."""

    name = "cpu"

    def paged_decode_attention(
        self, query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None
    ):
        groups = length_groups(context_lens.tolist())
        if len(groups) == 1:
            return _decode_group(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
        out = torch.empty_like(query)
        for rows in groups:
            index = torch.tensor(rows, device=query.device)
            out[index] = _decode_group(
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
        self, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window=None
    ):
        out = torch.empty_like(query)
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        gqa = query.shape[1] != num_kv_heads
        starts = cu_seqlens_q.tolist()
        for i, length in enumerate(context_lens.tolist()):
            start, end = starts[i], starts[i + 1]
            blocks = block_tables[i, : -(-length // block_size)].long()
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:length]  # [L, KVH, D]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
            q_len = end - start
            if q_len == length and sliding_window is None:
                mask, causal = None, True  # the whole sequence is new: plain causal attention
            else:
                q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
                k_pos = torch.arange(length, device=query.device)[None, :]
                mask, causal = k_pos <= q_pos, False
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = attended[0].transpose(0, 1)
        return out
