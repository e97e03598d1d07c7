"""The kind scripts (they need Docker and kind, so they cannot run here): strict, parseable, lint-clean,
and the example InferenceService they apply is valid against the CRD's schema."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from pagoda.operator import crd

ROOT = Path(__file__).resolve().parents[2]
KIND = ROOT / "e2e" / "kind"
SCRIPTS = sorted(KIND.glob("*.sh"))


def test_scripts_exist_and_are_strict() -> None:
    assert {p.name for p in SCRIPTS} >= {"up.sh", "demo.sh", "down.sh", "env.sh"}
    for script in SCRIPTS:
        if script.name != "env.sh":  # sourced, not run
            assert "set -euo pipefail" in script.read_text(), script.name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck")
def test_shellcheck_clean() -> None:
    result = subprocess.run(
        ["shellcheck", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_demo_applies_the_cpu_example_valid_and_autoscaled() -> None:
    demo = (KIND / "demo.sh").read_text()
    assert "examples/cpu-smollm2.yaml" in demo
    body = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(body, schema)
    assert body["metadata"]["name"] == "smollm2-cpu"  # ISVC in env.sh
    assert body["spec"]["resources"]["gpus"] == 0 and body["spec"]["autoscaling"]["enabled"] is True
    assert "uri" not in body["spec"]["model"]  # the image's embedded default model: nothing to download
    assert 'ISVC="${ISVC:-smollm2-cpu}"' in (KIND / "env.sh").read_text()
