"""`pagoda top` against a real server: one frame printed by the real command, and frames rendered
from snapshots taken while an n=2 request shares its prompt blocks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

from pagoda.server.api.state import ServerConfig
from pagoda.server.top_cli import fetch_state, render_frame
from rich.console import Console


def top_once(url: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "top", url, "--once", *flags],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def as_text(state: dict, width: int = 100) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render_frame(state, width))
    return console.export_text()


def test_one_frame_from_the_command(server):
    result = top_once(server.url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"· {server.state.model_name} · step" in out
    assert "blocks in use 0/64" in out and "vs target 70%" in out
    assert "·" * 64 in out  # the whole pool, free


def test_unreachable_pod_is_a_clear_error():
    result = top_once("http://127.0.0.1:9")
    assert result.returncode == 1 and "cannot read http://127.0.0.1:9/kv/state" in result.stdout


def test_frames_while_samples_share_blocks(server):
    prompt = "Seven silver swans swam silently southward, " * 3
    body = json.dumps({"model": server.state.model_name, "prompt": prompt, "max_tokens": 80, "n": 2,
                       "temperature": 1.0, "seed": 1, "ignore_eos": True}).encode()  # fmt: skip
    request = urllib.request.Request(
        server.url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    thread = threading.Thread(target=lambda: urllib.request.urlopen(request, timeout=120).read(), daemon=True)
    thread.start()
    frame = ""
    while thread.is_alive():
        state = fetch_state(server.url, None)
        if 2 in state["blocks"]["ref_count"] and state["requests"]:
            frame = as_text(state)
            break
    thread.join(120)
    assert frame, "never saw the samples share blocks"
    assert "2" * 3 in frame  # at least three shared prompt blocks, drawn as their ref count
    assert " #0 " in frame and " #1 " in frame and "0→" in frame  # both samples' block tables
    assert "sharing via reference counts" in frame  # the fork event, with the paper's term
    after = as_text(fetch_state(server.url, None))
    assert "blocks in use 0/64" in after
    assert re.search(r"copy-on-write [1-9]", after)  # the samples diverged into copies


def test_api_key(start_server):
    keyed = start_server(ServerConfig(api_key="k3y"))
    assert top_once(keyed.url).returncode == 1
    result = top_once(keyed.url, "--api-key", "k3y")
    assert result.returncode == 0 and "blocks in use" in result.stdout
