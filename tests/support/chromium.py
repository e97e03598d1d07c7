"""A real headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for page tests.

Started with a fresh profile and `--remote-debugging-port=0`; Chromium writes the port it chose into
`DevToolsActivePort` in the profile, and the page's target has a websocket the tests talk JSON to.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, url: str, workdir: Path, width: int = 1400, height: int = 1000) -> None:
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError(
                "`chromium` not found: run scripts/setup.sh --dev (installs Debian's chromium)"
            )
        self.profile = workdir / "profile"
        self.profile.mkdir(parents=True)
        self.log = open(workdir / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "--hide-scrollbars", url],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self.ws = websocket.create_connection(self._page_websocket(url), timeout=60, suppress_origin=True)

    def _page_websocket(self, url: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        port_file = self.profile / "DevToolsActivePort"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited {self.process.returncode}: see {self.log.name}")
            if port_file.exists() and port_file.read_text().strip():
                port = port_file.read_text().split()[0]
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as response:
                    pages = [t for t in json.load(response) if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.2)
        raise RuntimeError(f"chromium gave no DevTools page in {timeout} s")

    def send(self, method: str, **params: Any) -> dict:
        call_id = next(self._ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30, interval: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"page never satisfied {expression!r} in {timeout} s")

    def screenshot(self, path: Path) -> None:
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.log.close()
