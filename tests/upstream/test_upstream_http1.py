"""The HTTP/1.1 upstream pool against a scripted server on 127.0.0.1, byte for byte.

Hypothesis picks the body, its framing (Content-Length, chunked with any chunk sizes,
or ended by closing the connection), an interim 1xx response before it, and the points
where the server's writes are cut; the client must hand back exactly the body, the
status and the headers, and keep or drop the connection as the framing allows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.upstream.client import Origin, UpstreamFailure
from proxy.upstream.response import Http1Response
from proxy.upstream.pool import Http1Pool

pytestmark = pytest.mark.loopback


@dataclass
class Script:
    status: int
    body: bytes
    framing: str  # length | chunked | close
    chunks: list[int]
    interim: bool
    cuts: list[int]

    def wire(self) -> bytes:
        head = [b"HTTP/1.1 %d Whatever" % self.status, b"x-kept: 1", b"X-Kept: 2"]
        if self.framing == "length":
            head.append(b"content-length: %d" % len(self.body))
            payload = self.body
        elif self.framing == "chunked":
            head.append(b"transfer-encoding: chunked")
            parts, at = [], 0
            for size in [*self.chunks, len(self.body)]:
                piece = self.body[at : at + size]
                at += len(piece)
                if piece:
                    parts.append(b"%x\r\n%s\r\n" % (len(piece), piece))
            payload = b"".join(parts) + b"0\r\n\r\n"
        else:
            head.append(b"connection: close")
            payload = self.body
        interim = b"HTTP/1.1 100 Continue\r\n\r\n" if self.interim else b""
        return interim + b"\r\n".join(head) + b"\r\n\r\n" + payload


scripts = st.builds(
    Script,
    status=st.sampled_from([200, 201, 400, 404, 500, 503]),
    body=st.binary(max_size=3000),
    framing=st.sampled_from(["length", "chunked", "close"]),
    chunks=st.lists(st.integers(1, 700), max_size=8),
    interim=st.booleans(),
    cuts=st.lists(st.integers(1, 4000), max_size=6),
)


class Server:
    """Answers each request on a connection with the next script's bytes, cut at ``cuts``."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts, self.connections, self.heads = list(scripts), 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.scripts:
                self.heads.append(await reader.readuntil(b"\r\n\r\n"))
                script = self.scripts.pop(0)
                wire, at = script.wire(), 0
                for cut in sorted(set(script.cuts)):
                    writer.write(wire[at:cut])
                    await writer.drain()
                    await asyncio.sleep(0)
                    at = max(at, cut)
                writer.write(wire[at:])
                await writer.drain()
                if script.framing == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handle: Handler) -> AsyncIterator[str]:
    """A server on 127.0.0.1 running ``handle``; every connection is closed on exit."""
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    listener = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await listener.wait_closed()


def client(url: str, **overrides: float) -> Http1Pool:
    options = {"max_connections": 4, "keepalive_s": 30.0, "connect_timeout_s": 2.0, "read_timeout_s": 5.0}
    return Http1Pool(Origin.parse(url), **(options | overrides))  # type: ignore[arg-type]


async def read_all(response: Http1Response) -> bytes:
    out = bytearray()
    while chunk := await response.read():
        out += chunk
    return bytes(out)


async def exchange(pool: Http1Pool) -> tuple[Http1Response, bytes]:
    response = await pool.send("GET", b"/v1/models?x=1", [(b"x-client", b"c")], b"")
    body = await read_all(response)
    response.close()
    return response, body


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=scripts, second=scripts)
def test_any_framing_and_any_cut_gives_back_the_exact_body(first: Script, second: Script) -> None:
    async def scenario() -> None:
        server = Server([first, second])
        async with serving(server.handle) as url:
            pool = client(url)
            for script in (first, second):
                response, body = await asyncio.wait_for(exchange(pool), 10)
                assert (response.status, body) == (script.status, script.body)
                assert [v for k, v in response.headers if k.lower() == b"x-kept"] == [b"1", b"2"]
                assert pool.pool_state()[2] == 0  # nothing checked out after close()
            # Kept alive unless the first response was delimited by closing its connection.
            assert server.connections == (2 if first.framing == "close" else 1)
            request = server.heads[0].decode("latin-1").split("\r\n")
            assert request[0] == "GET /v1/models?x=1 HTTP/1.1"
            assert sorted(line.split(":")[0] for line in request[1:] if line) == ["host", "x-client"]
            await pool.aclose()

    asyncio.run(scenario())


@pytest.mark.asyncio
async def test_a_body_cut_short_is_a_502_not_a_shorter_body() -> None:
    script = Script(200, b"x" * 100, "length", [], False, [])
    wire = script.wire()[:-10]  # ten bytes never come, then the connection closes

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(wire)
        await writer.drain()
        writer.close()

    async with serving(handle) as url:
        pool = client(url)
        response = await pool.send("GET", b"/", [], b"")
        with pytest.raises(UpstreamFailure) as info:
            await read_all(response)
        response.close()
        await pool.aclose()
    assert info.value.status == 502
    assert pool.pool_state() == (0, 0, 0, 0)


