"""Attention over the paged KV cache, through the kernels backend (`pagoda.kernels`).

Each step stores the new tokens' K/V into their cache slots, then runs prefill attention on the
step's first ``num_prefill_tokens`` tokens and decode attention (one token per sequence) on the rest;
both read K/V from the cache through the block tables.
"""

from __future__ import annotations

import torch
from pagoda.kernels import AttentionBackend, get_backend
from pagoda.server.engine.attention_metadata import AttentionMetadata
from torch import nn


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self._backend: AttentionBackend | None = None
        self._backend_device: torch.device | None = None

    def backend(self, device: torch.device) -> AttentionBackend:
        """Chosen on first use for the device the tensors live on (the model may be moved after init)."""
        if self._backend is None or self._backend_device != device:
            self._backend, self._backend_device = get_backend(device), device
        return self._backend

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        backend = self.backend(q.device)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        num_prefill = attn_metadata.num_prefill_tokens
        out = torch.zeros_like(q)  # rows past the prefill and decode tokens are padding
        if num_prefill:
            out[:num_prefill] = backend.paged_prefill_attention(
                q[:num_prefill],
                k_cache,
                v_cache,
                attn_metadata.prefill_cu_seqlens_q,
                attn_metadata.prefill_context_lens,
                attn_metadata.prefill_block_tables,
                self.scale,
                self.sliding_window,
            )
        if attn_metadata.decode_context_lens is not None:
            end = num_prefill + attn_metadata.decode_context_lens.shape[0]
            out[num_prefill:end] = backend.paged_decode_attention(
                q[num_prefill:end],
                k_cache,
                v_cache,
                attn_metadata.decode_block_tables,
                attn_metadata.decode_context_lens,
                self.scale,
                self.sliding_window,
            )
        return out
