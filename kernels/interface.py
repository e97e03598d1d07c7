"""The one interface the engine calls for attention and KV stores, and how a backend is chosen."""

from __future__ import annotations

import functools
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
        # A dict that lives for one engine step (the step's attention metadata holds it): what only
        # depends on the step can be worked out by the first layer and reused by the others.
        step_cache: dict | None = None,
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
        step_cache: dict | None = None,  # as for decode
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


BACKEND_NAMES = ("auto", "cpu", "torch", "triton")


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    """`auto`: Triton on CUDA, the fused CPU backend elsewhere; `torch` is the op-by-op reference, the
    oracle of both. The engine asks once (`EngineArgs.attention_backend`) and hands the result to its
    attention layers. One instance per choice, shared by every layer (the CPU backend works out a
    step's decode plan once for all of them)."""
    if name == "auto":
        name = "triton" if torch.device(device or "cpu").type == "cuda" else "cpu"
    return _backend(name)


@functools.cache
def _backend(name: str) -> AttentionBackend:
    if name == "cpu":
        from pagoda.kernels.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "torch":
        from pagoda.kernels.reference import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "triton":
        from pagoda.kernels.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"attention_backend: one of {', '.join(BACKEND_NAMES)}, got {name!r}")
