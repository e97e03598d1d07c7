"""The SiLU-gated MLP of the Llama family: down(silu(gate(x)) * up(x)), gate/up in one matmul."""

from __future__ import annotations

import torch
from pagoda.server.engine.layers.activation import silu_and_mul
from pagoda.server.engine.layers.linear import MergedLinear, RowParallelLinear
from pagoda.server.engine.parallel.group import SINGLE, TensorParallel
from torch import nn


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        """`intermediate_size`: this rank's share (the whole under tensor parallelism of size 1)."""
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj.stacked(x)))
