import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_smoke_runs_as_a_script_from_the_checkout(tmp_path):
    """`python kernels/bench.py --smoke` (the path a GPU box without our package takes) checks every
    kernel against the reference and writes its report."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "kernels/bench.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["passed"] is True
    kernels = {check["kernel"] for check in report["checks"]}
    assert kernels == {"store_kv", "decode", "prefill"}
    assert all(check["ok"] for check in report["checks"])
    assert "| decode |" in (tmp_path / "bench.md").read_text()
