"""The roofline numbers against a hand calculation for one SmolLM2-135M decode step, and the peaks.

SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads (head_dim 64), vocab
49152, tied embeddings: 134,515,008 parameters (30 × 3,538,944 matmul weights per layer, the 49152 ×
576 embedding = head, 61 RMSNorm vectors of 576).
"""

from __future__ import annotations

import math

import pytest
import torch
from pagoda.server.engine.device_peaks import DevicePeaks, device_peaks, known_gpu_peaks, probe_peaks
from pagoda.server.engine.models.llama import LlamaForCausalLM
from pagoda.server.engine.roofline import ModelCosts, RooflineMeter, StepRoofline, step_cost

KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4  # K and V × layers × kv heads × head_dim × 4 bytes = 46,080


@pytest.fixture(scope="module")
def smollm2():
    from pagoda.server.engine.loader import default_gguf_path, load_model

    return load_model(default_gguf_path(), dtype="float32", device="cpu")


def test_the_config_is_the_one_the_hand_calculation_assumes(smollm2):
    c = smollm2.hf_config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (9, 3, 49152)
    assert c.tie_word_embeddings
    assert sum(p.numel() for p in smollm2.model.parameters()) == 134_515_008


def test_one_decode_step_of_smollm2_by_hand(smollm2):
    """One sequence with 100 tokens in the cache decodes its 101st."""
    costs = ModelCosts.from_model(smollm2.model, KV_BYTES_PER_TOKEN_FP32)
    cost = step_cost(costs, [(100, 1)], num_sampled=1)
    embedding = 49152 * 576 * 4  # = the LM head (tied): 113,246,208 bytes
    weights = 134_515_008 * 4 - embedding + 576 * 4 + embedding  # every weight, one embedding row
    assert cost.weight_bytes == weights == 538_062_336
    assert cost.kv_read_bytes == 101 * KV_BYTES_PER_TOKEN_FP32 == 4_654_080
    assert cost.kv_write_bytes == KV_BYTES_PER_TOKEN_FP32 == 46_080
    matmuls = 2 * 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)  # 212,336,640
    head = 2 * 49152 * 576  # 56,623,104
    attention = 30 * 101 * 4 * 9 * 64  # QKᵀ and PV over 101 keys: 6,981,120
    assert cost.flops == matmuls + head + attention == 275_940_864
    assert cost.bytes == 542_762_496
    # A decode step does about half a FLOP per byte: far left of any ridge (memory-bound).
    step = StepRoofline(0.01, 1, cost, DevicePeaks(20e9, 200e9, "test"))
    assert step.bound == "memory" and math.isclose(step.intensity, 275_940_864 / 542_762_496)
    assert math.isclose(step.bandwidth_utilization, 542_762_496 / 0.01 / 20e9)
    assert math.isclose(step.compute_utilization, 275_940_864 / 0.01 / 200e9)


def test_prefill_and_copy_on_write_terms():
    """A 10-token prefill with nothing cached sees 1+2+…+10 = 55 (query, key) pairs per layer; a chunk
    that samples nothing reads no LM head; a copied block is read once and written once."""
    with torch.device("meta"):
        model = LlamaForCausalLM(_smollm2_config())
    costs = ModelCosts.from_model(model, KV_BYTES_PER_TOKEN_FP32)
    full = step_cost(costs, [(0, 10)], num_sampled=1)
    chunk = step_cost(costs, [(0, 10)], num_sampled=0)
    assert full.flops - chunk.flops == 2 * 49152 * 576
    assert full.weight_bytes - chunk.weight_bytes == 49152 * 576 * 4
    assert chunk.flops == 10 * costs.body_flops_per_token + 30 * 55 * 4 * 9 * 64
    copied = step_cost(costs, [(40, 1)], num_sampled=1, num_copied_blocks=1, block_size=16)
    plain = step_cost(costs, [(40, 1)], num_sampled=1)
    assert copied.kv_read_bytes - plain.kv_read_bytes == 16 * KV_BYTES_PER_TOKEN_FP32
    assert copied.kv_write_bytes - plain.kv_write_bytes == 16 * KV_BYTES_PER_TOKEN_FP32


