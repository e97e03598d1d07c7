import pytest
import torch
from pagoda.kernels.cpu_backend import CpuBackend
from pagoda.kernels.testing import (
    case_id,
    latin_square,
    make_paged_kv,
    random_queries,
    relative_error,
    tolerance,
)
from pagoda.kernels.triton_backend import TritonBackend
from pagoda.kernels.triton_decode import num_decode_partitions

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Triton with small tiles so short test contexts still span many tiles and partitions; the CPU backend
# with its native kernel (fp32/bf16; fp16 falls back) and with torch's fused attention only. Each is
# checked against the op-by-op reference.
BACKENDS = {
    "single": TritonBackend(decode_block_n=16, decode_partitions=1),
    "split": TritonBackend(decode_block_n=16, decode_partitions=3),
    "cpu": CpuBackend(),
    "cpu-torch": CpuBackend(native=False),
}
# What unowned cache slots hold: NaN for Triton; finite garbage for the CPU backend, whose contract is a
# finite pool (the engine's is zeroed at allocation).
POISON = {"cpu": 1e4}  # both CPU modes share the backend's name


def _check_decode(
    backend,
    reference,
    generator,
    context_lens,
    *,
    group,
    block_size,
    dtype,
    head_dim=32,
    num_kv_heads=2,
    sliding_window=None,
    shared_blocks=0,
):
    cache = make_paged_kv(
        context_lens,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        shared_blocks=shared_blocks,
        poison=POISON.get(backend.name, True),
        generator=generator,
    )
    query = random_queries(len(context_lens), num_kv_heads * group, head_dim, dtype, generator=generator)
    scale = head_dim**-0.5
    args = (
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.context_lens,
        scale,
        sliding_window,
    )
    out = backend.paged_decode_attention(*args)
    expected = reference.paged_decode_attention(*args)
    assert out.shape == expected.shape and out.dtype == dtype
    assert not expected.isnan().any()
    assert relative_error(out, expected) <= tolerance(dtype)


# Every block size x GQA group pair, every dtype with each, on both the single-pass and split-K paths.
LATIN = latin_square([8, 16, 32], [1, 4, 8], DTYPES)


@pytest.mark.parametrize(("block_size", "group", "dtype"), LATIN, ids=[case_id(*case) for case in LATIN])
@pytest.mark.parametrize("mode", list(BACKENDS))
def test_decode_matches_reference(mode, group, block_size, dtype, reference, generator):
    # One token, a length ending mid-block, and lengths 1-2 orders of magnitude apart in one batch.
    _check_decode(
        BACKENDS[mode], reference, generator, [1, 9, 77, 203], group=group, block_size=block_size, dtype=dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(BACKENDS))
def test_decode_sliding_window(mode, dtype, reference, generator):
    _check_decode(
        BACKENDS[mode],
        reference,
        generator,
        [5, 24, 25, 130],
        group=4,
        block_size=8,
        dtype=dtype,
        sliding_window=24,
    )


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_decode_shared_prefix_blocks(mode, reference, generator):
    # The first two physical blocks appear in all three block tables (a ref-counted prefix).
    _check_decode(
        BACKENDS[mode],
        reference,
        generator,
        [40, 70, 17],
        group=4,
        block_size=8,
        dtype=torch.float16,
        shared_blocks=2,
    )


def test_decode_default_tiles_and_odd_head_dim(reference, generator):
    # Default 64-token tiles over 16-token blocks; head_dim 80 pads to a 128-wide tile.
    _check_decode(
        TritonBackend(),
        reference,
        generator,
        [3, 100, 300],
        group=8,
        block_size=16,
        dtype=torch.bfloat16,
        head_dim=80,
        num_kv_heads=1,
    )


def test_decode_partitions_heuristic():
    # Enough (seq, KV head) programs for ~4 per SM (128 seqs x 8 KV heads on 132 SMs): no split.
    assert num_decode_partitions(128, 8, 4096, 512, sms=132) == 1
    # Just short of it: two partitions.
    assert num_decode_partitions(64, 8, 4096, 512, sms=132) == 2
    # One sequence with a long context: split, up to ~4 programs per SM, partitions >= 512 tokens.
    assert num_decode_partitions(1, 8, 32768, 512, sms=132) == 64
    assert num_decode_partitions(1, 8, 4096, 512, sms=132) == 8
    # Short contexts never split, however empty the GPU.
    assert num_decode_partitions(1, 8, 1000, 512, sms=132) == 1


def test_cpu_decode_plan_is_worked_out_once_per_step_and_shared(reference, generator):
    """The CPU backend keeps its decode plan in the step's cache (the attention metadata's): the
    second layer of a step reuses it, another window gets its own, and the output is the same."""
    cache = make_paged_kv([5, 40, 300], 2, 32, 16, torch.float32, poison=1e4, generator=generator)
    query = random_queries(3, 4, 32, torch.float32, generator=generator)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 32**-0.5)
    step_cache: dict = {}
    backend = CpuBackend(native=False)  # the native kernel needs no plan
    first = backend.paged_decode_attention(*args, step_cache=step_cache)
    (plan,) = step_cache.values()
    second = backend.paged_decode_attention(*args, step_cache=step_cache)
    assert list(step_cache.values()) == [plan] and torch.equal(first, second)
    windowed = backend.paged_decode_attention(*args, 8, step_cache=step_cache)
    assert len(step_cache) == 2
    assert relative_error(first, reference.paged_decode_attention(*args)) <= tolerance(torch.float32)
    assert relative_error(windowed, reference.paged_decode_attention(*args, 8)) <= tolerance(torch.float32)
