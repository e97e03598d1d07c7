"""scripts/get-helm.sh: clean shell, and idempotent (a present helm is reused, not downloaded again)."""

from __future__ import annotations

import shutil

import pytest
from chart_support import REPO, run

SCRIPT = REPO / "scripts" / "get-helm.sh"


def test_get_helm_is_clean_shell():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("`shellcheck` not found: run scripts/setup.sh --dev (installs Debian's shellcheck)")
    run(shellcheck, str(SCRIPT))
    run("bash", "-n", str(SCRIPT))


def test_get_helm_reuses_the_helm_it_finds(helm):
    result = run(str(SCRIPT))  # helm is present (the fixture found it): no download, just its version
    assert result.stdout.strip().startswith("v3.")
    assert result.stdout.strip() == run(helm, "version", "--short").stdout.strip()
