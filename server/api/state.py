"""What every handler of one server shares: the engine (once loaded), limits, drain state, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.server.pod_metrics import ServerMetrics
from pagoda.server.protocol import APIError

if TYPE_CHECKING:
    from pagoda.server.api.kv_snapshot_cache import SharedSnapshot
    from pagoda.server.engine.async_engine import AsyncLLMEngine
    from pagoda.server.engine.outputs import EngineStats


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # None = the engine's model_name
    api_key: str | None = None
    max_queue_len: int | None = None  # None = unbounded waiting queue
    max_request_body_bytes: int = 4 << 20
    drain_timeout: float = 30.0
    kv_usage_target: float = 0.7  # the autoscaler's targetKVCacheUsage, drawn on the /kv page
    vllm_compatible_metrics: bool = False  # /metrics also under vLLM's names (server/vllm_metrics.py)


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncLLMEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.model_name = config.served_model_name or ""
        self.created = int(time.time())
        self.draining = False
        self.load_error: BaseException | None = None
        self.in_flight = 0
        self.kv_snapshots: SharedSnapshot | None = None  # /kv/state, shared by every viewer
        self._idle = asyncio.Event()
        self._idle.set()

    def attach_engine(self, engine: AsyncLLMEngine) -> None:
        self.model_name = self.config.served_model_name or engine.model_name
        self.metrics = ServerMetrics(self.model_name, self.config.vllm_compatible_metrics)
        self.metrics.attach(engine.stats)
        self.engine = engine

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.alive

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine else None

    def health(self) -> tuple[bool, str]:
        """(alive, why): the model loaded (or is loading) and the engine's loop lives."""
        if self.load_error is not None:
            return False, f"model failed to load: {self.load_error}"
        if self.engine is None:
            return True, "loading"
        return self.engine.health()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @contextlib.contextmanager
    def admit(self) -> Iterator[AsyncLLMEngine]:
        """Hold one in-flight slot for a /v1 generation request, or refuse it (503 / 429)."""
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="service_unavailable", code="draining")
        if self.engine is None:
            raise APIError(503, "The model is still loading.", type="service_unavailable", code="loading")
        self._check_queue()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield self.engine
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _check_queue(self) -> None:
        limit = self.config.max_queue_len
        if limit is None:
            return
        stats = self.stats()
        assert stats is not None
        # The engine's count can trail requests handed over in the same instant; the server's own
        # count of requests beyond the running batch cannot.
        max_running = self.engine.engine_args.max_num_seqs
        waiting = max(stats.num_waiting, self.in_flight - max_running)
        would_wait = stats.num_waiting > 0 or self.in_flight >= max_running
        if would_wait and waiting >= limit:
            raise APIError(
                429,
                f"The server is overloaded: {waiting} requests are waiting (limit {limit}). Retry later.",
                type="rate_limit_exceeded",
                code="queue_full",
            )

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False if `timeout` passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
