"""KV store: copy each new token's K and V rows into its cache slot (slot -1 = padding, skipped)."""

import torch
import triton
import triton.language as tl
from pagoda.kernels.triton_common import pow2_at_least


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all of its KV heads at once ([heads, head_dim] tile).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, KV_HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    k_dst = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kct
        + h[:, None] * stride_kch
        + d[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vct
        + h[:, None] * stride_vch
        + d[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=pow2_at_least(num_kv_heads, 1),
        HEAD_DIM_PAD=pow2_at_least(head_dim, 1),
        BLOCK_SIZE=k_cache.shape[1],
    )
