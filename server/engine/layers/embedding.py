"""Token embedding and the LM head (which may share the embedding's weight).

Under tensor parallelism both are vocab-parallel: a rank holds `ceil(vocab / N)` consecutive rows
(the last rank's tail is padding). The embedding looks up the ids in its range and the all-reduce
fills in the rest; the LM head's logit columns are gathered from every rank for sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.server.engine.layers.linear import project
from pagoda.server.engine.layers.quantized import Int8Weight
from pagoda.server.engine.parallel.group import SINGLE, TensorParallel
from torch import nn


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the vocabulary that rank `tp.rank` holds."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.first_row, rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class LMHead(nn.Module):
    """Logits in the model dtype, as transformers' head gives them (the sampler widens what it reads).
    Like `Linear`, it may hold a low-bit copy of its weight for few-row steps."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabEmbedding | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        rows = vocab_rows(vocab_size, tp)[1]
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(rows, hidden_size))
        self.low_bit: Int8Weight | None = None

    def quantize(self, low_bit: Int8Weight) -> None:
        self.low_bit = low_bit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden, self.weight, None, self.low_bit)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
        return logits
