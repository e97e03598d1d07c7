"""How the KV pool is sized at start: a byte budget on CPU, profiled free memory on CUDA.

There is no GPU here, so the CUDA memory counters (and only they) are stand-ins: the profiling
forward itself runs for real on the CPU with the metadata of a full step.
"""

from __future__ import annotations

import torch
from pagoda.server.engine.model_runner import KVCacheSpec, ModelRunner

GiB = 1 << 30


def runner_for(llama, block_size: int = 16) -> ModelRunner:
    model = llama.loaded.model
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, torch.float32, block_size)
    return ModelRunner(model, spec, torch.device("cpu"))


def test_cpu_pool_is_the_byte_budget_in_whole_blocks(llama):
    runner = runner_for(llama)
    per_block = runner.spec.bytes_per_block
    assert runner.num_blocks_for_budget(10 * per_block + per_block // 2, 0.9, 2048) == 10
    assert runner.num_blocks_for_budget(per_block - 1, 0.9, 2048) == 0


def test_cuda_pool_is_utilisation_minus_weights_activations_and_other_processes(llama, monkeypatch):
    runner = runner_for(llama)
    calls = []
    total, free, reserved, peak = 80 * GiB, 70 * GiB, 6 * GiB, 5 * GiB
    for name, value in {
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: calls.append("reset"),
        "synchronize": lambda device=None: calls.append("sync"),
        "max_memory_allocated": lambda device=None: peak,
        "memory_reserved": lambda device=None: reserved,
        "mem_get_info": lambda device=None: (free, total),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    num_tokens = 2048
    budget = runner._cuda_kv_budget(0.9, num_tokens)

    # The profiling step's temporary KV blocks are in the peak but are not activations.
    temp = -(-num_tokens // runner.spec.block_size) * runner.spec.bytes_per_block
    other_processes = total - free - reserved
    assert budget == int(0.9 * total - (peak - temp) - other_processes)
    assert calls == ["reset", "sync"]  # the peak is read after the profiling forward finished
    assert runner.kv_caches == []  # the temporary cache is released before the real one
