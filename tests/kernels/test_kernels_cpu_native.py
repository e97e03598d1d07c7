"""The native CPU kernels (`kernels/cpu_native.c`) against torch on the same inputs.

They are built with this machine's C compiler on first use; the engine falls back to torch's ops
where none exists, so these tests need one (CI machines have gcc).
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native
from pagoda.kernels.reference import TorchReferenceBackend
from pagoda.kernels.testing import make_paged_kv, random_queries, relative_error, tolerance
from pagoda.server.engine.layers.rotary import RotaryEmbedding
from pagoda.server.engine.sampler import sample_from_cdf

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]
# SiLU x up, the low-bit linears and the greedy pass are vector code only (AVX-512 or AVX2)
vector_kernels = pytest.mark.skipif(not cpu_native.has_vector_kernels(), reason="no vector kernels on this CPU")


def test_the_kernels_build_and_share_torchs_openmp_runtime():
    assert cpu_native.library() is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp  # a second runtime would start a second thread team on the same cores


def test_disabled_by_environment(tmp_path):
    code = "from pagoda.kernels import cpu_native; print(cpu_native.library() is None)"
    env = {**os.environ, "PAGODA_NATIVE_KERNELS": "0", "PAGODA_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True" and not list(tmp_path.iterdir())


# The instruction sets a tier's build needs from the CPU that runs it
FUSED_LAYERS_TESTS = str(Path(__file__).parents[1] / "models" / "test_models_native_decode.py")
TIER_FLAGS = {
    "skylake-avx512": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx2", "fma"},
    "x86-64": set(),
}


@pytest.mark.slow
@pytest.mark.parametrize(("march", "lanes"), [("skylake-avx512", 16), ("x86-64-v3", 8), ("x86-64", 0)])
def test_every_instruction_set_tier_matches_torch(march, lanes, tmp_path):
    """This file's tests, and the fused decode layers against the layers op by op, again on the kernels
    built for an older x86 CPU than this one: AVX-512 without bf16 arithmetic (Skylake-SP), AVX2 + FMA
    (8 lanes), and baseline x86-64 (no vector kernels: torch's ops where they are missing)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if platform.machine() == "x86_64" else set()
    if platform.machine() != "x86_64" or not TIER_FLAGS[march] <= flags:
        pytest.skip(f"an x86 CPU with {sorted(TIER_FLAGS[march])} runs the {march} tier")
    env = {**os.environ, "PAGODA_NATIVE_MARCH": march, "PAGODA_KERNEL_CACHE": str(tmp_path)}
    check = "from pagoda.kernels import cpu_native; print(cpu_native.library().lanes)"
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(lanes)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", __file__,
         FUSED_LAYERS_TESTS],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]


PREFILL_SHAPES = [(3, 16, 64, None), (4, 8, 128, None), (2, 16, 48, None), (3, 8, 64, 21)]  # group, block, head, window


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "block_size", "head_dim", "window"), PREFILL_SHAPES)
def test_prefill_attention_matches_reference(dtype, group, block_size, head_dim, window, generator):
    """Whole prompts and chunks after a cached prefix, a tile of tokens at a time, with and without a
    sliding window (AVX-512 builds; elsewhere the kernel declines and the backend runs torch's flash
    attention)."""
    seqs = [(70, 70), (300, 45), (33, 1), (129, 128)]  # (context, new tokens)
    cache = make_paged_kv([c for c, _ in seqs], 2, head_dim, block_size, dtype, poison=1e4, generator=generator)
    cu_seqlens_q = F.pad(torch.tensor([n for _, n in seqs]).cumsum(0), (1, 0)).to(torch.int32)
    query = random_queries(int(cu_seqlens_q[-1]), 2 * group, head_dim, dtype, generator=generator)
    args = (query, cache.k_cache, cache.v_cache, cu_seqlens_q, cache.context_lens, cache.block_tables, head_dim**-0.5)
    out = cpu_native.prefill_attention(*args, window)
    if not cpu_native.has_tiled_prefill(head_dim):
        assert out is None
        return
    expected = TorchReferenceBackend().paged_prefill_attention(*args, window)
    assert out.dtype == dtype and relative_error(out, expected) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "block_size", "window"), [(1, 16, None), (3, 8, None), (8, 32, 40), (4, 16, 5)])
