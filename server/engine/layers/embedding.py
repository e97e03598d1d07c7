"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.server.engine.layers.quantized import Int8Weight, few_rows
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in the model dtype, returned as fp32 (what transformers' generate compares on). Like
    `Linear`, it may hold a low-bit copy of its weight for few-row steps."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = (
            tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        )
        self.low_bit: Int8Weight | None = None

    def quantize(self, low_bit: Int8Weight) -> None:
        self.low_bit = low_bit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.low_bit is not None and few_rows(hidden, self.hidden_size):
            return self.low_bit.matmul(hidden, None).float()
        return F.linear(hidden, self.weight).float()