def test_weight_bytes_follow_the_tensors_dtype():
    with torch.device("meta"):
        model = LlamaForCausalLM(_smollm2_config())
    fp32 = ModelCosts.from_model(model, KV_BYTES_PER_TOKEN_FP32)
    bf16 = ModelCosts.from_model(model.to(torch.bfloat16), KV_BYTES_PER_TOKEN_FP32 // 2)
    assert bf16.body_bytes * 2 == fp32.body_bytes and bf16.head_bytes * 2 == fp32.head_bytes
    assert bf16.body_flops_per_token == fp32.body_flops_per_token


def test_sliding_window_reads_only_the_window():
    with torch.device("meta"):
        model = LlamaForCausalLM(_smollm2_config(sliding_window=8, model_type="mistral"))
    costs = ModelCosts.from_model(model, KV_BYTES_PER_TOKEN_FP32)
    assert costs.attended(100, 1) == (30 * 8, 30 * 8)  # 8 keys per layer, not 101
    assert costs.attended(0, 10) == (30 * 10, 30 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 8 + 8))


def test_layers_of_each_window_are_counted_once_each():
    """Interleaved full and sliding layers (Gemma-style): each layer reads its own window."""
    costs = ModelCosts(0, 0, 0, 0, 0, 0, 0, 0, 0, sliding_windows=(None, 8, None, 8, 4))
    assert costs.attended(100, 1) == (101 + 8 + 101 + 8 + 4, 101 + 8 + 101 + 8 + 4)
    assert costs.attended(2, 3)[1] == 2 * (3 + 4 + 5) + 2 * (3 + 4 + 5) + (3 + 4 + 4)


def test_meter_counts_bounds_and_records():
    with torch.device("meta"):
        model = LlamaForCausalLM(_smollm2_config())
    meter = RooflineMeter(
        ModelCosts.from_model(model, KV_BYTES_PER_TOKEN_FP32), DevicePeaks(20e9, 200e9, "t"), 16
    )
    meter.recording = []
    meter.observe([(100, 1)], 1, 0, 0.02)
    meter.observe([(0, 2048)], 1, 0, 5.0)  # a large prefill: ~250 FLOP/B, right of the 10 FLOP/B ridge
    assert meter.bound_steps == {"memory": 1, "compute": 1}
    assert [s.tokens for s in meter.recording] == [1, 2048]
    assert meter.seconds_total == 5.02 and meter.last.bound == "compute"


def _smollm2_config(**overrides):
    from transformers import LlamaConfig, MistralConfig

    values = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                  max_position_embeddings=8192, rms_norm_eps=1e-5)  # fmt: skip
    model_type = overrides.pop("model_type", "llama")
    return (MistralConfig if model_type == "mistral" else LlamaConfig)(**values, **overrides)


@pytest.mark.parametrize(
    ("name", "bandwidth", "flops"),
    [
        ("NVIDIA H200", 4.8e12, 989.5e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12, 989.5e12),
        ("NVIDIA H100 PCIe", 2.0e12, 756e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12, 312e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12, 312e12),
        ("NVIDIA L4", 300e9, 121e12),
    ],
)
def test_known_gpus(name, bandwidth, flops):
    peaks = known_gpu_peaks(name, torch.bfloat16)
    assert (peaks.bytes_per_s, peaks.flops_per_s) == (bandwidth, flops)
    assert peaks.source.startswith("https://www.nvidia.com/")
    assert known_gpu_peaks(name, torch.float32).flops_per_s < flops / 3  # FP32 without tensor cores


def test_unknown_devices_are_probed():
    assert known_gpu_peaks("Some Other Accelerator", torch.float32) is None
    peaks = device_peaks(torch.device("cpu"), torch.float32)
    assert peaks is probe_peaks(torch.device("cpu"), torch.float32)  # measured once per process
    assert peaks.source == "probe"
    assert 1e8 < peaks.bytes_per_s < 1e13 and 1e8 < peaks.flops_per_s < 1e14