def test_decode_attention_matches_reference(dtype, group, block_size, window, generator):
    lens = [1, 16, 17, 90, 300]
    cache = make_paged_kv(lens, 2, 64, block_size, dtype, poison=1e4, generator=generator)
    # q as the model hands it: a strided view of the projection output
    packed = random_queries(len(lens), 2 * group + 4, 64, dtype, generator=generator)
    query = packed[:, : 2 * group]
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125, window)
    out = cpu_native.paged_decode_attention(*args)
    expected = TorchReferenceBackend().paged_decode_attention(*args)
    assert out.dtype == dtype and relative_error(out, expected) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [36, 80, 128, 256])  # 8-lane vectors: a tail; 64-dim slices of sums: 2, 4
@pytest.mark.parametrize("group", [3, 4])  # at 128: the generic loops, then a shape compiled with its sizes
def test_decode_attention_head_sizes(dtype, head_dim, group, generator):
    lens = [3, 16, 50]
    cache = make_paged_kv(lens, 2, head_dim, 16, dtype, poison=1e4, generator=generator)
    query = random_queries(len(lens), 2 * group, head_dim, dtype, generator=generator)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, head_dim**-0.5, None)
    out = cpu_native.paged_decode_attention(*args)
    expected = TorchReferenceBackend().paged_decode_attention(*args)
    assert relative_error(out, expected) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lens", "window"), [([1500], None), ([3000], 700), ([40, 2500], None)])
def test_decode_attention_splits_few_long_contexts_across_threads(dtype, lens, window, generator):
    """Fewer (sequence, KV head) tasks than two a thread: each context attends in pieces that the
    threads share, merged after; one thread attends each whole. Both match the reference, and in fp32
    they sum in another order (so the pieces did run)."""
    cache = make_paged_kv(lens, 2, 64, 16, dtype, poison=1e4, generator=generator)
    query = random_queries(len(lens), 6, 64, dtype, generator=generator)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125, window)
    expected = TorchReferenceBackend().paged_decode_attention(*args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = cpu_native.paged_decode_attention(*args)
        torch.set_num_threads(4)  # 2 or 4 tasks: fewer than two a thread
        pieces = cpu_native.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    for out in (whole, pieces):
        assert relative_error(out, expected) <= tolerance(dtype)
    if dtype == torch.float32:
        assert not torch.equal(whole, pieces)


def test_decode_attention_refuses_a_block_outside_the_cache(generator):
    cache = make_paged_kv([20], 1, 64, 16, torch.float32, generator=generator)
    tables = cache.block_tables.clone()
    tables[0, 1] = cache.k_cache.shape[0]
    query = random_queries(1, 1, 64, torch.float32, generator=generator)
    with pytest.raises(IndexError):
        cpu_native.paged_decode_attention(query, cache.k_cache, cache.v_cache, tables, cache.context_lens, 1.0, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 16, 17, 24, 33, 37, 64, 65, 128, 129, 256, 257, 512, 513])
