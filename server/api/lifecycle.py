"""One serving process: listen at once, load the model in the background, drain on shutdown.

The port opens before the model loads so liveness probes pass while a large model loads (/ready says
503 until it is in); shutdown flips /ready to 503, refuses new generation requests, waits for in-flight
ones up to the drain timeout, then stops the engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web
from pagoda.server.api.app import build_app
from pagoda.server.api.state import ServerConfig, ServerState

if TYPE_CHECKING:
    from pagoda.server.engine.async_engine import AsyncLLMEngine
    from pagoda.server.engine.config import EngineArgs

log = logging.getLogger(__name__)


class PagodaServer:
    def __init__(self, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.state = ServerState(config)
        self.host = host
        self.port = port
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its
        # engine requests (aiohttp >= 3.9 leaves handlers running by default).
        self._runner = web.AppRunner(
            build_app(self.state), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )

    async def start(self) -> None:
        """Open the port (port 0 picks a free one; `self.port` then holds it)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("listening on http://%s:%d", self.host, self.port)

    async def load(self, engine_args: EngineArgs) -> None:
        """Build the engine on its own thread (probes keep answering) and start its step loop."""
        from pagoda.server.engine.async_engine import AsyncLLMEngine

        try:
            await self.attach(AsyncLLMEngine(engine_args))
        except Exception as exc:
            self.state.load_error = exc
            raise

    async def attach(self, engine: AsyncLLMEngine) -> None:
        await engine.start()
        self.state.attach_engine(engine)
        log.info("serving model %s", self.state.model_name)

    async def drain_and_stop(self, timeout: float | None = None) -> bool:
        """Stop taking requests, let in-flight ones finish (True if all did in time), shut down."""
        state = self.state
        state.draining = True
        timeout = state.config.drain_timeout if timeout is None else timeout
        log.info("draining %d in-flight requests (up to %.0f s)", state.in_flight, timeout)
        drained = await state.wait_idle(timeout)
        if not drained:
            log.warning("drain timeout: aborting %d requests still in flight", state.in_flight)
        await self._runner.cleanup()  # cancels what is left, which aborts it in the engine
        if state.engine is not None:
            await state.engine.shutdown()
        return drained
