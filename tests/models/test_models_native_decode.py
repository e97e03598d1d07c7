"""Steps in one native call (`models/native_decode.py`) give the op-by-op layers' results bit for bit:
every position's logits and every KV cache entry, over a schedule of prefill, mixed and decode steps,
in fp32 and bf16, for each tiny family (qwen3's q/k norms run op by op), with dense and with 4-bit
weights; prefills through the tiled kernel or token by token (past the per-token attention's context
they run op by op)."""

from __future__ import annotations

import pytest
import torch
from models_paged_harness import SCHEDULE, PagedHarness, run_schedule, schedule_token_counts
from pagoda.kernels import cpu_backend, cpu_native
from pagoda.server.engine.attention_metadata import AttentionMetadata
from pagoda.server.engine.layers import linear, quantized
from pagoda.server.engine.layers.linear import Linear
from pagoda.server.engine.layers.quantized import Int4Weight
from pagoda.server.engine.loader import load_model

pytestmark = pytest.mark.skipif(
    not cpu_native.has_vector_kernels(), reason="the native decode layers need AVX-512 or AVX2 and a C compiler"
)


def _sequences(vocab_size: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        seq: torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        for seq, n in schedule_token_counts().items()
    }


def _run(model, sequences, native: bool):
    model.model.native_decode.enabled = native
    harness = PagedHarness(model, block_size=8, num_blocks=64, seed=1)
    return run_schedule(harness, sequences), harness.kv_caches


def _native_steps(model, per_token_context: int | None) -> int:
    """Steps of SCHEDULE the native call takes: every projection has a native kernel at its rows, and its
    prefills (if any) go to the tiled kernel (`per_token_context` None) or token by token."""
    layers = model.model.native_decode._layers()
    count = 0
    for prefill_slices, decoding in SCHEDULE:
        rows = sum(part.stop - part.start for part in prefill_slices.values()) + len(decoding)
        longest = max((part.stop for part in prefill_slices.values()), default=0)  # chunks start at 0 or after one
        attended = per_token_context is None or longest <= per_token_context
        count += layers is not None and layers.kernels(rows) is not None and attended
    return count


# How the prefills attend: the tiled kernel where it builds, or token by token (the kernel switched off)
# up to the default context or up to 20.
PREFILL_KERNELS = {"tiled": None, "per-token": cpu_backend.PER_TOKEN_PREFILL_CONTEXT, "per-token-to-20": 20}


