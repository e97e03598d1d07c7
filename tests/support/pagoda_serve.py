"""A real `pagoda serve` process on a free loopback port, for tests that need the whole pod."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.prometheus import free_port

REPO = Path(__file__).resolve().parents[2]


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"pagoda serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"pagoda serve not ready after {timeout} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def pagoda_serve(model: Path, flags: list[str], log: Path) -> Iterator[str]:
    """Yields the server's base URL once /ready; terminates it afterwards."""
    with pagoda_serve_process(model, flags, log) as (url, _):
        yield url


@contextlib.contextmanager
def pagoda_serve_process(model: Path, flags: list[str], log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, the server process) once /ready; terminated afterwards if still running."""
    port = free_port()
    argv = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *flags]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def metric_value(url: str, name: str) -> float:
    """A metric from a server's /metrics, summed over its label sets (`name{...} value` lines)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        values = [float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                  if line.startswith(name + "{")]  # fmt: skip
    if not values:
        raise AssertionError(f"{name} not exported")
    return sum(values)
