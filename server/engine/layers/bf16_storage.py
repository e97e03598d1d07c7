"""fp32 serving of a checkpoint whose weights are bf16 values (as most published checkpoints ship):
the projections, the embedding and the LM head keep those weights in bf16, which loses nothing, and
the native fp32 kernels widen them in registers (`cpu_native.widens`), so every product and sum is
the fp32 one while a decode step reads half the bytes. The norms and biases (small) stay fp32; a
step torch's GEMM computes (with AMX: fp32 past 128 rows) widens the weight for the call.
"""

from __future__ import annotations

import logging

import torch
from pagoda.kernels import cpu_native
from pagoda.server.engine.layers.embedding import LMHead, VocabEmbedding
from pagoda.server.engine.layers.linear import Linear
from torch import nn

logger = logging.getLogger(__name__)


def takes(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU whose native fp32 kernels run: where a bf16 weight is read as fast as its bytes."""
    if dtype != torch.float32 or device.type != "cpu":
        return False  # checked first: a GPU process never builds the library
    lib = cpu_native.library()
    return lib is not None and bool(lib.pagoda_has_f32_linear())


def keep_bf16_weights(model: nn.Module) -> int:
    """Stores in bf16 each fp32 weight of a projection, the embedding and the LM head whose values
    are all bf16 values; returns the bytes that frees."""
    freed = 0
    for module in model.modules():
        if not isinstance(module, (Linear, VocabEmbedding, LMHead)):
            continue
        weight = module.weight  # a tied head shares the embedding's: narrowed once, seen twice
        if weight.dtype != torch.float32:
            continue
        narrow = weight.data.to(torch.bfloat16)
        if torch.equal(narrow.float(), weight.data):
            freed += weight.numel() * (weight.element_size() - narrow.element_size())
            weight.data = narrow
    if freed:
        logger.info("weights: bf16 values kept in bf16 under fp32 (%.0f MiB less to read)", freed / 2**20)
    return freed
