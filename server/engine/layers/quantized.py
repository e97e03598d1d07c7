"""Low-bit copies of weights for steps with few rows, through torch's weight-only CPU kernels.

These kernels are matrix-vector kernels: reading 2-4x fewer bytes wins while a step has a few rows
(reading the weights is the cost), and loses to a dense bf16 GEMM past that. So a layer keeps its
dense weight for big steps and uses the low-bit copy when `few_rows`.

`Int4Weight`: 4-bit groups along the input dim. Each group of `group_size` input weights of an output row has a scale and a zero:
``w = (q - 8) * scale + zero`` with ``q`` in 0..15 (the kernel's convention). GGUF's Q4_0
(``w = d * (q - 8)``) and Q4_1 (``w = d * q + m``) blocks of 32 are exactly this form, so a GGUF
model runs on its own 4-bit numbers instead of a dequantized copy 4-8x the size when a step has
few rows.

`Int8Weight`: 8 bits per weight with one scale per output row, requantized from the dense weight (for
GGUF's Q8_0 embedding / LM head, whose 32-weight block scales the int8 kernel cannot take).
"""

from __future__ import annotations

import torch
from pagoda.kernels import cpu_native
from torch import nn

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel supports
# Rows up to which the low-bit kernels beat the dense bf16 ones (SmolLM2's shapes, 2 Zen 4 cores, the
# native kernels both sides): at 1 row the 4-bit layers and the int8 LM head read a quarter and half
# of the bytes and win; from 2 rows the dense kernels, which reuse each weight across the rows, win
# (docs/benchmarks.md).
FEW_ROWS = 1


def few_rows(x: torch.Tensor, in_features: int) -> bool:
    return x.numel() <= FEW_ROWS * in_features


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
        self.dtype = dtype
        if cpu_native.has_vector_kernels():  # the native kernel: GGUF's nibble layout, fp32 scales and mins
            self.register_buffer("nibbles", cpu_native.pack_int4(q))
            self.register_buffer("scales", scales.float().contiguous())
            self.register_buffer("mins", (zeros - 8 * scales).float().contiguous())  # w = q * scale + min
            self._torch_layout = None
        else:
            self.nibbles = self.scales = self.mins = None
            self._torch_layout = self._pack_for_torch(q, scales, zeros)

    def _pack_for_torch(self, q, scales, zeros) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's weight-only int4 layout: packed q and [in / group_size, out, 2] scales and zeros."""
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        return packed, torch.stack([scales.t(), zeros.t()], dim=-1).to(self.dtype).contiguous()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.nibbles is not None:
            y = cpu_native.int4_linear(x, self.nibbles, self.scales, self.mins, self.group_size, bias)
            if y is not None:
                return y
        if self._torch_layout is None:  # an input the native kernel does not take: torch's, from the nibbles
            q = cpu_native.unpack_int4(self.nibbles)
            self._torch_layout = self._pack_for_torch(q, self.scales, self.mins + 8 * self.scales)
        packed, scales_and_zeros = self._torch_layout
        if scales_and_zeros.dtype != x.dtype:  # the kernel takes them in the activations' dtype
            scales_and_zeros = scales_and_zeros.to(x.dtype)
            self._torch_layout = packed, scales_and_zeros
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, self.group_size, scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The dense [out, in] weight these groups stand for (tests, and the accuracy measurements)."""
        if self.nibbles is None:  # torch's packed layout: through its kernel
            eye = torch.eye(self.in_features, dtype=self.dtype)
            return self.matmul(eye, None).t()
        steps = cpu_native.unpack_int4(self.nibbles) * self.scales.repeat_interleave(self.group_size, 1)
        return (steps + self.mins.repeat_interleave(self.group_size, 1)).to(self.dtype)


class Int8Weight(nn.Module):
    def __init__(self, dense: torch.Tensor, dtype: torch.dtype) -> None:
        """dense: [out, in]; each row is scaled to the int8 range by its largest magnitude."""
        super().__init__()
        self.out_features, self.in_features = dense.shape
        weight = dense.float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scales", scales.to(dtype))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = cpu_native.int8_linear(x, self.q, self.scales, bias)  # None: not one row it takes
        if y is not None:
            return y
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scales.dtype) * self.scales[:, None]
