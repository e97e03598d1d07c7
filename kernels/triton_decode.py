"""Paged decode attention: one query token per sequence, K/V gathered through the block table.

Grid ``(num_seqs, num_kv_heads, num_partitions)``. A program loads the query heads that share one KV
head as a ``[GROUP_PAD, HEAD_DIM_PAD]`` tile (GROUP_PAD >= 16 so ``tl.dot`` accepts it), so each KV
head is read once for its whole group. It walks its token range in tiles of ``BLOCK_N`` tokens; each
token's row address comes from the block table (a tile may span several cache blocks, or part of
one), and keeps an online softmax in fp32.

With one partition the program writes the normalised output. With several (flash-decoding split-K)
each writes its unnormalised accumulator, running max and sum, and a reduce kernel combines them.
"""

import torch
import triton
import triton.language as tl
from pagoda.kernels.triton_common import dot, dot_precision, num_sms, pow2_at_least, upcast_dot


@triton.jit
def _decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale_log2e,
    sliding_window,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bt,
    num_heads,
    num_partitions,
    partition_size,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context_len - sliding_window, 0)
    hi = context_len
    if SPLIT:
        lo = lo + part * partition_size
        hi = tl.minimum(lo + partition_size, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        t_mask = tokens < hi
        # Entries past the sequence's last block may hold anything: never load through them.
        block = tl.load(table + tokens // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        offset = tokens % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_rows = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one visible token, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        v_rows = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial results laid out [num_seqs, num_heads, num_partitions(, head_dim)].
        row = (seq.to(tl.int64) * num_heads + heads) * num_partitions + part
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = (seq.to(tl.int64) * num_heads + heads) * HEAD_DIM
        tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    # One program per (seq, head): rescale each partition to the global max and sum.
    row = tl.program_id(0).to(tl.int64)  # seq * num_heads + head
    p = tl.arange(0, PARTITIONS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = p < num_partitions
    m = tl.load(part_max_ptr + row * num_partitions + p, mask=p_mask, other=float("-inf"))
    l_part = tl.load(part_sum_ptr + row * num_partitions + p, mask=p_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    # Empty partitions carry m = -inf, l = 0, acc = 0: their weight is exactly 0.
    weight = tl.exp2(m - m_max)
    acc = tl.load(
        part_acc_ptr + (row * num_partitions + p)[:, None] * HEAD_DIM + d[None, :],
        mask=p_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight * l_part, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_decode_partitions(
    num_seqs: int, num_kv_heads: int, max_context: int, min_partition_size: int, sms: int
) -> int:
    """Flash-decoding heuristic: split only when (seq, kv head) programs alone cannot fill the GPU.

    Aim for about four programs per SM, with partitions of at least ``min_partition_size`` tokens
    (shorter ones would spend more on the reduce than they save).
    """
    programs = num_seqs * num_kv_heads
    target = 4 * sms
    max_parts = max_context // min_partition_size
    if programs >= target or max_parts < 2:
        return 1
    return min(max_parts, triton.cdiv(target, programs))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    block_n: int = 64,
    min_partition_size: int = 512,
    num_partitions: int | None = None,
) -> torch.Tensor:
    """``num_partitions=None`` lets the heuristic choose (partitions of at least
    ``min_partition_size`` tokens); a number forces it (1 = no split)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    # The block table's width bounds every context length without a device-to-host sync.
    max_context = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)
    if num_partitions is None:
        sms = num_sms(query.device)
        num_partitions = num_decode_partitions(num_seqs, num_kv_heads, max_context, min_partition_size, sms)
    num_partitions = max(1, min(num_partitions, triton.cdiv(max_context, block_n)))
    split = num_partitions > 1
    # The partitions together must cover the longest visible context; each is a whole number of tiles.
    partition_size = triton.cdiv(triton.cdiv(max_context, num_partitions), block_n) * block_n
    if split:
        part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(*part_max.shape, head_dim, dtype=torch.float32, device=query.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    head_dim_pad = pow2_at_least(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        sliding_window or 0,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        num_heads,
        num_partitions,
        partition_size,
        GROUP=group,
        GROUP_PAD=pow2_at_least(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST_DOT=upcast_dot(query),
        num_warps=4,
    )
    if split:
        _reduce_kernel[(num_seqs * num_heads,)](
            out,
            part_acc,
            part_max,
            part_sum,
            num_partitions,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITIONS_PAD=pow2_at_least(num_partitions, 1),
            num_warps=4,
        )
    return out