@pytest.mark.parametrize(("out_features", "in_features"), [(1000, 576), (64, 96), (7, 50)])
def test_linear_matches_torch(dtype, rows, out_features, in_features, generator):
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    y = cpu_native.linear(x, weight, bias)
    if y is None:  # a shape this CPU's kernels do not take (rows past their crossover)
        lib = cpu_native.library()
        amx_takes = dtype == torch.bfloat16 and lib.amx and in_features % 32 == 0 and rows <= cpu_native.AMX_MAX_ROWS
        assert not amx_takes and rows > cpu_native.max_rows(lib, dtype)
        return
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert y.dtype == dtype and y.shape == (rows, out_features)
    # fp32 accumulation either way; bf16 rounds the output once
    assert (y.float() - expected).abs().max() <= (1e-4 if dtype == torch.float32 else 2**-7) * expected.abs().max()


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 12, 16, 17, 24, 64, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(1000, 576), (64, 96), (7, 50), (9, 1536)])
def test_fp32_rows_on_bf16_weights_equal_the_widened_weights(rows, out_features, in_features, generator):
    """A bf16 weight under fp32 rows is widened in registers: the fp32 kernel's result on the widened
    weight, bit for bit (the same products, summed in the same order), from half the bytes."""
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    y = cpu_native.linear(x, weight, bias)
    if rows > cpu_native.max_rows(cpu_native.library(), torch.float32):  # torch's GEMM takes the step
        assert y is None
        return
    assert y is not None and y.dtype == torch.float32
    assert torch.equal(y, cpu_native.linear(x, weight.float(), bias))
    assert cpu_native.linear(x.bfloat16(), weight, bias) is None  # an fp32 bias under bf16 rows: torch's


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16)])
def test_one_row_writes_every_output(dtype, weight_dtype, generator):
    """One row: each thread reads its share of the outputs in parts side by side (AVX2, and AVX-512 on
    AMD: a tile of outputs far apart) and the outputs past the last whole set of parts one by one;
    whatever the output count, each output is written, and in its place."""
    if cpu_native.max_rows(cpu_native.library(), dtype) == 0:
        pytest.skip("no native kernel for these rows on this CPU")
    for out_features in (*range(1, 14), 1003):
        x = torch.randn(1, 200, generator=generator).to(dtype)
        weight = torch.randn(out_features, 200, generator=generator).to(weight_dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        y = cpu_native.linear(x, weight, bias)
        expected = F.linear(x.float(), weight.float(), bias.float())
        assert y is not None and y.shape == (1, out_features)
        limit = (1e-4 if dtype == torch.float32 else 2**-7) * expected.abs().max()
        assert (y.float() - expected).abs().max() <= limit, out_features


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_avx2_fp32_rows_from_12_do_not_depend_on_the_step_size(weight_dtype, generator):
    """On AVX2 the fp32 kernels past 11 rows (rows in lanes, then packed panels from 48) sum each output
    over k in order with one FMA chain: a row's output is the same bits whatever other rows share the step."""
    if cpu_native.library().lanes != 8:
        pytest.skip("the AVX2 tier's kernels (the AVX-512 one runs again under x86-64-v3)")
    x = torch.randn(64, 576, generator=generator)
    weight = torch.randn(1000, 576, generator=generator).to(weight_dtype)
    bias = torch.randn(1000, generator=generator)
    whole = cpu_native.linear(x, weight, bias)
    for rows in (12, 15, 16, 20, 24, 37, 47):
        assert torch.equal(cpu_native.linear(x[:rows], weight, bias), whole[:rows]), rows


def test_linear_declines_many_rows_and_other_devices():
    lib = cpu_native.library()
    weight = torch.randn(64, 64)
    for dtype in DTYPES:  # past the native kernels' last row count (where there is one), torch's GEMM
        last = cpu_native.max_rows(lib, dtype)
        if lib.amx and dtype == torch.bfloat16:
            last = cpu_native.AMX_MAX_ROWS
        if last < cpu_native.EVERY_STEP:
            assert cpu_native.linear(torch.randn(last + 1, 64).to(dtype), weight.to(dtype), None) is None
    assert cpu_native.linear(torch.randn(2, 64, dtype=torch.float16), weight.half(), None) is None


@vector_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"),
    [(100, 576, 32), (9, 96, 32), (7, 256, 64), (64, 512, 256)],  # 96: a last group past the 64-input steps
)
def test_int4_linear_matches_the_dequantized_weight(dtype, rows, out_features, in_features, group, generator):
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = torch.rand(out_features, in_features // group, generator=generator) * 0.1
    mins = torch.randn(out_features, in_features // group, generator=generator) * 0.1
    dense = q * scales.repeat_interleave(group, 1) + mins.repeat_interleave(group, 1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    y = cpu_native.int4_linear(x, cpu_native.pack_int4(q), scales, mins, group, bias)
    expected = F.linear(x.float(), dense, bias.float())
    assert y.dtype == dtype and y.shape == (rows, out_features)
    assert (y.float() - expected).abs().max() <= (1e-4 if dtype == torch.float32 else 2**-7) * expected.abs().max()


@vector_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(1000, 576), (7, 64)])
def test_int8_linear_matches_the_dequantized_weight(dtype, out_features, in_features, generator):
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator).to(torch.int8)
    scales = (torch.rand(out_features, generator=generator) / 100).to(dtype)
    x = torch.randn(1, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    y = cpu_native.int8_linear(x, q, scales, bias)
    expected = F.linear(x.float(), q.float() * scales.float()[:, None], bias.float())
    assert y.dtype == dtype and y.shape == (1, out_features)
    assert (y.float() - expected).abs().max() <= (1e-4 if dtype == torch.float32 else 2**-7) * expected.abs().max()
    assert cpu_native.int8_linear(x.expand(2, -1), q, scales, bias) is None  # more rows: torch's kernel


def test_avx2_low_bit_rows_are_rounded_to_int16_per_32_inputs(generator):
    """On AVX2 the low-bit kernels multiply integers: each 32 inputs of the row are scaled so that
    their largest magnitude is 32767 and rounded to nearest, ties to even. Through the int8 head with
    the identity as its weight, each output is its input so rounded and scaled back, bit for bit."""
    if cpu_native.library().lanes != 8:
        pytest.skip("the AVX2 tier's kernels (the AVX-512 one runs again under x86-64-v3)")
    x = torch.randn(1, 96, generator=generator) * 10
    x[0, :6] = torch.tensor([32767.0, 2.5, 3.5, -2.5, -3.5, 0.5])  # scale 1: the ties themselves
    x[0, 32:64] = 0.0  # a chunk of zeros
    identity, ones = torch.eye(96, dtype=torch.int8), torch.ones(96)
    y = cpu_native.int8_linear(x, identity, ones, None)
    chunks = x.view(-1, 32)
    top = chunks.abs().amax(1, keepdim=True)
    inverse = torch.where(top > 0, 32767.0 / top, torch.zeros_like(top))
    expected = (torch.round(chunks * inverse) * (top / 32767.0)).view(1, 96)
    assert torch.equal(y, expected)
    assert y[0, 1:6].tolist() == [2.0, 4.0, -2.0, -4.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual_matches_torch(dtype, generator):
    x = torch.randn(5, 576, generator=generator).to(dtype)
    residual = torch.randn(5, 576, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=generator)).to(dtype)

    def reference(h):
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return weight * normed.to(dtype)

    out, summed = cpu_native.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    ulp = 1e-6 if dtype == torch.float32 else 2**-7  # one rounding step of the output's dtype
    assert ((out.float() - reference(x + residual).float()).abs() <= ulp * reference(x + residual).float().abs() + 1e-6).all()
    alone, none = cpu_native.rms_norm(x, weight, 1e-5)
    assert none is None and ((alone.float() - reference(x).float()).abs() <= ulp * reference(x).float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference_and_checks_slots(dtype, generator):
    kv = torch.randn(4, 2 + 2 + 2, 64, generator=generator).to(dtype)  # a projection's q, k, v heads
    key, value = kv[:, 2:4], kv[:, 4:]
    slots = torch.tensor([5, -1, 0, 31])
    caches = [torch.zeros(2, 16, 2, 64, dtype=dtype) for _ in range(4)]
    assert cpu_native.store_kv(key, value, caches[0], caches[1], slots)
    TorchReferenceBackend().store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError):
        cpu_native.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 32]))