@pytest.mark.parametrize("prefill", list(PREFILL_KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_equals_the_layers_op_by_op(tiny_family_dir, dtype, prefill, monkeypatch):
    family, path = tiny_family_dir
    model = load_model(path, dtype=dtype).model
    per_token_context = PREFILL_KERNELS[prefill]
    if per_token_context is None:
        if not cpu_native.has_tiled_prefill(model.model.layers[0].self_attn.attn.head_dim):
            pytest.skip("the tiled prefill kernel needs AVX-512 and heads in whole vectors")
    else:
        monkeypatch.setattr(cpu_native, "has_tiled_prefill", lambda head_dim: False)
        monkeypatch.setattr(cpu_backend, "PER_TOKEN_PREFILL_CONTEXT", per_token_context)
    calls = []
    original = cpu_native.DecodeLayers.__call__

    def counted(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_native.DecodeLayers, "__call__", counted)
    sequences = _sequences(model.vocab_size)
    expected, expected_caches = _run(model, sequences, native=False)
    assert not calls
    actual, caches = _run(model, sequences, native=True)
    # Qwen3's q/k norms are not a layer the native call takes. Through the tiled kernel or token by token
    # up to the default context, every step of the schedule (contexts <= 40) runs natively where this
    # CPU has the dtype's kernels at its rows; token by token up to 20, the steps that prefill `c`
    # (contexts 24 and 40) run op by op.
    native = 0 if family == "qwen3" else _native_steps(model, per_token_context)
    assert sum(calls) == native
    if family != "qwen3" and model.model.native_decode._layers().kernels(26) is not None:
        assert native == (5 if per_token_context == 20 else 7)
    for seq, chunks in expected.items():
        for (start, want), (got_start, got) in zip(chunks, actual[seq], strict=True):
            assert start == got_start and torch.equal(got, want), f"{family} {seq}@{start}"
    for (k, v), (k_want, v_want) in zip(caches, expected_caches, strict=True):
        assert torch.equal(k, k_want) and torch.equal(v, v_want)


def test_a_slot_outside_the_cache_is_an_index_error(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype="float32").model
    harness = PagedHarness(model, block_size=8, num_blocks=4, seed=0)
    harness.step({"a": [1, 2, 3]}, {})
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([4 * 8], dtype=torch.int64),  # one past the last slot
        num_prefill_tokens=0,
        decode_context_lens=torch.tensor([4], dtype=torch.int32),
        decode_block_tables=harness._tables(["a"]),
    )
    with pytest.raises(IndexError):
        model(torch.tensor([5]), torch.tensor([3]), meta, harness.kv_caches)
    assert model.model.native_decode._layers() is not None  # the native call raised it, not the layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_position_past_the_rotary_tables_grows_them_and_equals_the_layers(tiny_llama_dir, dtype, monkeypatch):
    """The native call looks each row's cos/sin up in the model's tables; a position past them is
    refused before anything is written, the tables grow, and the call runs again."""
    model = load_model(tiny_llama_dir, dtype=dtype).model
    harness = PagedHarness(model, block_size=8, num_blocks=4, seed=0)
    harness.step({"a": [1, 2, 3]}, {})
    layers = model.model.native_decode._layers()  # built for the harness's attention backend
    if layers is None or layers.kernels(1) is None:
        pytest.skip(f"no native kernel runs a one-row {dtype} step on this CPU tier")
    rotary = model.model.rotary_emb
    position = rotary.tables(model.dtype)[0].shape[0] + 5
    tables = harness._tables(["a"])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[0, 0]) * 8 + 3], dtype=torch.int64),
        num_prefill_tokens=0,
        decode_context_lens=torch.tensor([4], dtype=torch.int32),
        decode_block_tables=tables,
    )
    outcomes = []
    original = cpu_native.DecodeLayers.__call__

    def recorded(self, *args):
        try:
            out = original(self, *args)
        except cpu_native.BeyondRopeTables:
            outcomes.append("beyond the tables")
            raise
        outcomes.append("ran" if out is not None else "declined")
        return out

    monkeypatch.setattr(cpu_native.DecodeLayers, "__call__", recorded)
    hidden = {}
    for native in (True, False):
        model.model.native_decode.enabled = native
        caches = [(k.clone(), v.clone()) for k, v in harness.kv_caches]
        hidden[native] = model(torch.tensor([5]), torch.tensor([position]), meta, caches)
    assert outcomes == ["beyond the tables", "ran"]
    assert rotary.tables(model.dtype)[0].shape[0] > position
    assert torch.equal(hidden[True], hidden[False])


def test_a_prefill_block_outside_the_cache_is_an_index_error_before_anything_is_written(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype="float32").model
    if not cpu_native.has_tiled_prefill(model.model.layers[0].self_attn.attn.head_dim):
        pytest.skip("the tiled prefill kernel needs AVX-512")
    harness = PagedHarness(model, block_size=8, num_blocks=4, seed=0)
    harness.step({"a": [1, 2, 3]}, {})
    caches = [(k.clone(), v.clone()) for k, v in harness.kv_caches]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([8, 9], dtype=torch.int64),
        num_prefill_tokens=2,
        prefill_cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
        prefill_context_lens=torch.tensor([2], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[4]], dtype=torch.int32),  # one past the last block
    )
    with pytest.raises(IndexError):
        model(torch.tensor([5, 6]), torch.tensor([0, 1]), meta, harness.kv_caches)
    for (k, v), (k_before, v_before) in zip(harness.kv_caches, caches, strict=True):
        assert torch.equal(k, k_before) and torch.equal(v, v_before)  # checked before the first layer stored


