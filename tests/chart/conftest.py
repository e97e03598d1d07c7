"""Fixtures for the chart tests: the tools (helm, promtool) and the rendered chart."""

from __future__ import annotations

import pytest
import yaml
from chart_support import CHART, run, tool


@pytest.fixture(scope="session")
def helm() -> str:
    return tool("helm", "run scripts/get-helm.sh (scripts/setup.sh --dev does)")


@pytest.fixture(scope="session")
def promtool() -> str:
    return tool("promtool", "run scripts/setup.sh --dev (installs Debian's prometheus package)")


@pytest.fixture(scope="session")
def render(helm: str):
    """render(*helm_template_args) -> list of objects (CRDs included)."""

    def _render(*args: str) -> list[dict]:
        out = run(
            helm, "template", "pagoda", str(CHART), "--namespace", "pagoda-system", "--include-crds", *args
        )
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]

    return _render
