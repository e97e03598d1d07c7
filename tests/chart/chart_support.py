"""Paths, tools and dashboard-query helpers shared by the chart tests (a uniquely named module:
`conftest` is a name every test area has)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagoda"
DASHBOARDS = CHART / "dashboards"
RULES = CHART / "rules" / "pagoda-rules.yaml"


def tool(name: str, how_to_get: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(REPO / ".venv" / "bin"))
    if path is None:
        pytest.fail(f"`{name}` not found on PATH nor in .venv/bin: {how_to_get}", pytrace=False)
    return path


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def load_dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict) -> Iterator[dict]:
    """Every panel, including those nested in collapsed rows."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    where: str  # dashboard / panel title / refId, for messages
    expr: str  # PromQL with Grafana variables still in it


def queries(board: dict, name: str) -> list[Query]:
    """Every PromQL expression of a dashboard: panel targets, and the series selector inside each
    `label_values(selector, label)` variable query."""
    found = [
        Query(f"{name} / {panel['title']} / {target['refId']}", target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"])
            assert match, f"{name}: variable {variable['name']}: not a label_values(selector, label) query"
            found.append(Query(f"{name} / variable {variable['name']}", match.group(1)))
    return found


def substitute(expr: str, values: dict[str, str], rate_interval: str) -> str:
    """Replace Grafana's variables as Grafana does before sending a query to Prometheus."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in values.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    leftover = re.search(r"\$\{?(?!1\b)[A-Za-z_]\w*", expr)  # "$1" is label_replace's, not Grafana's
    assert leftover is None, f"unsubstituted variable {leftover.group(0)} in {expr}"
    return expr
