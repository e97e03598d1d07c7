"""Decode steps on CPU: a Llama-family model's decoder layers and its final norm in one native call.

A one-row decode step runs about 400 small ops through Python; each costs a few microseconds of
dispatch, a fifth of the step on two cores. `cpu_native.DecodeLayers` runs the same kernels in the
same order from C, so its result is the op-by-op one bit for bit (tests compare the two). It takes
steps whose every token the CPU backend attends natively: decode tokens, and a prefill (a prompt
joining a batch of decodes) the way `CpuBackend.prefill_kernel` has it, through the tiled prefill
kernel or token by token, on the native CPU attention backend, for layers without q/k norms, without
tensor parallelism, at row counts where every projection runs on a native kernel (dense, or the 4-bit
GGUF copy at few rows; not torch's GEMM or its low-bit kernels); anything else runs the layers as they
are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native
from pagoda.kernels.cpu_backend import PER_TOKEN, TILED, CpuBackend
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
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:
        """The hidden states after every layer and the final norm, or None: the caller runs the layers.
        The rotary angles come from the model's tables, looked up in the native call."""
        if not (self.enabled and hidden.device.type == "cpu"):
            return None
        layers = self._layers()
        if layers is None:
            return None
        attention = self._attention(meta, hidden.shape[0])
        if attention is None:
            return None
        prefill, tables, lens = attention
        rotary = self.model.rotary_emb
        try:
            rope = rotary.tables(hidden.dtype)
            return layers(hidden, positions, rope, meta.slot_mapping, tables, lens, kv_caches, prefill)
        except cpu_native.BeyondRopeTables:  # rare: the tables double as positions grow
            rope = rotary.tables(hidden.dtype, int(positions.max()) + 1)
            return layers(hidden, positions, rope, meta.slot_mapping, tables, lens, kv_caches, prefill)

    def _attention(
        self, meta: AttentionMetadata, rows: int
    ) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor, torch.Tensor] | None:
        """(prefill part for the tiled kernel or None, block tables, context lengths: one row per token
        the decode kernel attends) where the backend attends every token of the step natively; else
        None."""
        prefill = None
        parts = []
        if meta.num_prefill_tokens:
            attn = self._attentions[0]
            kernel = attn.backend.prefill_kernel(meta.prefill_context_lens, attn.head_dim, meta.step_cache)
            part = (meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables)
            if kernel == TILED:
                prefill = part
            elif kernel == PER_TOKEN:
                parts.append(attn.backend.per_token_rows(*part, meta.step_cache))
            else:
                return None
        if meta.decode_context_lens is not None:
            parts.append((meta.decode_block_tables, meta.decode_context_lens))
        tiled_rows = meta.num_prefill_tokens if prefill is not None else 0
        if tiled_rows + sum(lens.shape[0] for _, lens in parts) != rows:  # padding rows: the layers' business
            return None
        if not parts:  # a prefill-only step
            empty = meta.prefill_block_tables[:0]
            return prefill, empty, meta.prefill_context_lens[:0]
        if len(parts) == 1:
            return (prefill, *parts[0])
        width = max(tables.shape[1] for tables, _ in parts)  # entries past a context are never read
        tables = torch.cat([F.pad(tables, (0, width - tables.shape[1])) for tables, _ in parts])
        return prefill, tables, torch.cat([lens for _, lens in parts])

    def _layers(self) -> cpu_native.DecodeLayers | None:
        """Built once per attention backend, set of low-bit weights and weight storage (tests swap the
        first two; a model moved or cast gets new tensors, whose addresses the call must read anew).
        The low-bit copies are submodules: reading 100+ of them a step took 0.2-0.3 ms, so their
        assignments are counted instead (`Linear.low_bit_assignments`)."""
        backends = tuple(attention.backend for attention in self._attentions)
        storage = (self._linears[0].weight.data_ptr(), self._linears[-1].weight.data_ptr())
        # The backends themselves, not their ids: a freed one's id can come back as a new backend's.
        key = (*backends, Linear.low_bit_assignments, *storage)
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
            and cpu_native.has_vector_kernels()
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
        attn, eps = first.attn, self.model.layers[0].input_layernorm.eps
        if self.model.norm.eps != eps:  # the native call norms the output with the layers' eps
            return None
        return cpu_native.DecodeLayers(
            weights, self.model.norm.weight, attn.num_heads, attn.num_kv_heads, eps, attn.scale
        )
