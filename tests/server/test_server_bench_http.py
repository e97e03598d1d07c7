"""The benchmark's HTTP/1.1 client (`pagoda.server.bench.http`): responses split at every byte, and
real sockets to a server that answers with crafted bytes (keep-alive, errors, a broken stream)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pagoda.server.bench.client import Target, send_request
from pagoda.server.bench.dataset import BenchRequest
from pagoda.server.bench.http import Pool, ProtocolError, ResponseParser


def sse_response(events: list[dict], done: bool = True) -> bytes:
    """A chunked event stream, each event a chunk (with a chunk extension), a trailer at the end."""
    frames = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + (
        [b"data: [DONE]\n\n"] if done else []
    )
    chunks = b"".join(b"%x;ext=1\r\n%b\r\n" % (len(f), f) for f in frames)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\nX-Trailer: 1\r\n\r\n"


def completion(texts: list[str], usage: int | None = None) -> bytes:
    events = [{"choices": [{"index": 0, "text": t}]} for t in texts]
    return sse_response(events + ([{"choices": [], "usage": {"completion_tokens": usage}}] if usage else []))


def parse_in_pieces(raw: bytes, size: int) -> tuple[ResponseParser, bytes]:
    body = []
    parser = ResponseParser(lambda status, piece: body.append(piece))
    for at in range(0, len(raw), size):
        assert not parser.done
        parser.feed(raw[at : at + size])
    return parser, b"".join(body)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_a_chunked_body_comes_out_whole_however_the_reads_split_it(size):
    raw = completion(["Hello", ",", " world"], usage=3)
    parser, body = parse_in_pieces(raw, size)
    assert parser.done and parser.status == 200 and parser.keep_alive
    assert body.count(b"data: ") == 5 and body.endswith(b"data: [DONE]\n\n") and b"\r\n" not in body


def test_sized_empty_and_until_close_bodies_interim_responses_and_connection_close():
    parser, body = parse_in_pieces(
        b"HTTP/1.1 429 Too Many\r\nContent-Length: 5\r\nConnection: close\r\n\r\nbusy!", 2
    )
    assert parser.done and parser.status == 429 and not parser.keep_alive and body == b"busy!"
    parser, body = parse_in_pieces(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", 5
    )
    assert parser.done and parser.status == 204 and body == b""
    parser, body = parse_in_pieces(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", 4)
    assert not parser.done
    parser.close()
    assert parser.done and not parser.keep_alive and body == b"until the end"


@pytest.mark.parametrize(
    "raw",
    [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"HTTP/1.1 200 OK\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\nabXY"],
)  # fmt: skip
def test_what_is_not_a_response_is_refused(raw):
    with pytest.raises(ProtocolError):
        parse_in_pieces(raw, 3)


def test_a_response_cut_short_is_an_error_not_an_end():
    parser, _ = parse_in_pieces(completion(["a", "b"])[:-20], 5)
    with pytest.raises(ProtocolError):
        parser.close()


class CraftedServer:
    """Answers the n-th request on any connection with `answers[n]`, then closes if told to."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers, self.requests, self.connections = answers, 0, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed the connection
                break
            sized = (line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            length = int(next(sized).split(b":")[1])
            json.loads(await reader.readexactly(length))
            answer, close = self.answers[self.requests]
            self.requests += 1
            for at in range(0, len(answer), 40):  # in pieces, as a server streams
                writer.write(answer[at : at + 40])
                await writer.drain()
            if close:
                break
        writer.close()


async def run_against(answers: list[tuple[bytes, bool]], count: int):
    crafted = CraftedServer(answers)
    server = await asyncio.start_server(crafted.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = Target(f"http://127.0.0.1:{port}", "m")
    pool = Pool(target.url)
    try:
        results = [
            await send_request(pool, target, BenchRequest("hi", "hi", 1, 3), 0.0, 5.0) for _ in range(count)
        ]
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
    return results, crafted


def test_requests_reuse_a_kept_alive_connection_and_are_timed():
    results, crafted = asyncio.run(run_against([(completion(["a", "b", "c"], usage=3), False)] * 3, 3))
    assert crafted.connections == 1 and crafted.requests == 3
    for result in results:
        assert result.success and result.output_tokens == 3 and len(result.itl) == 2
        assert 0 < result.ttft <= result.latency


def test_errors_are_reported_and_the_next_request_gets_a_fresh_connection():
    body = b'{"error": {"message": "bad input"}}'
    refused = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    in_stream = sse_response(
        [{"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}], done=False
    )
    broken = completion(["a", "b", "c"])[:-40]  # the server goes away mid-stream
    not_json = completion(["a"]).replace(b"data: [DONE]", b"data: {oops!")  # as long: the chunk sizes hold
    bad_length = b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n"
    answers = [(refused, False), (broken, True), (completion(["x"], usage=1), False), (in_stream, True),
               (not_json, False), (bad_length, True)]  # fmt: skip
    results, crafted = asyncio.run(run_against(answers, 6))
    assert (
        not results[0].success and results[0].error.startswith("HTTP 400") and "bad input" in results[0].error
    )
    assert not results[1].success and "closed before the response ended" in results[1].error
    assert results[2].success and results[2].output_tokens == 1
    assert not results[3].success and results[3].error == "engine died" and results[3].ttft > 0
    assert not results[4].success and results[4].error.startswith("JSONDecodeError")
    assert not results[5].success and results[5].error.startswith("ValueError")
    # the connections of the broken stream, the bad event and the bad length were not reused
    assert crafted.connections == 4


def test_a_server_that_never_answers_times_out_and_its_connection_is_closed():
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes its side
        closed.set()
        writer.close()

    async def scenario():
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        target = Target(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "m")
        pool = Pool(target.url)
        result = await send_request(pool, target, BenchRequest("hi", "hi", 1, 3), 0.0, 0.3)
        await asyncio.wait_for(closed.wait(), 5)
        server.close()
        await server.wait_closed()
        return result

    result = asyncio.run(scenario())
    assert not result.success and result.error.startswith("TimeoutError")