@vector_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 37), (40, 2048)])
def test_silu_and_mul_matches_torch(dtype, rows, inter, generator):
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=generator)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_native.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # rounds where torch rounds: the same numbers
        assert torch.equal(out, expected)
    else:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 12, 64), (7, 3, 36), (300, 12, 64)])
def test_rotary_in_place_equals_torchs_ops(dtype, tokens, heads, head_dim, generator):
    """q and k rotated where they sit in the step's qkv rows (v after them untouched), the same numbers
    as torch's op-by-op rotation in both dtypes (the kernel rounds where torch's ops round)."""
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=generator), dtype)
    qkv = (3 * torch.randn(tokens, heads + 2, head_dim, generator=generator)).to(dtype)
    expected = qkv[:, :heads] * cos + torch.cat((-qkv[:, :heads, head_dim // 2 :], qkv[:, :heads, : head_dim // 2]), -1) * sin
    untouched = qkv[:, heads:].clone()
    assert cpu_native.rotary(qkv[:, :heads], cos, sin)
    assert torch.equal(qkv[:, :heads], expected)
    assert torch.equal(qkv[:, heads:], untouched)


def test_rotary_declines_what_it_does_not_take():
    x = torch.randn(4, 2, 8)
    before = x.clone()
    cos = sin = torch.full((4, 1, 8), 0.5)
    assert not cpu_native.rotary(x.transpose(0, 1), cos[:2], sin[:2])  # heads not side by side
    assert not cpu_native.rotary(x, cos.double(), sin.double())
    assert not cpu_native.rotary(x, cos[:3], sin[:3])  # angles for other tokens
    assert torch.equal(x, before)


@vector_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (16, 49152), (5, 37)])
def test_argmax_logsumexp_matches_torch(rows, vocab, generator):
    logits = 4 * torch.randn(rows, vocab, generator=generator)
    logits[0, vocab // 3] = logits[0, vocab // 2] = logits[0].max() + 1  # a tie: the first index wins
    index, log_norm = cpu_native.argmax_logsumexp(logits)
    assert torch.equal(index, logits.argmax(dim=-1)) and index[0] == vocab // 3
    assert torch.allclose(log_norm, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


@vector_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(2000, 49152), (3000, 37), (4000, 5)])
def test_sample_rows_inverts_the_same_distribution_as_torchs_path(rows, vocab, generator):
    """The sampler's torch path (softmax of logits / t, cumsum, searchsorted at one uniform draw) is the
    oracle: the same token at nearly every draw; only a draw within rounding of a token's edge may
    land on its neighbour (the two sum the probabilities in different orders)."""
    logits = 3 * torch.randn(rows, vocab, generator=generator)
    temps = torch.rand(rows, generator=generator) + 0.3
    uniform = torch.rand(rows, dtype=torch.float64, generator=generator)
    tokens = cpu_native.sample_rows(logits, temps, uniform)
    expected = sample_from_cdf(torch.softmax(logits / temps[:, None], dim=-1), uniform)
    assert tokens is not None and tokens.dtype == torch.long
    agree = (tokens == expected).float().mean().item()
    assert agree >= (0.995 if vocab > 1000 else 1.0), agree


@vector_kernels
def test_sample_rows_never_picks_a_banned_token_and_leaves_nan_rows():
    logits = torch.tensor([[-float("inf"), 0.0, -float("inf"), 0.0, -float("inf")]]).repeat(5, 1)
    uniform = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0 - 1e-12], dtype=torch.float64)
    assert cpu_native.sample_rows(logits, torch.ones(5), uniform).tolist() == [1, 1, 3, 3, 3]
    logits[2, 0] = float("nan")  # torch's path decides what such a row gets
    assert cpu_native.sample_rows(logits, torch.ones(5), uniform) is None


