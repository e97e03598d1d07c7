"""The Triton attention backend: the engine's path on CUDA (and on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import contextlib

import torch
from pagoda.kernels.triton_common import check_launchable
from pagoda.kernels.triton_decode import paged_decode_attention
from pagoda.kernels.triton_prefill import paged_prefill_attention
from pagoda.kernels.triton_store_kv import store_kv


class TritonBackend:
    """`AttentionBackend` on Triton kernels.

    The keyword arguments are tuning knobs for tests and benchmarks: tile sizes, and
    ``decode_partitions`` to force flash-decoding split-K (``None`` = heuristic, 1 = never split).
    """

    name = "triton"

    def __init__(
        self,
        *,
        decode_block_n: int = 64,
        decode_min_partition_size: int = 512,
        decode_partitions: int | None = None,
        prefill_block_m: int = 64,
        prefill_block_n: int = 64,
    ) -> None:
        self.decode_block_n = decode_block_n
        self.decode_min_partition_size = decode_min_partition_size
        self.decode_partitions = decode_partitions
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        with _on_device(key):
            store_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_decode_attention(
        self, query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, step_cache=None
    ) -> torch.Tensor:
        with _on_device(query):
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                scale,
                sliding_window,
                block_n=self.decode_block_n,
                min_partition_size=self.decode_min_partition_size,
                num_partitions=self.decode_partitions,
            )

    def paged_prefill_attention(
        self, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window=None,
        step_cache=None,
    ) -> torch.Tensor:  # fmt: skip
        with _on_device(query):
            return paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                cu_seqlens_q,
                context_lens,
                block_tables,
                scale,
                sliding_window,
                block_m=self.prefill_block_m,
                block_n=self.prefill_block_n,
            )


def _on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (multi-GPU hosts)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    check_launchable(tensor)
    return contextlib.nullcontext()
