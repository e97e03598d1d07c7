"""`--quantization int4`: 4-bit copies made at load from a model's dense weights (an HF folder's),
for the few-row steps where low-bit kernels win (`layers/quantized.py`).

Each group of 32 input weights of an output row spans its own min..max in 16 steps, GGUF's Q4_1 rule,
so these copies run on the same native 4-bit kernel (and in the fused decode layers) as a GGUF file's
own blocks; the LM head gets an int8 copy, one scale per row. The dense weights stay for bigger steps.
"""

from __future__ import annotations

import logging

import torch
from pagoda.server.engine.layers.linear import Linear
from pagoda.server.engine.layers.quantized import Int4Weight, Int8Weight

logger = logging.getLogger(__name__)

GROUP = 32  # weights per group, as GGUF's Q4_0 / Q4_1 blocks
LEVELS = 15  # q in 0..15


def int4_groups(dense: torch.Tensor, group_size: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dense [out, in] -> (q [out, in] in 0..15, scale, zero [out, in / group_size]) with
    ``w ≈ (q - 8) * scale + zero``: each group's min and max are on its grid, every weight within half
    a step of its own."""
    out_features, in_features = dense.shape
    groups = dense.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)  # a constant group: q = 0
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, LEVELS)
    return q.to(torch.int32).reshape(out_features, in_features), scale, low + 8 * scale


def quantize_dense(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Add 4-bit copies of every decoder-layer projection whose input splits into groups, and an int8
    copy of the LM head; returns how many projections have 4-bit copies."""
    swapped = 0
    for module in model.model.layers.modules():
        if isinstance(module, Linear) and module.in_features % GROUP == 0:
            module.quantize(Int4Weight(*int4_groups(module.weight.detach()), dtype))
            swapped += 1
    model.lm_head.quantize(Int8Weight(model.lm_head.weight.detach(), dtype))
    logger.info("int4 weights for few-row steps: %d linear layers in 4 bits, the LM head in 8", swapped)
    return swapped