@vector_kernels
def test_sample_plain_is_the_greedy_and_sampling_kernels_with_torchs_logprobs(generator):
    """Greedy rows (temperature 0) get argmax_logsumexp's token, the others sample_rows's at the same
    draw, and each token's log-probability is torch's logit - logsumexp, bit for bit."""
    rows, vocab = 64, 49152
    logits = 4 * torch.randn(rows, vocab, generator=generator)
    temps = torch.where(torch.arange(rows) % 3 == 0, 0.0, torch.rand(rows, generator=generator) + 0.3)
    uniform = torch.rand(rows, dtype=torch.float64, generator=generator)
    tokens, logprobs = cpu_native.sample_plain(logits, temps.tolist(), uniform.tolist())
    greedy, log_norm = cpu_native.argmax_logsumexp(logits)
    sampled = cpu_native.sample_rows(logits, temps.clamp(min=0.3), uniform)
    expected = torch.where(temps == 0, greedy, sampled)
    assert tokens == expected.tolist()
    assert logprobs == (logits.gather(1, expected[:, None]).squeeze(1) - log_norm).tolist()
    logits[5, 9] = float("nan")  # the caller's torch path decides such a row
    assert cpu_native.sample_plain(logits, temps.tolist(), uniform.tolist()) is None


@vector_kernels
@pytest.mark.parametrize("rows", [1, 16])
def test_sample_plain_reads_bf16_logits_as_their_fp32_copy(rows, generator):
    """A bf16 head's logits, widened row by row inside the kernel: the tokens and log-probabilities of
    the same call on `logits.float()`, bit for bit (16 rows: the rows split between the threads)."""
    logits = (4 * torch.randn(rows, 49152, generator=generator)).bfloat16()
    temps = torch.where(torch.arange(rows) % 2 == 0, 0.0, torch.rand(rows, generator=generator) + 0.3).tolist()
    uniform = torch.rand(rows, dtype=torch.float64, generator=generator).tolist()
    assert cpu_native.sample_plain(logits, temps, uniform) == cpu_native.sample_plain(logits.float(), temps, uniform)


@vector_kernels
def test_argmax_logsumexp_leaves_nan_and_infinite_rows_to_torchs_rules():
    logits = torch.zeros(4, 40)
    logits[0, 7] = float("nan")  # torch: a NaN is the maximum
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, 5] = 2.0
    index, log_norm = cpu_native.argmax_logsumexp(logits)
    assert torch.equal(index, logits.argmax(dim=-1)) and index.tolist() == [7, 9, 0, 5]
    assert torch.allclose(log_norm, torch.logsumexp(logits, dim=-1), equal_nan=True)
    assert cpu_native.argmax_logsumexp(logits.T) is None and cpu_native.argmax_logsumexp(logits.double()) is None
