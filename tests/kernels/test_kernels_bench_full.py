"""The GPU mode of `pagoda.kernels.bench`, run end to end on the CPU at tiny sizes.

There is no GPU here: the sizes are shrunk, `do_bench` and the device-wide measurements are replaced
by stand-ins (timings are meaningless), and free device memory is faked. What this proves is that
the one GPU command has no broken path: every check, timing row and report line (the engine's GPU
checks are benchmarks/engine_gpu_check.py: tests/kernels/test_kernels_engine_gpu_check.py).
"""

import json

import pytest
import torch
import triton.testing
from pagoda.kernels import bench


@pytest.fixture
def tiny_bench(monkeypatch):
    for name, value in {
        "NUM_HEADS": 8, "NUM_KV_HEADS": 2, "HEAD_DIM": 32, "BLOCK_SIZE": 8,
        "DECODE_BATCHES": (1, 3), "DECODE_CONTEXTS": (40,), "DECODE_TARGET": (3, 40),
        "DECODE_SWEEP": ((32, 1), (16, 2)), "PREFILL_CASES": ((2, 20, 20), (1, 12, 50)),
        "STORE_TOKENS": (5,), "CHECKED_ROWS": 8, "POISONED_LENS": [10, 30],
        "PREFILL_TARGET": (1, 12, 20), "PREFILL_SWEEP": ((32, 16),),
    }.items():  # fmt: skip
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda run, device: 1000.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda run, device: 100.0)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))


def test_bench_full_mode_runs_every_path(tiny_bench, tmp_path):
    report = bench.Report(device="cpu (stand-in)", versions={})
    saved_timings = []  # what a run killed at its time limit would have left, section by section
    bench.run_full(report, torch.device("cpu"), checkpoint=lambda: saved_timings.append(len(report.timings)))
    bench.write_report(report, tmp_path)

    assert len(saved_timings) >= 5 and saved_timings == sorted(saved_timings)
    assert len(set(saved_timings)) >= 4 and saved_timings[-1] == len(report.timings)

    assert report.passed, [c for c in report.checks if not c["ok"]]
    kernels = {t["kernel"] for t in report.timings}
    assert kernels == {"store_kv", "decode", "prefill"}
    assert any("sweep" in t["case"] for t in report.timings if t["kernel"] == "decode")
    assert any("sweep" in t["case"] for t in report.timings if t["kernel"] == "prefill")
    assert all("tflops" in t for t in report.timings if t["kernel"] == "prefill")
    assert {c["kernel"] for c in report.checks} == {"store_kv", "decode", "prefill"}  # kernels only
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["passed"] is True
    assert "| prefill |" in (tmp_path / "bench.md").read_text()
