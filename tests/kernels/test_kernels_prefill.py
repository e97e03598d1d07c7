import pytest
import torch
from pagoda.kernels import cpu_backend, cpu_native
from pagoda.kernels.cpu_backend import CpuBackend, prefill_as_decode
from pagoda.kernels.testing import (
    case_id,
    latin_square,
    make_paged_kv,
    random_queries,
    relative_error,
    tolerance,
)
from pagoda.kernels.triton_backend import TritonBackend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Small tiles so short test sequences still span several query and key tiles.
SMALL_TILES = TritonBackend(prefill_block_m=16, prefill_block_n=32)
BACKENDS = {"triton": SMALL_TILES, "cpu": CpuBackend()}  # each checked against the reference


def _check_prefill(
    backend,
    reference,
    generator,
    seqs,
    *,
    group,
    block_size,
    dtype,
    head_dim=32,
    num_kv_heads=2,
    sliding_window=None,
    shared_blocks=0,
):
    """``seqs``: (context_len, q_len) pairs; the q_len new tokens are the last of the context."""
    context_lens = [context for context, _ in seqs]
    cache = make_paged_kv(
        context_lens,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        shared_blocks=shared_blocks,
        generator=generator,
    )
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    cu_seqlens_q = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    query = random_queries(int(q_lens.sum()), num_kv_heads * group, head_dim, dtype, generator=generator)
    args = (
        query,
        cache.k_cache,
        cache.v_cache,
        cu_seqlens_q,
        cache.context_lens,
        cache.block_tables,
        head_dim**-0.5,
        sliding_window,
    )
    out = backend.paged_prefill_attention(*args)
    expected = reference.paged_prefill_attention(*args)
    assert out.shape == expected.shape and out.dtype == dtype
    assert not expected.isnan().any()
    assert relative_error(out, expected) <= tolerance(dtype)


# Whole prompts (one ending mid-block), a one-token chunk after a long prefix, a chunk after a
# prefix-cache hit, of very different lengths in one batch.
MIXED = [(9, 9), (50, 1), (100, 37), (23, 23)]


LATIN = latin_square([8, 16, 32], [1, 4, 8], DTYPES)


@pytest.mark.parametrize(("block_size", "group", "dtype"), LATIN, ids=[case_id(*case) for case in LATIN])
@pytest.mark.parametrize("mode", list(BACKENDS))
def test_prefill_matches_reference(mode, group, block_size, dtype, reference, generator):
    _check_prefill(
        BACKENDS[mode], reference, generator, MIXED, group=group, block_size=block_size, dtype=dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(BACKENDS))
def test_prefill_sliding_window(mode, dtype, reference, generator):
    _check_prefill(
        BACKENDS[mode],
        reference,
        generator,
        [*MIXED, (70, 70)],
        group=4,
        block_size=8,
        dtype=dtype,
        sliding_window=20,
    )


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_prefill_shared_prefix_blocks(mode, reference, generator):
    # Two sequences whose first 3 blocks are the same physical blocks; each prefills only its tail.
    _check_prefill(
        BACKENDS[mode],
        reference,
        generator,
        [(40, 40), (61, 37), (30, 6)],
        group=4,
        block_size=8,
        dtype=torch.float16,
        shared_blocks=3,
    )


def test_prefill_default_tiles_and_odd_head_dim(reference, generator):
    _check_prefill(
        TritonBackend(),
        reference,
        generator,
        [(130, 130), (200, 70)],
        group=8,
        block_size=16,
        dtype=torch.bfloat16,
        head_dim=80,
        num_kv_heads=1,
    )


