"""The local end-to-end run (`python e2e/local.py`, see e2e/README.md): the real operator scales real
`pagoda serve` processes 1 → 2 → 1 under a load that saturates one server's KV cache. Shortened: a 40 s
load and a 15 s scale-down window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_e2e_scales_up_under_kv_pressure_and_back_down(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "e2e" / "local.py"),
            "--out",
            str(tmp_path),
            "--load-seconds",
            "40",
            "--down-window",
            "15",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=570,
    )
    print(run.stdout[-6000:])
    assert (tmp_path / "summary.json").exists(), f"e2e/local.py wrote no summary:\n{run.stderr[-3000:]}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert run.returncode == 0 and not failed, (failed, run.stderr[-3000:])
    assert summary["max_desired_replicas"] >= 2 and summary["failed"] == 0
    assert len(summary["requests_per_backend"]) >= 2  # the new replica served requests
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
