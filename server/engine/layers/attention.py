"""Attention over the paged KV cache, through the kernels backend (`pagoda.kernels`).

Each step stores the new tokens' K/V into their cache slots, then runs prefill attention on the
step's first ``num_prefill_tokens`` tokens and decode attention (one token per sequence) on the rest;
both read K/V from the cache through the block tables. The kernels backend is chosen once by the
model runner (`EngineArgs.attention_backend`) and handed to every layer with `use_backend`.
"""

from __future__ import annotations

import torch
from pagoda.kernels import AttentionBackend
from pagoda.server.engine.attention_metadata import AttentionMetadata
from torch import nn


def use_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` runs on `backend`."""
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.backend = backend


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
        self.backend: AttentionBackend | None = None  # set by `use_backend`

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        backend = self.backend
        if backend is None:
            raise RuntimeError("no attention backend: the model runner hands one to the layers (use_backend)")
        k_cache, v_cache = kv_cache
        meta = attn_metadata
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_prefill = meta.num_prefill_tokens
        num_decode = 0 if meta.decode_context_lens is None else meta.decode_context_lens.shape[0]
        if num_prefill + num_decode == q.shape[0] and not (num_prefill and num_decode):
            # Only prefill or only decode tokens (most steps): the backend's output as it is.
            return (
                self._prefill(backend, q, kv_cache, meta)
                if num_prefill
                else self._decode(backend, q, kv_cache, meta)
            )
        out = torch.zeros_like(q)  # rows past the prefill and decode tokens are padding
        if num_prefill:
            out[:num_prefill] = self._prefill(backend, q[:num_prefill], kv_cache, meta)
        if num_decode:
            out[num_prefill : num_prefill + num_decode] = self._decode(
                backend, q[num_prefill : num_prefill + num_decode], kv_cache, meta
            )
        return out

    def _prefill(self, backend: AttentionBackend, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return backend.paged_prefill_attention(
            q,
            *kv_cache,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            self.scale,
            self.sliding_window,
            step_cache=meta.step_cache,
        )

    def _decode(self, backend: AttentionBackend, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return backend.paged_decode_attention(
            q, *kv_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, self.sliding_window,
            step_cache=meta.step_cache,
        )
