"""Random paged-KV batches for checking kernels against the reference (tests and `bench`).

The cache is built the way a real engine leaves it, with the traps a kernel must avoid: physical
blocks in random order, every slot no sequence owns poisoned with NaN (also the tail of each last
block), block-table entries past a sequence's last block holding out-of-range garbage, and optionally
the first blocks of every sequence shared with sequence 0 (a ref-counted prefix-cache hit).
"""

from dataclasses import dataclass

import torch

# Written into block-table entries no sequence uses: a kernel that reads through them faults or NaNs.
GARBAGE_BLOCK = 2**30


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    shared_blocks: int = 0,
    spare_blocks: int = 3,
    poison: bool | float = True,
    generator: torch.Generator | None = None,
) -> PagedKV:
    """Cache holding ``context_lens[i]`` random tokens per sequence; ``shared_blocks`` leading blocks
    of every sequence are sequence 0's physical blocks (each sequence must be longer than them)."""
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    if shared_blocks and any(length <= shared_blocks * block_size for length in context_lens):
        raise ValueError("every sequence must extend past its shared blocks")
    owned = sum(blocks_per_seq) - shared_blocks * (len(context_lens) - 1)
    num_blocks = owned + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()

    tables = torch.full((len(context_lens), max(blocks_per_seq)), GARBAGE_BLOCK, dtype=torch.int32)
    next_free = 0
    for seq, count in enumerate(blocks_per_seq):
        first_owned = shared_blocks if seq > 0 else 0
        tables[seq, :first_owned] = tables[0, :first_owned]
        tables[seq, first_owned:count] = torch.tensor(order[next_free : next_free + count - first_owned])
        next_free += count - first_owned

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # True: NaN; a number: that finite garbage (for kernels whose contract is a finite pool); False: 0.
    fill = float("nan") if poison is True else float(poison)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    for seq, length in enumerate(context_lens):
        positions = torch.arange(length)
        slots = tables[seq, positions // block_size].long() * block_size + positions % block_size
        # Shared slots get rewritten with fresh values: still one consistent value per slot.
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = _randn(
            (length, num_kv_heads, head_dim), generator, dtype
        )
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = _randn(
            (length, num_kv_heads, head_dim), generator, dtype
        )
    return PagedKV(
        k_cache.to(device),
        v_cache.to(device),
        tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def random_queries(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    return _randn((num_tokens, num_heads, head_dim), generator, dtype).to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp32 (NaN anywhere gives NaN, which fails any bound)."""
    diff = (actual.float() - expected.float()).norm()
    return float(diff / expected.float().norm())


def tolerance(dtype: torch.dtype) -> float:
    """The accuracy each kernel must meet against the reference."""
    return 1e-3 if dtype == torch.float32 else 1e-2


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def latin_square(
    block_sizes: list[int], groups: list[int], dtypes: list[torch.dtype]
) -> list[tuple[int, int, torch.dtype]]:
    """Every (block size, GQA group) pair once, with the dtype cycling so that with three of each,
    every pair of the three factors appears: a third of the full product's cost."""
    return [
        (block_size, group, dtypes[(i + j) % len(dtypes)])
        for i, block_size in enumerate(block_sizes)
        for j, group in enumerate(groups)
    ]


def case_id(block_size: int, group: int, dtype: torch.dtype) -> str:
    return f"block{block_size}-group{group}-{str(dtype).removeprefix('torch.')}"