def test_prefill_as_decode_rows():
    # Sequence 0: 3 new tokens after 2 cached (context 5); sequence 1: a whole prompt of 2.
    cu_seqlens_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    context_lens = torch.tensor([5, 2], dtype=torch.int32)
    block_tables = torch.tensor([[7, 8], [9, 0]], dtype=torch.int32)
    tables, lens = prefill_as_decode(cu_seqlens_q, context_lens, block_tables)
    assert tables.tolist() == [[7, 8], [7, 8], [7, 8], [9, 0], [9, 0]]
    assert lens.tolist() == [3, 4, 5, 1, 2] and lens.dtype == torch.int32  # each sees up to itself


def _counting(monkeypatch, name: str) -> list[bool]:
    """Calls of `cpu_native.<name>`, each True where it ran (returned a result); the kernel still runs."""
    calls = []
    kernel = getattr(cpu_native, name)

    def counted(*args):
        out = kernel(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_native, name, counted)
    return calls


@pytest.mark.parametrize("tiled_builds", [True, False], ids=["tiled-kernel", "no-tiled-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_which_kernel_attends_a_prefill(reference, generator, dtype, tiled_builds, monkeypatch):
    """`CpuBackend.prefill_kernel`'s rule, each way matching the reference: where the tiled kernel
    builds it takes short and long prefills; elsewhere a short one goes token by token, one past
    PER_TOKEN_PREFILL_CONTEXT to flash."""
    if not tiled_builds:
        monkeypatch.setattr(cpu_native, "has_tiled_prefill", lambda head_dim: False)
    tiled_builds = tiled_builds and cpu_native.has_tiled_prefill(32)
    per_token = _counting(monkeypatch, "paged_decode_attention")
    tiled = _counting(monkeypatch, "prefill_attention")
    limit = cpu_backend.PER_TOKEN_PREFILL_CONTEXT
    for seqs, short in (([(limit, limit), (50, 20)], True), ([(limit + 1, 9), (30, 30)], False)):
        per_token.clear()
        tiled.clear()
        _check_prefill(CpuBackend(), reference, generator, seqs, group=3, block_size=16, dtype=dtype)
        assert tiled == ([True] if tiled_builds else [])
        assert any(per_token) == (short and not tiled_builds and cpu_native.library() is not None)


# Past the per-token limit (flash, without the tiled kernel): whole prompts (ending mid-block and on a
# tile's edge), a chunk after a cached prefix, one token after a long one; every tile shape of the
# group's heads.
LONG = [(301, 301), (264, 264), (400, 133), (290, 1)]
LONG_CASES = [(1, 16, 64), (3, 16, 64), (4, 8, 32), (2, 16, 80), (8, 8, 128)]


def _tiled_calls(reference, generator, monkeypatch, **shape) -> list[bool]:
    """LONG through the CPU backend, checked against the reference: the tiled kernel's calls."""
    tiled = _counting(monkeypatch, "prefill_attention")
    _check_prefill(CpuBackend(), reference, generator, LONG, **shape)
    return tiled


@pytest.mark.parametrize(
    ("group", "block_size", "head_dim"), LONG_CASES, ids=[f"g{g}-b{b}-d{d}" for g, b, d in LONG_CASES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefills_tile_by_tile_match_reference(
    group, block_size, head_dim, dtype, reference, generator, monkeypatch
):
    shape = {"group": group, "block_size": block_size, "dtype": dtype, "head_dim": head_dim}
    tiled = cpu_native.has_tiled_prefill(head_dim)  # elsewhere flash attends: the kernel is never called
    assert _tiled_calls(reference, generator, monkeypatch, **shape) == ([True] if tiled else [])


@pytest.mark.parametrize("window", [1, 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefills_with_a_sliding_window_tile_by_tile(window, dtype, reference, generator, monkeypatch):
    """Windows narrower than a tile, than a chunk of keys, and wider: each row sees its own window."""
    shape = {"group": 3, "block_size": 16, "dtype": dtype, "sliding_window": window}
    tiled = cpu_native.has_tiled_prefill(32)
    assert _tiled_calls(reference, generator, monkeypatch, **shape) == ([True] if tiled else [])
