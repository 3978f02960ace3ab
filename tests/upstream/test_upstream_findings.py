"""One test per finding of issue 12, at the connection level, against an h11 upstream.

Each drives the pool directly and lets ``tests.h11_upstream`` (h11, not our parser) say
what reached the upstream. Each failed on the pool that landed before issue 12:

- desync: a body left unfinished after an early answer, then pooled;
- paused: a connection pooled with reading paused;
- upload timeout: the read timeout counted from the start of the upload, and a timeout
  reported as 502;
- validation: method, target, headers and body length written unchecked;
- waiters: a spurious wake-up that sent a waiter to the back of the queue, and a
  wake-up lost to a waiter that left.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.upstream.client import Origin, UpstreamFailure
from proxy.upstream.pool import Http1Pool
from proxy.upstream.response import HIGH_WATER
from tests.h11_upstream import H11Upstream

pytestmark = [pytest.mark.loopback, pytest.mark.asyncio]


def make_pool(port: int, **overrides: float) -> Http1Pool:
    options = {"max_connections": 4, "keepalive_s": 30.0, "connect_timeout_s": 2.0, "read_timeout_s": 5.0}
    return Http1Pool(Origin.parse(f"http://127.0.0.1:{port}"), **(options | overrides))  # type: ignore[arg-type]


async def send(
    pool: Http1Pool, method: str, target: bytes, body: bytes | AsyncIterator[bytes] = b"",
    headers: list[tuple[bytes, bytes]] | None = None, length: int | None = None,
) -> Any:
    return await pool.send(method, target, headers or [], body, length)


async def read_all(response: Any) -> bytes:
    out = b""
    while chunk := await response.read():
        out += chunk
    return out


async def exchange(pool: Http1Pool, target: bytes, body: bytes) -> tuple[int, bytes]:
    response = await send(pool, "POST", target, body)
    try:
        return response.status, await read_all(response)
    finally:
        response.close()


class ClientLeft(Exception):
    """What the forwarder raises from the body stream when its client disconnects."""


async def upload(parts: list[bytes], *, pause_s: float = 0.0, then_leave: bool = False) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
        await asyncio.sleep(pause_s)
    if then_leave:
        raise ClientLeft


async def test_desync_an_unfinished_upload_after_an_early_answer_never_prefixes_the_next_request() -> None:
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, read_timeout_s=2.0)
        for round_ in range(3):
            # 100 of 1,000 declared bytes, the 413 arrives, then the client leaves.
            try:
                response = await send(pool, "POST", b"/early", upload([b"x" * 100], pause_s=0.1, then_leave=True),
                                      length=1000)
                response.close()
            except (ClientLeft, UpstreamFailure):
                pass
            marker = b'{"marker": "chat-%d"}' % round_
            assert await exchange(pool, b"/echo", marker) == (200, marker)
        await pool.aclose()
    assert upstream.errors == []
    assert [(r.target, r.body) for r in upstream.requests] == [
        (b"/echo", b'{"marker": "chat-%d"}' % i) for i in range(3)
    ]


async def test_paused_a_response_that_fills_the_buffer_and_ends_never_leaves_its_connection_paused() -> None:
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, read_timeout_s=2.0)
        response = await send(pool, "GET", b"/big/%d" % HIGH_WATER)
        await asyncio.sleep(0.2)  # the whole body arrives while the client reads nothing
        response.close()  # and the client leaves
        assert await asyncio.wait_for(exchange(pool, b"/echo", b"next"), 10) == (200, b"next")
        await pool.aclose()
    assert upstream.errors == []


async def test_upload_timeout_read_timeout_counts_from_the_end_of_the_upload_and_is_a_504() -> None:
    unretrieved: list[Any] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, read_timeout_s=0.3)
        # Eight parts 0.1 s apart: 0.8 s of upload, never 0.3 s without progress.
        response = await send(pool, "POST", b"/echo", upload([b"p%d" % i for i in range(8)], pause_s=0.1))
        assert (response.status, await read_all(response)) == (200, b"p0p1p2p3p4p5p6p7")
        response.close()
        # Uploaded in full, then no answer: a timeout, 504, however long the upload took.
        with pytest.raises(UpstreamFailure) as info:
            await send(pool, "POST", b"/hang", upload([b"a", b"b", b"c"], pause_s=0.1))
        assert (info.value.status, info.value.reason) == (504, "ReadTimeout")
        await pool.aclose()
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []


async def test_upload_timeout_an_upstream_that_takes_no_body_is_a_write_timeout() -> None:
    upstream = H11Upstream(no_read=True)
    async with upstream.serving() as port:
        pool = make_pool(port, read_timeout_s=30.0, write_timeout_s=0.3)
        parts = [b"w" * 65536] * 256  # 16 MiB: more than the socket buffers hold
        with pytest.raises(UpstreamFailure) as info:
            await asyncio.wait_for(send(pool, "POST", b"/echo", upload(parts)), 10)
        assert (info.value.status, info.value.reason) == (504, "WriteTimeout")
        assert pool.pool_state() == (0, 0, 0, 0)
        await pool.aclose()


BAD_REQUESTS = {
    "method with CRLF": dict(method="GET /x HTTP/1.1\r\nx-a: 1\r\n\r\nGET"),
    "method with space": dict(method="PO ST"),
    "empty method": dict(method=""),
    "target with CRLF": dict(target=b"/a\r\nx-injected: 1"),
    "target with space": dict(target=b"/a HTTP/1.1"),
    "target with NUL": dict(target=b"/a\x00b"),
    "target not origin-form": dict(target=b"http://elsewhere/"),
    "header name with colon": dict(headers=[(b"x-a: b\r\nx-c", b"1")]),
    "header name with space": dict(headers=[(b"x a", b"1")]),
    "empty header name": dict(headers=[(b"", b"1")]),
    "header value with CRLF": dict(headers=[(b"x-a", b"1\r\ncontent-length: 0")]),
    "header value with LF": dict(headers=[(b"x-a", b"1\nx-b: 2")]),
    "header value with CR": dict(headers=[(b"x-a", b"1\rx-b: 2")]),
    "header value with NUL": dict(headers=[(b"x-a", b"1\x00")]),
    "framing header of its own": dict(headers=[(b"Content-Length", b"5")]),
    "a second host": dict(headers=[(b"host", b"elsewhere")]),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
async def test_validation_nothing_invalid_is_written_upstream(bad: dict[str, Any]) -> None:
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port)
        request = {"method": "POST", "target": b"/echo", "headers": []} | bad
        with pytest.raises(UpstreamFailure) as info:
            await send(pool, request["method"], request["target"], b"ok", headers=request["headers"])
        assert info.value.status == 400
        assert await exchange(pool, b"/echo", b"after") == (200, b"after")
        await pool.aclose()
    assert upstream.errors == []
    assert [(r.target, r.body) for r in upstream.requests] == [(b"/echo", b"after")]


@pytest.mark.parametrize(
    "parts", [[b"1234", b"567"], [b"1234567"], [b"123456789", b"0"], [b"12345678", b"9"]],
    ids=["short", "short-one-part", "long", "long-by-a-later-part"],
)
async def test_validation_a_streamed_body_that_misses_its_length_aborts_its_connection(parts: list[bytes]) -> None:
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port)
        with pytest.raises(UpstreamFailure) as info:
            await send(pool, "POST", b"/echo", upload(parts), length=8)
        assert info.value.status == 400
        assert await exchange(pool, b"/echo", b"after") == (200, b"after")
        await pool.aclose()
    assert upstream.errors == []
    # The upstream never saw a complete request with a body that was not the client's.
    assert [(r.target, r.body) for r in upstream.requests] == [(b"/echo", b"after")]


async def test_waiters_a_successful_connect_wakes_no_one_and_waiters_are_served_in_order() -> None:
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, max_connections=1)
        served: list[str] = []

        async def one(name: str) -> None:
            response = await send(pool, "POST", b"/echo", name.encode())
            served.append(name)
            await asyncio.sleep(0.01)
            assert await read_all(response) == name.encode()
            response.close()

        first = asyncio.ensure_future(one("first"))
        await asyncio.sleep(0)  # it is connecting
        rest = [asyncio.ensure_future(one(f"waiter-{i}")) for i in range(4)]
        await asyncio.gather(first, *rest)
        await pool.aclose()
    assert served == ["first", "waiter-0", "waiter-1", "waiter-2", "waiter-3"]
    assert upstream.connections == 1


@pytest.mark.parametrize("leaves", ["after-the-wake-up", "before-the-wake-up"])
async def test_waiters_a_waiter_that_leaves_as_a_connection_frees_up_passes_it_on(leaves: str) -> None:
    """A waiter leaves (its client left, the server's stop, its wait timed out) in the same
    turn of the loop as a connection is freed. Woken first, it passes the connection on;
    cancelled first, the pool skips it and serves the next. Either way the one that left
    ends cancelled (not in a ValueError the error guard answers 500), the next is served and
    no 503 comes, and no waiter is left queued."""
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, max_connections=1, connect_timeout_s=1.0)
        held = await send(pool, "POST", b"/slow")
        leaving = asyncio.ensure_future(send(pool, "POST", b"/echo", b"never"))
        staying = asyncio.ensure_future(send(pool, "POST", b"/echo", b"stays"))
        await asyncio.sleep(0.05)  # both wait
        upstream.release_slow.set()
        assert await read_all(held) == b"12345678"
        if leaves == "after-the-wake-up":
            held.close()
            leaving.cancel()
        else:
            leaving.cancel()
            held.close()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        response = await staying
        assert (response.status, await read_all(response)) == (200, b"stays")
        response.close()
        assert pool.pool_state() == (1, 1, 0, 0)
        await pool.aclose()


async def test_reuse_idle_expiry_counts_from_the_end_of_the_response_and_is_checked_when_pooled() -> None:
    """The upstream's keep-alive clock starts when it finishes a response, not when our client
    gets round to closing it: a connection already past the limit is closed, not pooled."""
    upstream = H11Upstream()
    async with upstream.serving() as port:
        pool = make_pool(port, keepalive_s=0.2)
        response = await send(pool, "POST", b"/echo", b"slow reader")
        assert await read_all(response) == b"slow reader"
        await asyncio.sleep(0.3)  # the client holds the finished response past the limit
        response.close()
        assert pool.pool_state() == (0, 0, 0, 0)  # closed at once, not pooled
        assert await exchange(pool, b"/echo", b"next") == (200, b"next")
        await pool.aclose()
    assert upstream.connections == 2
