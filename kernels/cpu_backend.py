"""The CPU attention backend: decode through the native kernel (`cpu_native.c`) where it builds, else one
fused attention call per layer and length group, in the model dtype. Prefill goes through the native
tiled kernel (a tile of tokens per K/V read; AVX-512); elsewhere a short one (a prompt or two joining
a batch of decodes) through the decode kernel, each new token as a decode query that sees its
sequence up to itself, and a long one through torch's flash attention, a call a sequence.
`prefill_kernel` is that rule, for this backend and the fused native decode layers.

The reference (`reference.py`) spells attention out op by op in fp32, per KV head; it stays the oracle.
This backend does the same in far fewer torch calls, which is what a CPU step pays for at serving
batch sizes: one gather of the blocks a group of sequences holds, then torch's fused attention
(`scaled_dot_product_attention`: flash attention on CPU, fp32 accumulation for bf16, GQA without
repeating K and V) reading K/V through strided views. What only depends on the step (length groups,
block indices, masks) is worked out once per step, kept in the step's `step_cache` (the attention
metadata's), and reused by every layer. Prefill of a prompt with
nothing cached attends causally without a mask.

Contract beyond the interface's: cache slots a sequence does not own hold finite values. Their scores
are masked, so any finite K/V there meets a zero probability; a NaN would not. The engine's pool is
zeroed when allocated and only ever holds K/V the model wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native
from pagoda.kernels.reference import TorchReferenceBackend, length_groups

# How the native kernels attend a prefill part (`CpuBackend.prefill_kernel`). The tiled kernel
# (`cpu_native.prefill_attention`) reads a context once a tile of queries: at 512-2,047 tokens 2.1-3.3x
# flash in bf16, 1.6-2.1x in fp32, and 1.3-2.2x the per-token kernel from 32 new tokens (level below;
# Zen 5, 2 cores). Without it (AVX2; heads not in whole vectors), prefills whose sequences are all at most
# PER_TOKEN_PREFILL_CONTEXT long attend token by token in the decode kernel, one call for all of them:
# as fast as flash for one prompt of up to 256 tokens, 1.3-1.9x for several (flash costs a call a
# sequence); longer ones go to flash (a 64-token chunk after 448 cached: 1.5-1.7x the per-token kernel).
# Either native way, the fused decode layers take a step that mixes the prefill with decodes.
TILED, PER_TOKEN = "tiled", "per-token"
PER_TOKEN_PREFILL_CONTEXT = 256


def prefill_as_decode(
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables, context lengths) with one row per new token of the prefill: its sequence's table
    and, causally, the context up to and including itself."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tables = block_tables.repeat_interleave(q_lens, dim=0)
    first = cu_seqlens_q[:-1].long().repeat_interleave(q_lens)  # row of each token's first sibling
    offsets = torch.arange(tables.shape[0], device=tables.device) - first
    lens = (context_lens.long() - q_lens).repeat_interleave(q_lens) + offsets + 1
    return tables, lens.to(torch.int32)


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # rows of the batch in this group (None: the whole batch)
    blocks: torch.Tensor  # [num_seqs * width_blocks] physical blocks to gather, table order
    width: int  # tokens gathered per sequence (whole blocks)
    visible: torch.Tensor  # [num_seqs, 1, 1, width] True where the query sees the key


def _decode_group(rows, block_tables, context_lens, block_size, num_blocks, sliding_window) -> _DecodeGroup:
    width_blocks = -(-int(context_lens.max()) // block_size)
    # Table entries past a sequence's last block may hold any value: clamp them into range.
    blocks = block_tables[:, :width_blocks].clamp(0, num_blocks - 1).long().flatten()
    width = width_blocks * block_size
    positions = torch.arange(width, device=context_lens.device)[None, :]
    lengths = context_lens.long()[:, None]
    visible = positions < lengths
    if sliding_window is not None:
        visible &= positions >= lengths - sliding_window
    return _DecodeGroup(rows, blocks, width, visible[:, None, None, :])


class CpuBackend(TorchReferenceBackend):
    """store_kv and decode are native where the kernels build (else the reference's index_copy and
    a fused attention call); prefill is fused."""

    name = "cpu"

    def __init__(self, native: bool = True) -> None:
        self.native = native  # False: torch's ops only (tests check both paths)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        if not (self.native and cpu_native.store_kv(key, value, k_cache, v_cache, slot_mapping)):
            super().store_kv(key, value, k_cache, v_cache, slot_mapping)

    def _decode_plan(self, block_tables, context_lens, k_cache, sliding_window, step_cache) -> list[_DecodeGroup]:
        """Worked out once per step (kept in the step's `step_cache`) and reused by every layer with the
        same window and cache shape."""
        key = ("cpu_decode_plan", tuple(k_cache.shape[:2]), sliding_window)
        if step_cache is not None and key in step_cache:
            return step_cache[key]
        num_blocks, block_size = k_cache.shape[:2]
        lengths = context_lens.tolist()
        # One call over the batch padded to its longest context, unless padding would more than
        # double the keys read (one long context among short ones): then groups of similar length.
        groups = [lengths] if len(lengths) * max(lengths) <= 2 * sum(lengths) else length_groups(lengths)
        if len(groups) == 1:
            plan = [_decode_group(None, block_tables, context_lens, block_size, num_blocks, sliding_window)]
        else:
            plan = []
            for rows in groups:
                index = torch.tensor(rows, device=context_lens.device)
                plan.append(
                    _decode_group(
                        index,
                        block_tables[index],
                        context_lens[index],
                        block_size,
                        num_blocks,
                        sliding_window,
                    )
                )
        if step_cache is not None:
            step_cache[key] = plan
        return plan

    def paged_decode_attention(
        self, query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, step_cache=None
    ):
        if self.native:  # reads K/V in place from the blocks: no gather, no mask
            out = cpu_native.paged_decode_attention(
                query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window
            )
            if out is not None:
                return out
        plan = self._decode_plan(block_tables, context_lens, k_cache, sliding_window, step_cache)
        num_kv_heads, head_dim = k_cache.shape[2:]
        gqa = query.shape[1] != num_kv_heads
        out = torch.empty_like(query) if len(plan) > 1 else None
        for group in plan:
            q = query if group.rows is None else query[group.rows]
            shape = (q.shape[0], group.width, num_kv_heads, head_dim)
            k = k_cache.index_select(0, group.blocks).view(shape).transpose(1, 2)  # [B, KVH, L, D]
            v = v_cache.index_select(0, group.blocks).view(shape).transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                q[:, :, None, :].to(k.dtype), k, v, attn_mask=group.visible, scale=scale, enable_gqa=gqa
            )[:, :, 0, :].to(query.dtype)
            if out is None:
                return attended
            out[group.rows] = attended
        return out

    def prefill_kernel(self, context_lens, head_dim, step_cache=None) -> str | None:
        """TILED or PER_TOKEN: the native kernel that attends a prefill part with these contexts; None:
        torch's flash attention. The one rule for this backend and the fused native decode layers."""
        if not (self.native and context_lens.device.type == "cpu"):
            return None
        if cpu_native.has_tiled_prefill(head_dim):
            return TILED
        if step_cache is not None and "cpu_prefill_short" in step_cache:
            short = step_cache["cpu_prefill_short"]
        else:
            short = int(context_lens.max()) <= PER_TOKEN_PREFILL_CONTEXT
            if step_cache is not None:
                step_cache["cpu_prefill_short"] = short
        return PER_TOKEN if short else None

    @staticmethod
    def per_token_rows(cu_seqlens_q, context_lens, block_tables, step_cache=None):
        """`prefill_as_decode` of the step's prefill part, worked out once per step."""
        if step_cache is not None and "cpu_prefill_rows" in step_cache:
            return step_cache["cpu_prefill_rows"]
        rows = prefill_as_decode(cu_seqlens_q, context_lens, block_tables)
        if step_cache is not None:
            step_cache["cpu_prefill_rows"] = rows
        return rows

    def paged_prefill_attention(
        self, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window=None,
        step_cache=None,
    ):  # fmt: skip
        kernel = self.prefill_kernel(context_lens, query.shape[-1], step_cache)
        if kernel == TILED:  # a tile of tokens per K/V row read
            out = cpu_native.prefill_attention(
                query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window
            )
            if out is not None:
                return out
        elif kernel == PER_TOKEN:
            rows = self.per_token_rows(cu_seqlens_q, context_lens, block_tables, step_cache)
            out = cpu_native.paged_decode_attention(query, k_cache, v_cache, *rows, scale, sliding_window)
            if out is not None:
                return out
        out = torch.empty_like(query)
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        gqa = query.shape[1] != num_kv_heads
        starts = cu_seqlens_q.tolist()
        for i, length in enumerate(context_lens.tolist()):
            start, end = starts[i], starts[i + 1]
            blocks = block_tables[i, : -(-length // block_size)].long()
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:length]  # [L, KVH, D]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
            q_len = end - start
            if q_len == length and sliding_window is None:
                mask, causal = None, True  # the whole sequence is new: plain causal attention
            else:
                q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
                k_pos = torch.arange(length, device=query.device)[None, :]
                mask, causal = k_pos <= q_pos, False
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = attended[0].transpose(0, 1)
        return out
