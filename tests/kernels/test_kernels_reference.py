"""The torch reference itself: batched decode (sequences grouped by length) against the plainest
per-sequence computation, so the oracle of the Triton tests is checked too."""

import pytest
import torch
from pagoda.kernels.reference import TorchReferenceBackend
from pagoda.kernels.testing import make_paged_kv, random_queries

# Lengths across many length groups (1, 2, 5, 15-17 mid- and end-of-block, 100, 700), out of order.
LENGTHS = [700, 1, 16, 2, 100, 15, 17, 5, 16]


@pytest.mark.parametrize("sliding_window", [None, 12])
@pytest.mark.parametrize("group", [1, 4])
def test_grouped_decode_equals_one_sequence_at_a_time(group, sliding_window):
    generator = torch.Generator().manual_seed(group)
    cache = make_paged_kv(LENGTHS, 2, 32, 8, torch.float32, generator=generator)  # NaN in unused slots
    query = random_queries(len(LENGTHS), 2 * group, 32, torch.float32, generator=generator)
    backend = TorchReferenceBackend()
    args = (cache.k_cache, cache.v_cache)
    batched = backend.paged_decode_attention(
        query, *args, cache.block_tables, cache.context_lens, 32**-0.5, sliding_window
    )
    assert not batched.isnan().any()
    for row in range(len(LENGTHS)):
        # One query at the last position of one sequence: causal prefill attention over its context.
        alone = backend.paged_prefill_attention(
            query[row : row + 1], *args, torch.tensor([0, 1], dtype=torch.int32),
            cache.context_lens[row : row + 1], cache.block_tables[row : row + 1], 32**-0.5, sliding_window,
        )  # fmt: skip
        torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-5, atol=1e-6)
