import os
import subprocess
import sys

import pytest
import torch
from pagoda.kernels.testing import make_paged_kv
from pagoda.kernels.triton_backend import TritonBackend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kv_matches_reference_and_skips_padding(dtype, block_size, reference, generator):
    num_kv_heads, head_dim = 2, 48  # head_dim not a power of two: masked tail
    cache = make_paged_kv([13, 30], num_kv_heads, head_dim, block_size, dtype, generator=generator)
    # K and V as strided views of one fused projection, as an attention layer produces them.
    num_tokens = 9
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    free_slots = torch.randperm(cache.k_cache.shape[0] * block_size, generator=generator)[:num_tokens]
    slot_mapping = free_slots.clone()
    slot_mapping[[2, 7]] = -1
    expected_k, expected_v = cache.k_cache.clone(), cache.v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)

    TritonBackend().store_kv(key, value, cache.k_cache, cache.v_cache, slot_mapping)

    _assert_same_cache(cache.k_cache, expected_k)
    _assert_same_cache(cache.v_cache, expected_v)
    written = cache.k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[slot_mapping >= 0]]
    assert not written.isnan().any()


def test_store_kv_casts_to_cache_dtype(reference, generator):
    cache = make_paged_kv([5], 1, 16, 8, torch.bfloat16, generator=generator)
    key = torch.randn(3, 1, 16, generator=generator)
    value = torch.randn(3, 1, 16, generator=generator)
    slot_mapping = torch.tensor([9, -1, 12])
    expected_k, expected_v = cache.k_cache.clone(), cache.v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)

    TritonBackend().store_kv(key, value, cache.k_cache, cache.v_cache, slot_mapping)

    # Within one bf16 step: the interpreter rounds fp32 -> bf16 toward zero, torch (and the GPU) to
    # nearest even.
    for actual, expected in ((cache.k_cache, expected_k), (cache.v_cache, expected_v)):
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=0, equal_nan=True)


def test_cpu_tensors_without_the_interpreter_fail_with_the_fix():
    script = (
        "import torch\n"
        "from pagoda.kernels.triton_backend import TritonBackend\n"
        "x = torch.zeros(1, 1, 16)\n"
        "TritonBackend().store_kv(x, x, torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16), torch.zeros(1, dtype=torch.long))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr
