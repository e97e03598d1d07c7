"""A lean HTTP/1.1 client for the benchmark: keep-alive connections, each read handled where it arrives.

On a small host the benchmark's client shares the cores with the server it measures, so the client's
CPU per streamed token comes out of the server's throughput. A general client hands each body line to
a coroutine through a stream (aiohttp: 26 µs of CPU a token); here a protocol parses the response as
its bytes arrive and hands each piece of the body to a callback (benchmarks/stream_cost.py has the
figures).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response this client reads."""


class ResponseParser:
    """One response's status line, headers and body (chunked, sized, or up to the connection's close),
    fed bytes as they come. The body goes to `on_body(status, piece)` piece by piece."""

    def __init__(self, on_body: Callable[[int, bytes], None]) -> None:
        self.on_body = on_body
        self.status: int | None = None
        self.keep_alive = True
        self.done = False
        self._buffer = b""
        self._left: int | None = None  # bytes of the sized body, or of the current chunk, still to come
        self._state = "head"  # head -> (size -> data -> crlf)* -> trailer | sized | until_close

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while self._buffer and not self.done:
            if not getattr(self, "_" + self._state)():
                return

    def close(self) -> None:
        """The connection closed: the end of a body that runs up to it, else a truncated response."""
        if self._state == "until_close":
            self.done, self.keep_alive = True, False
        elif not self.done:
            raise ProtocolError("the connection closed before the response ended")

    def _head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD:
                raise ProtocolError("response head too long")
            return False
        lines = self._buffer[:end].decode("latin-1").split("\r\n")
        self._buffer = self._buffer[end + 4 :]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(rest[:3])
        if 100 <= self.status < 200:  # an interim response (103 Early Hints): the real one follows
            return True
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        self.keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "size"
        elif "content-length" in headers:
            self._left, self._state = int(headers["content-length"]), "sized"
            if self._left == 0:
                self.done = True
        elif self.status in (204, 304):
            self.done = True
        else:
            self._state = "until_close"
        return True

    def _size(self) -> bool:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        try:
            self._left = int(self._buffer[:end].split(b";", 1)[0], 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {self._buffer[:end][:40]!r}") from None
        self._buffer = self._buffer[end + 2 :]
        self._state = "data" if self._left else "trailer"
        return True

    def _take(self) -> int:
        """Hands on what the buffer holds of the `_left` bytes to come; how many are still to come."""
        piece = self._buffer[: self._left]
        self._buffer = self._buffer[len(piece) :]
        self._left -= len(piece)
        self.on_body(self.status, piece)
        return self._left

    def _data(self) -> bool:
        if self._take():
            return False
        self._state = "crlf"
        return True

    def _crlf(self) -> bool:
        if len(self._buffer) < 2:
            return False
        if self._buffer[:2] != b"\r\n":
            raise ProtocolError("a chunk does not end with CRLF")
        self._buffer, self._state = self._buffer[2:], "size"
        return True

    def _trailer(self) -> bool:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        self._buffer = self._buffer[end + 2 :]
        self.done = end == 0  # an empty line ends the trailer
        return True

    def _sized(self) -> bool:
        self.done = self._take() == 0
        return False

    def _until_close(self) -> bool:
        self.on_body(self.status, self._buffer)
        self._buffer = b""
        return False


class Connection(asyncio.Protocol):
    """One keep-alive connection: `exchange` sends a request and resolves when its response ends."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser: ResponseParser | None = None
        self._ended: asyncio.Future[ResponseParser] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def exchange(
        self, request: bytes, on_body: Callable[[int, bytes], None]
    ) -> asyncio.Future[ResponseParser]:
        self._parser = ResponseParser(on_body)
        self._ended = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._ended

    def data_received(self, data: bytes) -> None:
        if self._ended is None or self._ended.done():
            return
        try:
            self._parser.feed(data)
        except Exception as exc:  # a parse error, or on_body's: the response is lost, and the connection
            self._fail(exc)
            self.transport.close()
            return
        if self._parser.done:
            self._ended.set_result(self._parser)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ended is None or self._ended.done():
            return
        try:
            self._parser.close()
            self._ended.set_result(self._parser)
        except Exception as error:
            self._fail(ConnectionError(str(exc or error)))

    def _fail(self, exc: Exception) -> None:
        if not self._ended.done():
            self._ended.set_exception(exc)


class Pool:
    """Keep-alive connections to the server of one URL, as many as requests in flight at once; `post`
    makes the bytes of a request to that URL."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.rpartition("@")[2]
        self._idle: list[Connection] = []

    async def acquire(self) -> Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.transport.is_closing():
                return connection
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(Connection, self.host, self.port, ssl=self.ssl)
        return connection

    def release(self, connection: Connection, reusable: bool) -> None:
        if reusable and not connection.transport.is_closing():
            self._idle.append(connection)
        else:
            connection.transport.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.transport.close()
        self._idle.clear()

    def post(self, body: bytes, headers: dict[str, str]) -> bytes:
        """The bytes of a POST of a JSON body to the pool's URL."""
        head = [f"POST {self.path} HTTP/1.1", f"Host: {self.host_header}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
