"""SSE on the wire: what one engine step sends travels in one write per stream, HTTP/1.0 clients get
plain frames, and a client that stops reading holds up no other stream."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from aiohttp import web
from pagoda.server.api import sse


def raw_post(url: str, path: str, body: dict, version: str = "1.1") -> tuple[bytes, bytes]:
    """(head, body) of a POST sent over a plain socket, read until the server closes or ends the body."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST {path} HTTP/{version}\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
        )
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    return head, rest


def http_chunks(body: bytes) -> list[bytes]:
    """The chunks of a chunked transfer-encoded body, the closing empty one left out."""
    chunks = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def events(data: bytes) -> list[bytes]:
    assert data.endswith(b"\n\n"), "a write ends on an event's end"
    return [event for event in data.split(b"\n\n") if event]


def payload(event: bytes) -> dict:
    return json.loads(event.removeprefix(b"data: "))


def test_a_steps_frames_travel_in_one_chunk(server):
    """n=2: every step has a token for each choice, two events; they go out as one HTTP chunk."""
    body = {"model": server.state.model_name, "prompt": "one two three", "max_tokens": 6, "n": 2,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    head, raw = raw_post(server.url, "/v1/completions", body)
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding: chunked" in head.lower()
    chunks = http_chunks(raw)
    frames = [event for chunk in chunks for event in events(chunk)]
    assert frames[-1] == b"data: [DONE]" and payload(frames[-2])["usage"]["completion_tokens"] == 12
    # Six steps: one chunk each, the usage and [DONE] riding with the last (one a chunk: 14 chunks).
    assert len(chunks) <= 6 < len(frames)
    for chunk in chunks[:-1]:
        indexes = [choice["index"] for event in events(chunk) for choice in payload(event)["choices"]]
        assert indexes.count(0) == indexes.count(1) >= 1, indexes


def test_http10_client_gets_plain_frames_and_a_closed_connection(server):
    body = {"model": server.state.model_name, "prompt": "one two", "max_tokens": 4, "ignore_eos": True,
            "stream": True}  # fmt: skip
    head, raw = raw_post(server.url, "/v1/completions", body, version="1.0")
    assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower()
    frames = events(raw)
    assert frames[-1] == b"data: [DONE]"
    text = "".join(payload(frame)["choices"][0]["text"] for frame in frames[:-1])
    assert len(frames) >= 5 and text


async def _stalled_client_case() -> tuple[int, int, bool, float]:
    """A stream whose client never reads, beside one that reads: (events the reader got, the stalled
    stream's largest write buffer, whether its handler saw the client leave, the reader's seconds)."""
    event = {"text": "x" * 4000}
    count = 400  # 1.6 MB: more than the stalled client's socket buffers take
    seen: dict[str, object] = {"peak": 0, "reset": False}

    async def stream_handler(request: web.Request) -> web.StreamResponse:
        stream = await sse.open_stream(request)
        transport = request.transport
        assert transport is not None
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        try:
            for _ in range(count):
                await stream.send(event)
                await asyncio.sleep(0)  # the outbox writes between events, as between engine steps
                seen["peak"] = max(int(seen["peak"]), transport.get_write_buffer_size())
            await stream.close()
        except ConnectionResetError:
            seen["reset"] = True
        return stream.response

    app = web.Application()
    app.router.add_get("/stream", stream_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)  # its handler fills what the sockets take, then waits
        start = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = await asyncio.wait_for(reader.read(-1), 30)
        took = time.monotonic() - start
        writer.close()
        got = received.count(b"data: {")
        stalled.close()
        for _ in range(100):  # the stalled handler notices within a few polls
            if seen["reset"]:
                break
            await asyncio.sleep(0.02)
        return got, int(seen["peak"]), bool(seen["reset"]), took
    finally:
        await runner.cleanup()


def test_a_client_that_stops_reading_holds_up_no_other_stream():
    got, peak, reset, took = asyncio.run(_stalled_client_case())
    assert got == 400 and took < 10
    # What waits for the stalled client stays bounded: the limit and one write over it.
    assert 0 < peak <= sse.CONGESTED_BYTES + 4200
    assert reset, "the stalled stream's handler learns that its client left"
