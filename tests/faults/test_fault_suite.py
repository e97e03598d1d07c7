"""The fault suite (e2e/faults.py; docs/reliability.md has the figures): each scenario runs real
processes — `pagoda serve`, the operator against the emulator over HTTP, Prometheus — injects one
fault and checks what users saw and what pagoda reported. CI runs the Prometheus outage for 20 s
(the docs' figures: 60 s): still longer than the 15 s scale-down window, so holding is exercised."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_scenario(tmp_path: Path, *args: str, timeout: int) -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "e2e" / "faults.py"), *args, "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(run.stdout[-8000:])
    assert (tmp_path / "summary.json").exists(), f"e2e/faults.py wrote no summary:\n{run.stderr[-3000:]}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = [summary, *(v for v in summary.values() if isinstance(v, dict) and "checks" in v)]
    failed = [name for s in sections for name, ok in s.get("checks", {}).items() if not ok]
    assert run.returncode == 0 and not failed, (failed, run.stderr[-3000:])
    return summary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_loop_death_fails_requests_at_once_and_exits_non_zero(tmp_path: Path) -> None:
    summary = run_scenario(tmp_path, "engine-death", timeout=280)
    assert summary["failed"] == summary["sent"] == 12 and summary["exit_code"] not in (0, None)
    assert summary["health_503_after_s"] <= 1.0
    assert (tmp_path / "engine-death.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_with_50_in_flight_finishes_them_all_and_refuses_newcomers(tmp_path: Path) -> None:
    summary = run_scenario(tmp_path, "drain", timeout=280)
    assert summary["sent"] == summary["succeeded"] == 50 and summary["exit_code"] == 0
    assert summary["newcomers"]["sent"] > 0 and "draining" in summary["newcomer_codes"]
    assert (tmp_path / "drain.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary (scripts/setup.sh)")
def test_pod_kill_operator_restarts_and_prometheus_outage(tmp_path: Path) -> None:
    summary = run_scenario(tmp_path, "cluster", "--outage-s", "20", "--down-window", "15", timeout=580)
    kill = summary["pod_kill"]
    assert kill["failed"] == sum(kill["failed_by_backend"].values()) > 0 and len(kill["failed_by_backend"]) == 1
    assert summary["operator_scale_up"]["children_after"]["pods"] == 3
    assert summary["prometheus_outage"]["spec_replicas_during_outage"] == [3]
    for name in ("pod-kill", "operator-restart", "operator-scale-up", "prometheus-outage"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
