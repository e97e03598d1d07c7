"""Projections fused into one matmul (q/k/v, gate/up) that still load HF's separate weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """Several projections of the same input stacked along the output dim; one matmul, split after.

    ``shards`` maps each HF projection name (e.g. "q_proj") to its output size, in stacking order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shard_sizes = dict(shards)
        out_features = sum(shards.values())
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def shard_rows(self, shard: str) -> slice:
        """Rows of the stacked weight (and bias) that hold `shard`."""
        start = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return slice(start, start + size)
            start += size
        raise KeyError(f"no shard {shard!r} in {list(self.shard_sizes)}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(list(self.shard_sizes.values()), dim=-1)