@pytest.mark.asyncio
async def test_streamed_body_is_chunked_or_sent_with_the_clients_length() -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if b"chunked" in head:
                body = await reader.readuntil(b"0\r\n\r\n")
            else:
                body = await reader.readexactly(9)
            seen.append(head + body)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def parts() -> object:
        for part in (b"abc", b"def", b"ghi"):
            yield part

    async with serving(handle) as url:
        pool = client(url)
        for length in (None, 9):
            response = await pool.send("POST", b"/v1/x", [], parts(), length)  # type: ignore[arg-type]
            assert await read_all(response) == b"ok"
            response.close()
        await pool.aclose()
    chunked, sized = seen
    assert chunked.endswith(b"transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n3\r\nghi\r\n0\r\n\r\n")
    assert sized.endswith(b"content-length: 9\r\n\r\nabcdefghi") and b"chunked" not in sized


@pytest.mark.asyncio
async def test_head_responses_end_at_their_headers() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")  # no body follows a HEAD
        await writer.drain()
        await asyncio.sleep(5)

    async with serving(handle) as url:
        pool = client(url)
        response = await pool.send("HEAD", b"/", [], b"")
        assert (response.status, await asyncio.wait_for(read_all(response), 2)) == (200, b"")
        response.close()
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_slow_client_pauses_the_upstream_and_is_not_taken_for_a_silent_one() -> None:
    total = 8 << 20

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"z" * 65536)
            await writer.drain()

    async with serving(handle) as url:
        pool = client(url, read_timeout_s=0.2)
        response = await pool.send("GET", b"/", [], b"")
        await asyncio.sleep(0.6)  # the client reads nothing for three read timeouts
        first = await response.read()
        assert len(first) < 2 << 20  # what waited for us is bounded, not the whole 8 MiB
        assert len(first) + len(await read_all(response)) == total
        response.close()
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_request_cancelled_at_any_point_leaves_no_connection_behind() -> None:
    """The client leaves (its task is cancelled) after 0, 1, 2 ... loop turns: while the
    connection is being made, while the request is written, while the head is awaited."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(0.001)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with serving(handle) as url:
        pool = client(url)
        target = b"/"
        for turns in range(40):
            task = asyncio.ensure_future(pool.send("POST", target, [], b"{}"))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                response = await task
            except asyncio.CancelledError:
                pass
            else:  # it finished first: read it, close it
                assert await read_all(response) == b"ok"
                response.close()
            await asyncio.sleep(0)
            assert pool.pool_state()[2] == 0, (turns, pool.pool_state())  # nothing checked out
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_body_ended_by_close_is_complete_only_when_the_upstream_closes() -> None:
    """A response without a length ends with its connection, but only with the upstream's
    close: when the pool drops the connection itself (the client left mid-upload), what was
    read is not passed off as the whole body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart")  # no length, still open
        await writer.drain()
        await asyncio.sleep(5)

    async def leaves() -> AsyncIterator[bytes]:
        yield b"x"
        await asyncio.sleep(0.1)  # the early answer arrives meanwhile
        raise ConnectionAbortedError("the client left")

    async with serving(handle) as url:
        pool = client(url)
        response = await pool.send("POST", b"/", [], leaves(), 100)
        assert await response.read() == b"part"
        with pytest.raises(UpstreamFailure) as info:
            await response.read()
        response.close()
        await pool.aclose()
    assert info.value.status == 502


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x05hello",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["upgrade", "101-then-200"],
)
async def test_a_101_from_the_upstream_is_a_502_and_nothing_escapes_to_the_loop(answer: bytes) -> None:
    """No request asks for an upgrade; a 101 is a protocol error, never a traceback."""
    loop = asyncio.get_running_loop()
    escaped: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: escaped.append(context))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the pool drops the connection

    try:
        async with serving(handle) as url:
            pool = client(url)
            with pytest.raises(UpstreamFailure) as info:
                await pool.send("POST", b"/v1/completions", [], b"{}")
            assert pool.pool_state() == (0, 0, 0, 0)  # the connection is gone, not pooled
            await pool.aclose()
    finally:
        loop.set_exception_handler(None)
    assert info.value.status == 502
    assert escaped == []


@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["holds the socket", "closes"])
async def test_an_early_answer_to_a_large_body_in_hand_is_the_clients(then: str) -> None:
    """A body the middleware replays whole is written at once; an upstream that answers 413
    before it reads that body must get its 413 to the client, not a 504 after the write
    timeout or a 502 when it closes. The connection is not reused: its request is unsent."""
    answer = b'HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n{"error":"big!!"}'
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        if len(heads) > 1:  # the next request, on a new connection
            await reader.readexactly(4)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return
        writer.write(answer)  # the body is never read
        await writer.drain()
        if then == "holds the socket":
            await asyncio.sleep(5)

    async with serving(handle) as url:
        pool = Http1Pool(Origin.parse(url), max_connections=4, keepalive_s=30.0, connect_timeout_s=2.0,
                         read_timeout_s=5.0, write_timeout_s=1.0)
        try:
            response = await asyncio.wait_for(pool.send("POST", b"/v1/chat/completions", [], b"x" * (16 << 20)), 4)
            assert (response.status, await read_all(response)) == (413, b'{"error":"big!!"}')
            response.close()
            response = await asyncio.wait_for(pool.send("POST", b"/next", [], b"next"), 4)
            assert (response.status, await read_all(response)) == (200, b"ok")
            response.close()
        finally:
            await pool.aclose()
    assert len(heads) == 2  # a new connection for the second request
