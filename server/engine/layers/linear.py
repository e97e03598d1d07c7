"""Projections: one matmul each (dense, 4-bit for few-row steps, or the native CPU kernels); q/k/v and
gate/up fused into one.

Under tensor parallelism q/k/v and gate/up are column-parallel: a `MergedLinear` built with each
rank's share of the output rows (nothing to communicate); o and down are `RowParallelLinear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native
from pagoda.server.engine.layers.quantized import FEW_ROWS, Int4Weight, Int8Weight, few_rows
from pagoda.server.engine.parallel.group import SINGLE, TensorParallel
from torch import nn


class Linear(nn.Module):
    """y = x Wᵀ + b. W is a dense parameter (what checkpoints load into); `quantize` adds a low-bit
    copy of the same weight for the few-row steps where it wins (`layers/quantized.py`)."""

    # Every assignment of `low_bit`, in any layer, counts here: the fused decode layers
    # (`models/native_decode.py`) rebuild when it moves instead of reading 100+ layers' copies a step.
    low_bit_assignments = 0

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.low_bit: Int4Weight | Int8Weight | None = None

    def __setattr__(self, name: str, value) -> None:
        if name == "low_bit":
            Linear.low_bit_assignments += 1
        super().__setattr__(name, value)

    def quantize(self, low_bit: Int4Weight | Int8Weight) -> None:
        if (low_bit.out_features, low_bit.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"low-bit weight is {low_bit.out_features}x{low_bit.in_features}, "
                f"the layer {self.out_features}x{self.in_features}"
            )
        self.low_bit = low_bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.low_bit)

    def native_projection(self) -> cpu_native.Projection:
        """This layer as the fused native decode layers read it: what `project` runs, by rows."""
        low_bit = self.low_bit
        if low_bit is None:
            return cpu_native.Projection(self.weight, self.bias)
        int4 = isinstance(low_bit, Int4Weight) and low_bit.nibbles is not None
        return cpu_native.Projection(
            self.weight,
            self.bias,
            low_bit_rows=FEW_ROWS,
            nibbles=low_bit.nibbles if int4 else None,
            scales=low_bit.scales if int4 else None,
            mins=low_bit.mins if int4 else None,
            group=low_bit.group_size if int4 else 0,
        )


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low_bit: Int4Weight | Int8Weight | None,
) -> torch.Tensor:
    """x Wᵀ + b by the fastest kernel for the step's rows: the low-bit copy for few rows, else the
    native CPU kernels where they take the device, shape and dtype, else torch's GEMM."""
    if low_bit is not None and few_rows(x, weight.shape[1]):
        return low_bit.matmul(x, bias)
    y = cpu_native.linear(x, weight, bias)  # None: not a CPU step of few rows it takes
    return F.linear(x, weight.to(x.dtype), bias) if y is None else y  # bf16 storage: widened


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; one matmul, split after.

    ``shards`` maps each HF projection name (e.g. "q_proj") to its output size, in stacking order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_sizes = dict(shards)

    def shard_rows(self, shard: str) -> slice:
        """Rows of the stacked weight (and bias) that hold `shard`."""
        start = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return slice(start, start + size)
            start += size
        raise KeyError(f"no shard {shard!r} in {list(self.shard_sizes)}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.stacked(x).split(list(self.shard_sizes.values()), dim=-1)

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """The projections side by side, [..., sum of shard sizes], before the split."""
        return super().forward(x)


class RowParallelLinear(Linear):
    """y = all-reduce over ranks of x_r W_rᵀ, + b once: each rank holds the input columns that match
    the output rows of the column-parallel layer before it, so x arrives already split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
