"""4-bit weights in groups along the input dim, multiplied by torch's weight-only int4 CPU kernel.

Each group of `group_size` input weights of an output row has a scale and a zero:
``w = (q - 8) * scale + zero`` with ``q`` in 0..15 (the kernel's convention). GGUF's Q4_0
(``w = d * (q - 8)``) and Q4_1 (``w = d * q + m``) blocks of 32 are exactly this form, so a GGUF
model runs on its own 4-bit numbers instead of a dequantized copy 4-8x the size.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel supports


class Int4Weight(nn.Module):
    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """q: [out, in] integers 0..15; scales, zeros: [out, in / group_size]; dtype: the activations'."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        if self.group_size not in GROUP_SIZES or self.group_size * scales.shape[1] != self.in_features:
            raise ValueError(f"int4 groups of {self.in_features / scales.shape[1]} weights are not supported")
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # [in / group_size, out, 2]: the layout the kernel reads.
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The dense [out, in] weight these groups stand for (tests, and the accuracy measurements)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return self.matmul(eye, None).t()
