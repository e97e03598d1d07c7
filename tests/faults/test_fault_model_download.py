"""Model download failures (`hf://`): the init container's module, run as the container runs it,
against a local stand-in for the Hub (tests/support/hub_stub.py; no internet here).

Each failure exits 1 with a last stderr line naming the cause, and leaves no completion marker; the
marker is written last and checked first (a complete model never asks the hub again). Disk full is a
real ENOSPC: the target is a 256 KiB tmpfs mounted in a private user + mount namespace
(`unshare -rm`, no root needed); where the kernel forbids user namespaces that case is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pagoda.server.model_download import FAILURE_PREFIX, MARKER
from support.hub_stub import GOOD_TOKEN, SHA, HubStub


@pytest.fixture
async def hub():
    stub = HubStub()
    await stub.start()
    yield stub
    await stub.stop()


def download_env(hub: HubStub, target: Path, repo: str, revision: str = "main", token: str | None = None) -> dict:
    env = {**os.environ, "PAGODA_MODEL": str(target), "HF_REPO_ID": repo, "HF_REVISION": revision,
           "HF_ENDPOINT": hub.url, "HF_HOME": str(target.parent / "hf-home"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return env


async def run_download(env: dict, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """The module in a subprocess (the event loop keeps serving the stub meanwhile)."""
    import asyncio

    process = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, "-m", "pagoda.server.model_download", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode, output.decode()


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


@pytest.mark.parametrize(("repo", "revision", "token", "cause"), [
    ("org/missing", "main", None, "repository not found: org/missing"),
    ("org/model", "v9", None, "revision not found: 'v9' is not a branch, tag or commit of org/model"),
    ("org/private", "main", "bad-token", "token refused: the hub answered 401"),
])
async def test_a_failed_download_names_its_cause_and_leaves_no_marker(hub, tmp_path, repo, revision, token, cause):
    target = tmp_path / "models" / "m"
    code, output = await run_download(download_env(hub, target, repo, revision, token))
    assert code == 1, output
    assert last_line(output).startswith(FAILURE_PREFIX + cause), output
    assert not (target / MARKER).exists()


async def test_the_marker_is_written_last_and_checked_first(hub, tmp_path):
    target = tmp_path / "models" / "m"
    code, output = await run_download(download_env(hub, target, "org/private", token=GOOD_TOKEN))
    assert code == 0, output
    assert (target / MARKER).read_text() == "main" and (target / "model.safetensors").stat().st_size == 1 << 20
    asked = len(hub.requests)
    code, output = await run_download(download_env(hub, target, "org/private", token=GOOD_TOKEN))
    assert code == 0 and "skipping download" in output
    assert len(hub.requests) == asked  # a complete model never asks the hub again
    assert SHA  # the stub's commit is what the files resolve to


def user_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not user_namespaces_work(), reason="unshare -rm (user namespaces) is not allowed here")
async def test_disk_full_is_named_and_leaves_no_marker(hub, tmp_path):
    """A 256 KiB volume for a 1 MiB weight file: ENOSPC mid-download, as on a too-small PVC."""
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    env = download_env(hub, target, "org/model")
    env["HF_HOME"] = str(target / ".hf-home")  # the cache lives on the PVC too (as the operator renders)
    listing = tmp_path / "listing"  # what the volume held after the failure, seen from inside
    script = f'mount -t tmpfs -o size=256k tmpfs "{target}" || exit 99; "$@"; rc=$?; ls -a "{target}" > "{listing}"; exit $rc'
    code, output = await run_download(env, prefix=("unshare", "-rm", "sh", "-c", script, "sh"))
    assert code == 1, output
    assert last_line(output).startswith(FAILURE_PREFIX + "disk full: the weight volume ran out of space"), output
    held = listing.read_text().split()
    assert MARKER not in held and "config.json" in held  # half a model, and it is not marked complete
