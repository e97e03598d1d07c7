"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in the model dtype, returned as fp32 (what transformers' generate compares on)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.weight = (
            tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