def _quantize_to_int4(model) -> None:
    """Every projection gets a random 4-bit copy (groups of 32): at few rows it runs instead of the
    dense weight, through the same native kernel op by op and in the one call."""
    gen = torch.Generator().manual_seed(2)
    for module in model.modules():
        if isinstance(module, Linear):
            out_features, in_features = module.weight.shape
            q = torch.randint(0, 16, (out_features, in_features), generator=gen)
            scales = torch.rand(out_features, in_features // 32, generator=gen) * 0.1
            zeros = torch.randn(out_features, in_features // 32, generator=gen) * 0.1
            module.quantize(Int4Weight(q, scales, zeros, module.weight.dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_with_4_bit_weights_equals_the_layers(tiny_llama3_dir, dtype, monkeypatch):
    # The schedule's decode steps have 2 and 4 rows: let the 4-bit copies take 2 (by default they take 1).
    monkeypatch.setattr(quantized, "FEW_ROWS", 2)
    monkeypatch.setattr(linear, "FEW_ROWS", 2)
    model = load_model(tiny_llama3_dir, dtype=dtype).model
    _quantize_to_int4(model.model.layers)
    int4_calls = []
    original = cpu_native.int4_linear
    monkeypatch.setattr(cpu_native, "int4_linear", lambda *a: int4_calls.append(1) or original(*a))
    sequences = _sequences(model.vocab_size)
    expected, expected_caches = _run(model, sequences, native=False)
    assert int4_calls  # op by op, the few-row steps ran the 4-bit copies
    int4_calls.clear()
    actual, caches = _run(model, sequences, native=True)
    assert not int4_calls  # every few-row step of the schedule ran in the one call, its 4-bit copies too
    for seq, chunks in expected.items():
        for (start, want), (_, got) in zip(chunks, actual[seq], strict=True):
            assert torch.equal(got, want), f"{seq}@{start}"
    for (k, v), (k_want, v_want) in zip(caches, expected_caches, strict=True):
        assert torch.equal(k, k_want) and torch.equal(v, v_want)


def test_a_cast_model_gets_its_new_weights_addresses(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype="float32").model
    PagedHarness(model, block_size=8, num_blocks=4, seed=0)  # hands the layers the native backend
    native = model.model.native_decode
    before = native._layers()
    model.to(torch.bfloat16)  # new tensors: the old addresses are freed
    after = native._layers()
    assert after is not before and after.dtype == torch.bfloat16
    assert after.structs[0].qkv.weight == model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()


def test_an_assigned_low_bit_copy_or_backend_is_read_at_the_next_step(tiny_llama_dir):
    """The fused layers are kept between steps; a 4-bit copy or an attention backend assigned since
    their build makes the next step build them anew (each step counts the copies' assignments instead of
    reading every layer's)."""
    model = load_model(tiny_llama_dir, dtype="float32").model
    PagedHarness(model, block_size=8, num_blocks=4, seed=0)
    native = model.model.native_decode
    first = native._layers()
    assert native._layers() is first  # nothing assigned: the same build
    qkv = model.model.layers[-1].self_attn.qkv_proj
    assert first.weights[-1].qkv.nibbles is None
    _quantize_to_int4(qkv)
    quantized = native._layers()
    assert quantized is not first and quantized.weights[-1].qkv.nibbles is qkv.low_bit.nibbles
    qkv.low_bit = None  # dropped by assignment, not through `quantize`
    assert native._layers().weights[-1].qkv.nibbles is None
    model.model.layers[0].self_attn.attn.backend = object()  # no native backend: the layers run op by op
    assert native._layers() is None
