"""Keep-alive against hostile upstreams: their announced timeout, and the idle-close race.

Each upstream is a small server on 127.0.0.1 that reads requests with h11 (not our
parser) and misbehaves on cue: it announces ``Keep-Alive: timeout=1``, or it ends a
connection that the pool is about to reuse, by a reset (``SO_LINGER`` 0: the request
bytes were never read) or by a clean close after reading the whole request. What each
must give: a request that cannot have been acted on is sent once more and answered; a
POST the upstream may have acted on is not sent twice (RFC 9112 §9.3.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest

from proxy.upstream.client import Origin, UpstreamFailure
from proxy.upstream.pool import Http1Pool

pytestmark = [pytest.mark.loopback, pytest.mark.asyncio]


@dataclass
class Upstream:
    """Answers ``/echo`` with its body; on its first connection, the second request meets ``ending``."""

    ending: str | None = None  # None, "reset" (unread), "close-after-read"
    keep_alive: bytes | None = None
    connections: int = 0
    served: list[bytes] = field(default_factory=list)  # bodies of requests it read to their end

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first_connection = self.connections == 1
        conn = h11.Connection(h11.SERVER)
        answered = 0
        body = b""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    if first_connection and answered == 1 and self.ending == "reset":
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()  # unread bytes: the kernel answers with a reset
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self.served.append(body)
                    if first_connection and answered == 1 and self.ending == "close-after-read":
                        return  # read it all, answers nothing: as if it died working on it
                    headers = [(b"content-length", b"%d" % len(body))]
                    if self.keep_alive is not None:
                        headers.append((b"keep-alive", self.keep_alive))
                    writer.write(conn.send(h11.Response(status_code=200, headers=headers))
                                 + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    answered += 1
                    body = b""
                    conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def pool_for(upstream: Upstream, **overrides: float) -> AsyncIterator[Http1Pool]:
    listener = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    options = {"max_connections": 4, "keepalive_s": 30.0, "connect_timeout_s": 2.0, "read_timeout_s": 5.0}
    pool = Http1Pool(Origin.parse(f"http://127.0.0.1:{port}"), **(options | overrides))  # type: ignore[arg-type]
    try:
        yield pool
    finally:
        await pool.aclose()
        listener.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listener.wait_closed(), 5)


async def exchange(pool: Http1Pool, method: str, body: bytes) -> tuple[int, bytes]:
    response = await pool.send(method, b"/echo", [], body)
    try:
        out = b""
        while chunk := await response.read():
            out += chunk
        return response.status, out
    finally:
        response.close()


async def test_an_announced_keep_alive_timeout_is_honoured() -> None:
    """``Keep-Alive: timeout=1``: a connection idle for 0.85 s is not reused (ours: 80% of it)."""
    upstream = Upstream(keep_alive=b"timeout=1, max=100")
    async with pool_for(upstream) as pool:
        assert await exchange(pool, "POST", b"one") == (200, b"one")
        await asyncio.sleep(0.85)
        assert await exchange(pool, "POST", b"two") == (200, b"two")
        assert upstream.connections == 2
        assert await exchange(pool, "POST", b"three") == (200, b"three")  # soon after: reused
        assert upstream.connections == 2


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_a_request_reset_unread_on_a_reused_connection_is_sent_once_more(method: str) -> None:
    upstream = Upstream(ending="reset")
    async with pool_for(upstream) as pool:
        assert await exchange(pool, method, b"first") == (200, b"first")
        assert await exchange(pool, method, b"second") == (200, b"second")
    assert upstream.connections == 2
    assert upstream.served == [b"first", b"second"]  # the second request, once


async def test_a_post_the_upstream_read_is_never_sent_twice() -> None:
    upstream = Upstream(ending="close-after-read")
    async with pool_for(upstream) as pool:
        assert await exchange(pool, "POST", b"first") == (200, b"first")
        with pytest.raises(UpstreamFailure) as info:
            await exchange(pool, "POST", b"charged once")
    assert info.value.status == 502
    assert upstream.served == [b"first", b"charged once"]


async def test_an_idempotent_request_the_upstream_dropped_is_sent_once_more() -> None:
    upstream = Upstream(ending="close-after-read")
    async with pool_for(upstream) as pool:
        assert await exchange(pool, "GET", b"first") == (200, b"first")
        assert await exchange(pool, "GET", b"again") == (200, b"again")
    assert upstream.served == [b"first", b"again", b"again"]
