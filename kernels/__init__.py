"""Attention and KV-store kernels behind one small interface.

Cache layout (one pair per layer): ``k_cache``, ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A *slot* is ``block * block_size + offset``.

The three operations (see `interface.AttentionBackend`):
- ``store_kv(key, value, k_cache, v_cache, slot_mapping)``: write each new token's K/V into its slot;
  slot -1 marks padding and is skipped.
- ``paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)``:
  one query token per sequence, attending to its ``context_lens[i]`` cached tokens (its own included).
- ``paged_prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
  sliding_window)``: the step's new tokens of each sequence (packed, ``cu_seqlens_q`` offsets) are the
  *last* ``q_len`` positions of a sequence of ``context_lens[i]`` tokens already stored in the cache
  (earlier context from prefix-cache hits or earlier chunks included); causal.

`get_backend(name, device)` returns one: ``auto`` is Triton on CUDA and the fused CPU backend elsewhere;
``cpu``, ``torch`` (the reference) and ``triton`` name one. The engine picks it once, from
``--attention-backend``. The torch reference is the oracle the other backends are tested against.
"""

from pagoda.kernels.interface import BACKEND_NAMES, AttentionBackend, get_backend

__all__ = ["BACKEND_NAMES", "AttentionBackend", "get_backend"]
