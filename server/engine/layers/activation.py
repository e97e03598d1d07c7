"""SiLU-gated activation: silu(gate) * up, of the gate and up projections side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * inter] (gate first) -> [..., inter]: one native call on CPU where it runs."""
    native = cpu_native.silu_and_mul(gate_up)
    if native is not None:
        return native
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
