"""CPU attention (the torch reference path) against its previous version, in one run.

    .venv/bin/python benchmarks/reference_attention_bench.py [--repeats 10]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, fp32, 16-token blocks), one
layer, 64 sequences. The baseline is the previous reference, kept here verbatim: every sequence
padded to the longest in the batch, K and V permuted into copies for the matmuls. The middle column
is today's padded batch alone (no copies), the last today's path (sequences grouped by length).
Prefill: one sequence's causal attention over its context, the previous einsum (GQA by repeating K
and V) against today's torch fused attention.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from pagoda.kernels.reference import TorchReferenceBackend, _causal_mask, _decode_padded

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
RNG = random.Random(0)
PREFILLS = [(256, 256), (1024, 1024), (2048, 2048), (256, 2048)]  # the last after 1792 cached tokens
WORKLOADS = {
    "64 x 128 (uniform)": [128] * 64,
    "63 x 128 + 1 x 4096 (one long)": [128] * 63 + [4096],
    "64 random in 16..2048": [RNG.randrange(16, 2048) for _ in range(64)],
    "64 x 2048 (uniform, long)": [2048] * 64,
}


def decode_before(query, k_cache, v_cache, block_tables, context_lens, scale):
    """The reference decode as it was before length grouping (the baseline; do not optimise)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    tables = block_tables[:, : (max_len + block_size - 1) // block_size].clamp(0, k_cache.shape[0] - 1).long()
    visible = torch.arange(max_len)[None, :] < context_lens.long()[:, None]
    k = k_cache[tables].flatten(1, 2)[:, :max_len]
    v = v_cache[tables].flatten(1, 2)[:, :max_len].masked_fill(~visible[:, :, None, None], 0)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale
    probs = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
    return torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(num_seqs, num_heads, head_dim)


def prefill_before(q, k, v, scale, mask):
    """The reference prefill attention as it was (the baseline; do not optimise)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_inputs(lengths: list[int]):
    blocks = [-(-n // BLOCK) for n in lengths]
    k = torch.randn(sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    v = torch.randn_like(k)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.arange(start, start + count)
        start += count
    query = torch.randn(len(lengths), HEADS, HEAD_DIM)
    return query, k, v, tables, torch.tensor(lengths, dtype=torch.int32), HEAD_DIM**-0.5


def median_ms(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    grouped = TorchReferenceBackend()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, one layer, median of {args.repeats}"
    )
    print("| workload | before (baseline) ms | padded batch ms | length-grouped ms | speed-up vs before |")
    print("|---|---|---|---|---|")
    for name, lengths in WORKLOADS.items():
        inputs = paged_inputs(lengths)
        expected = decode_before(*inputs)
        torch.testing.assert_close(grouped.paged_decode_attention(*inputs), expected)
        torch.testing.assert_close(_decode_padded(*inputs, None), expected)
        before = median_ms(lambda i=inputs: decode_before(*i), args.repeats)
        padded = median_ms(lambda i=inputs: _decode_padded(*i, None), args.repeats)
        now = median_ms(lambda i=inputs: grouped.paged_decode_attention(*i), args.repeats)
        print(f"| {name} | {before:.1f} | {padded:.1f} | {now:.1f} | {before / now:.2f}x |")
    print()
    print("| prefill (new tokens / context) | before (baseline) ms | now ms | speed-up vs before |")
    print("|---|---|---|---|")
    for new_tokens, context in PREFILLS:
        _, k_cache, v_cache, tables, lengths, scale = paged_inputs([context])
        query = torch.randn(new_tokens, HEADS, HEAD_DIM)
        now_args = (
            query,
            k_cache,
            v_cache,
            torch.tensor([0, new_tokens], dtype=torch.int32),
            lengths,
            tables,
            scale,
        )
        k = k_cache[tables[0].long()].flatten(0, 1)[:context]
        v = v_cache[tables[0].long()].flatten(0, 1)[:context]
        before_args = (query, k, v, scale, _causal_mask(new_tokens, context, None, query.device))
        torch.testing.assert_close(
            grouped.paged_prefill_attention(*now_args), prefill_before(*before_args), rtol=1e-4, atol=1e-5
        )
        before = median_ms(lambda a=before_args: prefill_before(*a), args.repeats)
        now = median_ms(lambda a=now_args: grouped.paged_prefill_attention(*a), args.repeats)
        print(f"| {new_tokens} / {context} | {before:.1f} | {now:.1f} | {before / now:.2f}x |")


if __name__ == "__main__":
    main()
