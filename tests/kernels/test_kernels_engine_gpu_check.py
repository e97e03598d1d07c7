"""benchmarks/engine_gpu_check.py (the engine's GPU checks) end to end on the CPU at tiny sizes.

There is no GPU here: the models are shrunk and the Triton kernels run under the interpreter (conftest). What
this proves is that the GPU command has no broken path: the Triton-vs-torch greedy check, the KV pool
sizing note and the decode-step timings all come out, and the report is written.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300)  # fmt: skip


@pytest.fixture
def engine_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("engine_gpu_check", REPO / "benchmarks" / "engine_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    for name, value in {
        "ENGINE_BATCHES": (2,), "ENGINE_PROMPT": 12, "ENGINE_STEPS": 3, "CHECK_TOKENS": 3,
        "ENGINE_MODEL": {**TINY, "max_position_embeddings": 128},
        "CHECK_MODEL": {**TINY, "max_position_embeddings": 512},
    }.items():  # fmt: skip
        monkeypatch.setattr(module, name, value)
    return module


def test_engine_gpu_check_runs_every_path(engine_check, tmp_path):
    report = engine_check.Report(device="cpu (stand-in)")
    engine_check.run(report, torch.device("cpu"))
    engine_check.write_report(report, tmp_path)

    assert report.engine and report.engine[0]["decode_steps"] >= 1, report.notes
    assert any(note.startswith("engine KV pool sized") for note in report.notes)
    # triton == torch greedy, and the CUDA-graph path == eager (the same path here: no graphs on CPU)
    assert [c["ok"] for c in report.checks if c["kernel"] == "engine"] == [True, True]
    assert [(e["batch"], e["mode"]) for e in report.engine] == [(2, "CUDA graphs"), (2, "eager")]
    assert report.passed
    saved = json.loads((tmp_path / "engine_check.json").read_text())
    assert saved["passed"] is True
    assert "| engine decode step |" in (tmp_path / "engine_check.md").read_text()
