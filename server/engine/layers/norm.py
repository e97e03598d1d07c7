"""RMSNorm, computed in fp32 and cast back exactly as transformers does (weight * normed.to(dtype)),
optionally fused with the residual add before it (the native CPU kernel where it runs, torch's ops
elsewhere)."""

from __future__ import annotations

import torch
from pagoda.kernels import cpu_native
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum the next layer adds to."""
        native = cpu_native.rms_norm(x, self.weight, self.eps, residual)
        if native is not None:
            return native[0] if residual is None else native
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)
