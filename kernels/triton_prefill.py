"""Paged prefill attention: variable-length causal attention for a step's new tokens.

Grid ``(num_heads, num_seqs, cdiv(max_q_len, BLOCK_M))``. Sequence ``i``'s ``q_len`` new tokens are
the last ``q_len`` of its ``context_lens[i]`` cached tokens, so query row ``r`` sits at absolute
position ``context_len - q_len + r``. A program takes ``BLOCK_M`` queries of one head and walks the
keys it may see (from the sliding-window start, or 0, up to its last query's position) in tiles of
``BLOCK_N`` tokens read from the cache through the block table: earlier context (prefix-cache hits,
previous chunks) and the new tokens alike. Online softmax in fp32; GQA by reading the query head's KV
head (``head // group``); the other heads of the group hit the same K/V lines in L2.
"""

import torch
import triton
import triton.language as tl
from pagoda.kernels.triton_common import dot, dot_precision, pow2_at_least, upcast_dot


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    start,
    hi,
    table,
    k_base,
    v_base,
    d_mask,
    scale_log2e,
    sliding_window,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N), read through the block table."""
    k_pos = start + tl.arange(0, BLOCK_N)
    offset = k_pos % BLOCK_SIZE
    if MASKED:
        k_mask = k_pos < hi
        # Entries past the sequence's last block may hold anything: never load through them.
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + (block * stride_kb + offset * stride_kt)[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_base + (block * stride_vb + offset * stride_vt)[:, None], mask=kv_mask, other=0.0)
    else:
        block = tl.load(table + k_pos // BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            k_base + (block * stride_kb + offset * stride_kt)[:, None], mask=d_mask[None, :], other=0.0
        )
        v = tl.load(
            v_base + (block * stride_vb + offset * stride_vt)[:, None], mask=d_mask[None, :], other=0.0
        )
    scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = k_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
    # A row may see nothing in a masked tile (causal/window edge): keep its exponents finite.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2e,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Heads and sequences vary fastest and query tiles run last-first, so the longest causal tiles
    # start first and the short ones fill in behind them.
    head = tl.program_id(0)
    seq = tl.program_id(1)
    q_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP
    first_pos = context_len - q_len  # absolute position of query row 0

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < q_len
    d_mask = d < HEAD_DIM
    q_pos = first_pos + rows
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys visible to some row of this tile: [lo, hi).
    hi = tl.minimum(context_len, first_pos + (q_tile + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + q_tile * BLOCK_M - sliding_window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh + d[None, :] * stride_kd
    v_base = v_cache_ptr + kv_head * stride_vh + d[None, :] * stride_vd
    # Key tiles wholly at or before the tile's first query are visible to every row: no masks there.
    # Only the tiles on the diagonal (and all of them under a sliding window) need the causal mask.
    mid = lo
    if not USE_WINDOW:
        mid = ((first_pos + q_tile * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for start in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start, hi, table, k_base, v_base, d_mask, scale_log2e, sliding_window,
            stride_kb, stride_kt, stride_vb, stride_vt,
            False, USE_WINDOW, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start, hi, table, k_base, v_base, d_mask, scale_log2e, sliding_window,
            stride_kb, stride_kt, stride_vb, stride_vt,
            True, USE_WINDOW, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    _prefill_kernel[(num_heads, num_seqs, triton.cdiv(max_q_len, block_m))](
        out,
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        sliding_window or 0,
        *query.stride(),
        out.stride(0),
        out.stride(1),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2_at_least(head_dim, 16),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST_DOT=upcast_dot(query),
        num_warps=8 if block_m >= 128 else 4,  # 128-row tiles spill registers with 4 warps (sm_90)
    )
    return out
