"""What one engine step tells every attention layer: where to write K/V and what to attend to.

A step's tokens are packed as ``[prefill tokens | decode tokens]``: tokens ``[0, num_prefill_tokens)``
belong to sequences being prefilled (a whole prompt, or a chunk of one, possibly after cached
prefix blocks); the remaining tokens are one decode token per running sequence. Each attention layer
first stores the step's K/V through ``slot_mapping``, then runs prefill attention on the first part and
decode attention on the second, both reading K/V from the paged cache through the block tables
(see `pagoda.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token (-1 = padding, skipped)
    num_prefill_tokens: int
    # Prefill part (None when the step has no prefill)
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [num_prefill_seqs + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_prefill_seqs] int32, cached + new tokens
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill_seqs, max_blocks] int32
    # Decode part (None when the step has no decode)
    decode_context_lens: torch.Tensor | None = None  # [num_decode_seqs] int32, incl. the new token
    decode_block_tables: torch.Tensor | None = None  # [num_decode_seqs, max_blocks] int32
    # The kernels backend's scratch for this step (e.g. the CPU decode plan every layer shares).
    step_cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
