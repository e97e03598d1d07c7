"""The one interface the engine calls for attention and KV stores, and how a backend is chosen."""

from __future__ import annotations

import functools
import os
from typing import Protocol

import torch


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    ) -> None: ...

    def paged_decode_attention(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, unused entries any value
        context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the current one
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...  # [num_seqs, num_heads, head_dim]

    def paged_prefill_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
        context_lens: torch.Tensor,  # [num_seqs] int32, total tokens in cache per sequence
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def get_backend(device: torch.device | str | None = None) -> AttentionBackend:
    """Triton on CUDA, the fused CPU backend elsewhere; PAGODA_ATTENTION_BACKEND overrides (``torch``
    is the op-by-op reference, the oracle of both). One instance per choice, shared by every layer
    (the CPU backend works out a step's decode plan once for all of them)."""
    choice = os.environ.get("PAGODA_ATTENTION_BACKEND", "").strip().lower()
    if not choice:
        choice = "triton" if torch.device(device or "cpu").type == "cuda" else "cpu"
    return _backend(choice)


@functools.cache
def _backend(choice: str) -> AttentionBackend:
    if choice == "cpu":
        from pagoda.kernels.cpu_backend import CpuBackend

        return CpuBackend()
    if choice == "torch":
        from pagoda.kernels.reference import TorchReferenceBackend

        return TorchReferenceBackend()
    if choice == "triton":
        from pagoda.kernels.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"PAGODA_ATTENTION_BACKEND must be 'cpu', 'torch' or 'triton', got {choice!r}")
