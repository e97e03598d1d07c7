"""fp32 serving of a checkpoint of bf16 values (`layers/bf16_storage.py`): the projections, embedding and
LM head keep the weights in bf16, and every logit and KV cache entry is the one the same weights held
in fp32 give, bit for bit, over prefill, mixed and decode steps (native decode layers and op by op),
as well as within the parity tolerance of transformers in fp32 on that checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from models_paged_harness import PagedHarness, max_logits_diff, run_schedule, schedule_token_counts
from pagoda.kernels import cpu_native
from pagoda.server.engine.layers import bf16_storage
from pagoda.server.engine.layers.linear import Linear
from pagoda.server.engine.loader import load_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.skipif(
    not cpu_native.has_vector_kernels(), reason="bf16 weights under fp32 rows need the native fp32 kernels"
)


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama folder with its weights saved in bf16, as published checkpoints are."""
    folder = tmp_path_factory.mktemp("bf16") / "tiny-llama-bf16"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _sequences(vocab_size: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return {s: torch.randint(0, vocab_size, (n,), generator=gen).tolist() for s, n in schedule_token_counts().items()}


def _run(model, sequences, native: bool):
    model.model.native_decode.enabled = native
    harness = PagedHarness(model, block_size=8, num_blocks=64, seed=2)
    return run_schedule(harness, sequences), harness.kv_caches


def test_bf16_values_stay_bf16_under_fp32(bf16_checkpoint, tiny_llama_dir):
    model = load_model(bf16_checkpoint, dtype="float32").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.float32 and model.dtype == torch.float32
    random_fp32 = load_model(tiny_llama_dir, dtype="float32").model  # fp32 values: nothing to narrow
    assert all(p.dtype == torch.float32 for p in random_fp32.parameters())


@pytest.mark.parametrize("native", [True, False])
def test_logits_and_kv_equal_the_fp32_weights(bf16_checkpoint, native, monkeypatch):
    narrow = load_model(bf16_checkpoint, dtype="float32").model
    monkeypatch.setattr(bf16_storage, "takes", lambda device, dtype: False)
    wide = load_model(bf16_checkpoint, dtype="float32").model
    assert wide.model.embed_tokens.weight.dtype == torch.float32
    sequences = _sequences(narrow.cfg.vocab_size)
    (got, got_kv), (expected, expected_kv) = _run(narrow, sequences, native), _run(wide, sequences, native)
    if native:  # the decode steps ran as one native call on the bf16 weights
        assert narrow.model.native_decode._layers().kernels(1) is not None
    for seq, chunks in expected.items():
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got[seq], chunks, strict=True)), seq
    assert all(torch.equal(a, b) for layer_a, layer_b in zip(got_kv, expected_kv, strict=True)
               for a, b in zip(layer_a, layer_b, strict=True))  # fmt: skip


def test_within_transformers_fp32_parity(bf16_checkpoint):
    ours = load_model(bf16_checkpoint, dtype="float32").model
    reference = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32, attn_implementation="eager")
    sequences = _sequences(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = {s: reference(torch.tensor([ids])).logits[0].float() for s, ids in sequences.items()}
    results, _ = _run(ours, sequences, native=True)
    assert max_logits_diff(results, expected) <= 1e-4
