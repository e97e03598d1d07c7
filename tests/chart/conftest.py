"""Fixtures for the chart tests: the tools (helm, promtool) and the rendered chart."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagoda"
DASHBOARDS = CHART / "dashboards"
RULES = CHART / "rules" / "pagoda-rules.yaml"


def _tool(name: str, how_to_get: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(REPO / ".venv" / "bin"))
    if path is None:
        pytest.fail(f"`{name}` not found on PATH nor in .venv/bin: {how_to_get}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def helm() -> str:
    return _tool("helm", "run scripts/get-helm.sh (scripts/setup.sh --dev does)")


@pytest.fixture(scope="session")
def promtool() -> str:
    return _tool("promtool", "run scripts/setup.sh --dev (installs Debian's prometheus package)")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


@pytest.fixture(scope="session")
def render(helm: str):
    """render(*helm_template_args) -> list of objects (CRDs included)."""

    def _render(*args: str) -> list[dict]:
        out = run(
            helm, "template", "pagoda", str(CHART), "--namespace", "pagoda-system", "--include-crds", *args
        )
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]

    return _render
