import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def test_kernels_compile_for_h100_without_spills():
    """The kernels build into sm_90 cubins (the interpreter alone would accept code the compiler
    rejects), keep everything in registers, and put both attention dots on tensor cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {r["kernel"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(reports) == {"decode split=False", "decode split=True", "decode reduce", "prefill", "store_kv"}
    for report in reports.values():
        assert report.get("spill_stack_bytes", 0) == 0, report
    for name in ("decode split=False", "decode split=True", "prefill"):
        assert reports[name]["tensor_core_ops"] > 0, reports[name]
