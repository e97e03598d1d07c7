"""`pagoda generate` and `pagoda plan` as a user runs them (subprocess, default embedded model)."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def pagoda(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args], capture_output=True, text=True, env=ENV, timeout=600
    )


def test_generate_default_model_knows_paris():
    result = pagoda("generate", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout


def test_generate_reports_bad_input_clearly():
    result = pagoda("generate", "hello", "--top-p", "0")
    assert result.returncode == 2
    assert "top_p: must be in (0, 1]" in result.stdout


def test_generate_reports_a_model_it_cannot_load_clearly(tmp_path):
    result = pagoda("generate", "hello", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not a folder, a .gguf file" in result.stdout
    result = pagoda("generate", "hello", "--quantization", "int4", "--device", "cuda")
    assert result.returncode == 2
    assert "runs on CPU kernels" in result.stdout


def test_plan_prints_capacity_arithmetic():
    result = pagoda("plan", "--kv-cache-memory", "1GiB", "--context-len", "2048")
    assert result.returncode == 0, result.stderr[-2000:]
    # SmolLM2-135M: 30 layers × 3 kv heads × 64 head_dim × 2 (K, V) × 4 bytes (fp32) = 46,080 bytes/token
    assert "46,080 bytes per token" in result.stdout
    blocks = (1 << 30) // (46080 * 16)
    assert f"KV cache blocks: {blocks:,}" in result.stdout
    assert f"KV cache capacity: {blocks * 16:,} tokens" in result.stdout
    assert f"Maximum concurrency for 2,048 tokens per request: {blocks / 128:.2f}x" in result.stdout
