"""Low-bit weights for few-row steps: GGUF Q4 blocks unpacked exactly, the Q8_0 LM head's int8 copy
within its rounding, 4-bit copies made from dense weights (`--quantization int4`), the row rule that
picks them, and what they cost in accuracy on SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagoda.kernels import cpu_native
from pagoda.server.engine import gguf_int4
from pagoda.server.engine.dense_int4 import int4_groups
from pagoda.server.engine.gguf_int4 import quantize_from_gguf
from pagoda.server.engine.layers.linear import Linear
from pagoda.server.engine.layers.quantized import FEW_ROWS, Int4Weight, Int8Weight
from pagoda.server.engine.loader import load_model, resolve_model_source, resolve_quantization

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm2_fp32():
    """SmolLM2 dense (transformers' dequantized weights) with the GGUF's low-bit copies added in fp32,
    where the int4 scales are exact."""
    loaded = load_model(None, dtype="float32")
    swapped = quantize_from_gguf(loaded.model, resolve_model_source(None).path, torch.float32)
    return loaded, swapped


def test_gguf_q4_blocks_are_the_dequantized_weights_bit_for_bit(smollm2_fp32):
    # q/k rows un-permuted like transformers' reader, shards stacked in the fused layers' order.
    loaded, swapped = smollm2_fp32
    layers = [m for m in loaded.model.modules() if isinstance(m, Linear) and m.low_bit is not None]
    assert swapped == len(layers) == 4 * loaded.model.cfg.num_layers
    # Through the kernel (a slow path at this many rows): the first and last layers' four projections.
    for layer in layers[:4] + layers[-4:]:
        assert isinstance(layer.low_bit, Int4Weight) and layer.low_bit.group_size == 32
        assert torch.equal(layer.low_bit.dequantize(), layer.weight)


def test_gguf_blocks_read_alike_from_the_tensor_table_and_through_gguf_reader(monkeypatch):
    # The fast path reads only the tensor table; gguf's GGUFReader (older transformers) parses it all.
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    path = resolve_model_source(None).path
    fast = gguf_int4._file_tensors(path)

    def unreadable(_path):
        raise ValueError("a tensor type this reader does not take")

    monkeypatch.setattr(reader.GgufHeader, "from_file", unreadable)
    slow = gguf_int4._file_tensors(path)
    assert fast.keys() == slow.keys() and {kind for kind, _ in fast.values()} == {"F32", "Q4_1", "Q8_0"}
    blocks = [name for name, (kind, _) in fast.items() if kind in gguf_int4.INT4_TYPES]
    assert len(blocks) == 210
    for name in blocks:
        assert fast[name][0] == slow[name][0] and np.array_equal(fast[name][1], slow[name][1]), name


def test_q8_lm_head_int8_copy_is_within_half_a_step(smollm2_fp32):
    loaded, _ = smollm2_fp32
    head = loaded.model.lm_head
    assert isinstance(head.low_bit, Int8Weight)
    error = (head.low_bit.dequantize().float() - head.weight).abs()
    assert bool((error <= head.low_bit.scales.float()[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_int4_matmul_matches_its_dense_weight(native, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (96, 128), generator=gen)
    scales, zeros = torch.rand(96, 4, generator=gen) / 10, torch.randn(96, 4, generator=gen) / 10
    if not native:  # a CPU without vector kernels: torch's weight-only int4 kernel
        monkeypatch.setattr(cpu_native, "has_vector_kernels", lambda: False)
    weight = Int4Weight(q, scales, zeros, torch.float32)
    assert (weight.nibbles is not None) == (native and cpu_native.has_vector_kernels())
    dense = (q - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    assert torch.allclose(weight.dequantize(), dense, atol=1e-6)
    x = torch.randn(3, 128, generator=gen)
    assert torch.allclose(weight.matmul(x, None), x @ dense.t(), atol=1e-3, rtol=1e-3)


def test_low_bit_copy_serves_only_few_row_steps():
    layer = Linear(64, 32, bias=False)
    torch.nn.init.normal_(layer.weight)
    # A stand-in low-bit copy that is deliberately twice the dense weight shows which path ran.
    layer.quantize(Int8Weight(2 * layer.weight.detach(), torch.float32))
    few, many = torch.randn(FEW_ROWS, 64), torch.randn(FEW_ROWS + 1, 64)
    with torch.no_grad():
        doubled = 2 * few @ layer.weight.t()
        assert (layer(few) - doubled).norm() < 0.02 * doubled.norm()  # the int8 copy (within its rounding)
        assert torch.allclose(layer(many), many @ layer.weight.t(), atol=1e-4)  # the dense weight
    with pytest.raises(ValueError, match="low-bit weight is 32x32"):
        layer.quantize(Int8Weight(torch.randn(32, 32), torch.float32))


def test_quantization_choice(tiny_llama_dir):
    gguf, folder = resolve_model_source(None), resolve_model_source(tiny_llama_dir)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", gguf, cpu) == "gguf"
    assert resolve_quantization("auto", gguf, cuda) == "none"
    assert resolve_quantization("auto", folder, cpu) == "none"  # int4 changes the numbers: asked for only
    assert resolve_quantization("int4", folder, cpu) == resolve_quantization("int4", gguf, cpu) == "int4"
    for quantization in ("gguf", "int4"):
        with pytest.raises(ValueError, match="CPU kernels"):
            resolve_quantization(quantization, gguf, cuda)
        with pytest.raises(ValueError, match="one rank only"):
            resolve_quantization(quantization, gguf, cpu, tp_size=2)
    with pytest.raises(ValueError, match=r"is an HF folder .*'int4'"):
        resolve_quantization("gguf", folder, cpu)
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", gguf, cpu)


def test_int4_groups_hold_every_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(48, 128, generator=gen)
    dense[0, :32] = 0.25  # a constant group: no step at all
    dense[1, 32:64] *= 1000  # a wide group beside narrow ones: each group has its own scale
    q, scale, zero = int4_groups(dense)
    assert q.shape == dense.shape and scale.shape == zero.shape == (48, 4)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    step = scale.repeat_interleave(32, dim=1)
    restored = (q - 8) * step + zero.repeat_interleave(32, dim=1)
    assert bool(((restored - dense).abs() <= step / 2 + 1e-6 * dense.abs()).all())
    groups = restored.view(48, 4, 32)
    assert torch.allclose(groups.amin(-1), dense.view(48, 4, 32).amin(-1), atol=1e-6)  # its ends on the grid
    assert torch.allclose(groups.amax(-1), dense.view(48, 4, 32).amax(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(restored[0, :32], dense[0, :32])
    weight = Int4Weight(q, scale, zero, torch.float32)  # what the layers run: the same numbers
    assert torch.allclose(weight.dequantize(), restored, rtol=1e-6, atol=1e-5)


def _dense_stand_in(loaded):
    """The int4-quantized model's weights as plain dense ones (the low-bit copies dequantized, then
    dropped): what the 4-bit path must compute."""
    for module in loaded.model.modules():
        if getattr(module, "low_bit", None) is not None:
            module.weight.data.copy_(module.low_bit.dequantize())
            module.low_bit = None
    return loaded


def test_int4_copies_of_an_hf_folder_run_the_one_row_steps(tiny_llama_dir):
    """`--quantization int4` on an HF folder: every decoder projection gets groups of 32, the LM head
    int8; one-row steps run on them, and give what dense weights of the same values give. (Prompts of
    one token: a longer prefill runs on the original dense weights.)"""
    loaded = load_model(tiny_llama_dir, dtype="float32", quantization="int4")
    layers = [m for m in loaded.model.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.low_bit, Int4Weight) and m.low_bit.group_size == 32 for m in layers)
    assert isinstance(loaded.model.lm_head.low_bit, Int8Weight)
    reference = _dense_stand_in(load_model(tiny_llama_dir, dtype="float32", quantization="int4"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    quantized, dense = LLM(loaded=loaded), LLM(loaded=reference)
    for prompt in ([5], [17], [42]):  # one at a time: every step has one row
        (want,) = dense.generate([prompt], params)
        (got,) = quantized.generate([prompt], params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        chosen = zip(got.outputs[0].logprobs, want.outputs[0].logprobs, want.outputs[0].token_ids, strict=True)
        for a, b, token in chosen:
            assert abs(a[token] - b[token]) < 1e-3


def test_low_bit_greedy_agrees_with_dequantized_weights():
    """bf16 serving: decode steps of one sequence run on the 4-bit layers and the int8 head (the GGUF's
    own blocks, or int4 copies made from the dense weights). Against the same model on its dense
    (dequantized) weights: most greedy tokens agree.
    Measured on 100 prompts: docs/benchmarks.md (benchmarks/accuracy.py)."""
    prompts = ["The capital of France is", "def add(a, b):", "The three primary colours are"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    dense = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=32 << 20)
    wanted = [dense.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    for quantization in ("gguf", "int4"):
        low_bit = LLM(dtype="bfloat16", quantization=quantization, kv_cache_memory=32 << 20)
        agree = total = 0
        for prompt, first in zip(prompts, wanted, strict=True):  # one at a time: one-row decode steps
            got = low_bit.generate([prompt], params)[0].outputs[0].token_ids
            assert got[0] == first[0]  # the first token comes from the dense prefill
            prefix = next((i for i, (x, y) in enumerate(zip(first, got, strict=True)) if x != y), 16)
            agree, total = agree + prefix, total + 16
        assert agree / total >= 0.5, f"{quantization}: greedy tokens agree only {agree}/{total} before diverging"


def test_a_cast_int4_weight_still_multiplies():
    """Casting a module casts its buffers: bf16 scales are not what the native kernel reads, so torch's
    kernel runs them (and the native decode layers decline the projection at few rows)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 128), generator=gen)
    scales, zeros = torch.rand(64, 4, generator=gen) / 10, torch.randn(64, 4, generator=gen) / 10
    layer = Linear(128, 64, bias=False)
    layer.quantize(Int4Weight(q, scales, zeros, torch.float32))
    x = torch.randn(2, 128, generator=gen)
    expected = layer.low_bit.matmul(x, None)
    layer.to(torch.bfloat16)
    got = layer.low_bit.matmul(x.bfloat16(), None)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() <= 2**-6 * expected.abs().max()
    assert layer.native_projection().kernel(1, torch.bfloat16) is None
