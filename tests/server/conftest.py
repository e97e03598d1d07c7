"""Servers for the HTTP tests: the real app and engine on a free loopback port, in a thread of its own.

The server's event loop runs in a background thread so tests can use the official (synchronous)
`openai` client and plain HTTP against it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pagoda.server.api.lifecycle import PagodaServer
from pagoda.server.api.state import ServerConfig
from pagoda.server.engine.config import EngineArgs
from support.tiny_models import tiny_model_dir

# A small pool (64 blocks x 16 tokens) so leaks and limits show quickly.
# float32: server answers are compared with fp32 offline runs and transformers (auto is bf16 on CPUs
# with native bf16).
TINY_ENGINE = {"block_size": 16, "num_blocks": 64, "max_num_seqs": 8, "max_model_len": 256, "dtype": "float32"}


class ServerThread:
    def __init__(self, engine_args: EngineArgs, config: ServerConfig | None = None) -> None:
        self.engine_args = engine_args
        self.server = PagodaServer(config or ServerConfig(), host="127.0.0.1", port=0)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="pagoda-server")

    def start(self) -> ServerThread:
        self._thread.start()
        self.call(self.server.start())
        self.call(self.server.load(self.engine_args), timeout=300)
        return self

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def state(self):
        return self.server.state

    def stats(self):
        return self.state.stats()

    def stop(self) -> None:
        self.call(self.server.drain_and_stop(timeout=5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_dir("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_engine() -> dict[str, int]:
    return dict(TINY_ENGINE)


@pytest.fixture(scope="module")
def start_server(tiny_dir) -> Iterator[Callable[..., ServerThread]]:
    """start_server(config=None, model=tiny_dir, **engine_overrides) -> a running server, stopped after the module."""
    started: list[ServerThread] = []

    def start(
        config: ServerConfig | None = None, model: Path | str | None = tiny_dir, **engine: Any
    ) -> ServerThread:
        args = EngineArgs(model=str(model) if model else None, **{**TINY_ENGINE, **engine})
        started.append(ServerThread(args, config).start())
        return started[-1]

    yield start
    for thread in started:
        thread.stop()


@pytest.fixture(scope="module")
def server(start_server) -> ServerThread:
    return start_server()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@dataclass
class HTTPResult:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http(base_url: str, method: str, path: str, body: Any = None, headers: dict | None = None) -> HTTPResult:
    """Plain HTTP (urllib): `body` a dict is sent as JSON, bytes as they are."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(base_url + path, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return HTTPResult(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return HTTPResult(error.code, error.read().decode())


@pytest.fixture(scope="session")
def http_request() -> Callable[..., HTTPResult]:
    """http_request(base_url, method, path, body=None, headers=None) -> HTTPResult."""
    return http
