"""A round-robin HTTP front over the ready serving processes: the stand-in for a Service + kube-proxy.

Streams responses through chunk by chunk (SSE tokens arrive as the server writes them), counts
requests per backend (to show that new replicas get traffic), and retries a request on another
backend only when the connection could not be opened at all (nothing was sent yet, so it is safe).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
import aiohttp.web

BACKEND_HEADER = "x-pagoda-backend"  # which serving process answered (the fault scenarios attribute failures)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


class RoundRobinFront:
    def __init__(self, backends: Callable[[], list[str]]) -> None:
        """`backends()` returns the base URLs (http://127.0.0.1:PORT) that may receive new requests."""
        self._backends = backends
        self._turn = itertools.count()
        self.requests_per_backend: Counter[str] = Counter()
        self.failures = 0
        self.first_post_at: float | None = None  # time.monotonic() of the first POST (aligns bench times)
        self._session: aiohttp.ClientSession | None = None
        self._runner: aiohttp.web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        app = aiohttp.web.Application(client_max_size=16 << 20)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    def _pick(self, tried: set[str]) -> str | None:
        candidates = [b for b in self._backends() if b not in tried]
        return candidates[next(self._turn) % len(candidates)] if candidates else None

    async def _proxy(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        assert self._session is not None
        if request.method == "POST" and self.first_post_at is None:
            self.first_post_at = time.monotonic()
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        tried: set[str] = set()
        while (backend := self._pick(tried)) is not None:
            tried.add(backend)
            try:
                upstream = await self._session.request(request.method, backend + request.path_qs,
                                                       data=body, headers=headers)
            except aiohttp.ClientConnectorError:
                continue  # never reached the server: safe to try the next one
            except aiohttp.ClientError as exc:  # reached it, and it died before answering: not retried
                self.failures += 1
                return aiohttp.web.json_response({"error": {"message": f"the backend failed: {exc}"}}, status=502,
                                                 headers={BACKEND_HEADER: backend})
            self.requests_per_backend[backend] += 1
            async with upstream:
                response = aiohttp.web.StreamResponse(status=upstream.status, headers={
                    **{k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
                    BACKEND_HEADER: backend})
                if upstream.status >= 500:
                    self.failures += 1
                await response.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                except ConnectionResetError:
                    pass  # the client hung up once it had what it wanted (e.g. after `data: [DONE]`)
                except aiohttp.ClientPayloadError:
                    # The backend died mid-stream: break the client's stream too (as a Service's
                    # connection would), never end it as if it were complete.
                    self.failures += 1
                    if request.transport is not None:
                        request.transport.close()
                return response
        self.failures += 1
        return aiohttp.web.json_response({"error": {"message": "no ready backend"}}, status=503)
