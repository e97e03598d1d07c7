"""Decode steps on CPU: a Llama-family model's decoder layers in one native call.

A one-row decode step runs about 400 small ops through Python; each costs a few microseconds of
dispatch, a fifth of the step on two cores. `cpu_native.DecodeLayers` runs the same kernels in the
same order from C, so its result is the op-by-op one bit for bit (tests compare the two). It takes
steps of decode tokens only, on the native CPU attention backend, for layers without q/k norms,
without tensor parallelism, at row counts where every projection runs on a native kernel (dense,
or the 4-bit GGUF copy at few rows; not torch's GEMM or its low-bit kernels); anything else runs
the layers as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pagoda.kernels import cpu_native
from pagoda.kernels.cpu_backend import CpuBackend
from pagoda.server.engine.attention_metadata import AttentionMetadata
from pagoda.server.engine.layers.linear import Linear

if TYPE_CHECKING:
    from pagoda.server.engine.models.llama import LlamaModel


class NativeDecode:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.enabled = True  # False: always the layers op by op (tests compare the two)
        self._built: tuple[tuple, cpu_native.DecodeLayers | None] | None = None
        self._linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
        self._attentions = [layer.self_attn.attn for layer in model.layers]

    def __call__(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, or None: the caller runs the layers."""
        rows = hidden.shape[0]
        decode_only = (
            meta.num_prefill_tokens == 0
            and meta.decode_context_lens is not None
            and meta.decode_context_lens.shape[0] == rows
        )
        if not (self.enabled and decode_only and hidden.device.type == "cpu"):
            return None
        layers = self._layers()
        if layers is None:
            return None
        cos, sin = rope
        return layers(
            hidden, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, kv_caches
        )

    def _layers(self) -> cpu_native.DecodeLayers | None:
        """Built once per attention backend, set of low-bit weights and weight storage (tests swap the
        first two; a model moved or cast gets new tensors, whose addresses the call must read anew)."""
        backends = tuple(attention.backend for attention in self._attentions)
        storage = (self._linears[0].weight.data_ptr(), self._linears[-1].weight.data_ptr())
        key = (*map(id, backends), *(id(linear.low_bit) for linear in self._linears), *storage)
        if self._built is None or self._built[0] != key:
            self._built = (key, self._build(backends))
        return self._built[1]

    def _build(self, backends) -> cpu_native.DecodeLayers | None:
        first = self.model.layers[0].self_attn
        eligible = (
            all(isinstance(b, CpuBackend) and b.native for b in backends)
            and not first.qk_norm
            and first.o_proj.tp.size == 1
            and first.qkv_proj.weight.dtype in cpu_native.DTYPES
            and first.qkv_proj.weight.device.type == "cpu"
            and cpu_native.has_avx512()
        )
        if not eligible:
            return None
        weights = [
            cpu_native.DecoderLayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=layer.self_attn.qkv_proj.native_projection(),
                o=layer.self_attn.o_proj.native_projection(),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=layer.mlp.gate_up_proj.native_projection(),
                down=layer.mlp.down_proj.native_projection(),
                sliding_window=layer.self_attn.attn.sliding_window,
            )
            for layer in self.model.layers
        ]
        attn = first.attn
        return cpu_native.DecodeLayers(
            weights, attn.num_heads, attn.num_kv_heads, self.model.layers[0].input_layernorm.eps, attn.scale
        )
