"""The pool as a Hypothesis state machine over interleavings, against an h11 upstream.

Rules run one operation, or two at once on the same pool: a complete request (body in
hand, streamed with its length, or chunked), an early answer to a partial upload whose
client then leaves, a partial upload abandoned with no answer, a response big enough to
pause reading that the client leaves unread or half read, a slow upload; and, between
them, keep-alive expiry, the upstream closing its idle connections, and the upstream
resetting its idle connections as their next request arrives (the idle-close race: a
request written in full, in hand, is sent once more on a new connection; a streamed one
cannot be and is a 502).

The invariant, after every step: h11 parsed exactly the requests that were sent
completely (each with its own body: no byte of one inside another, none twice), each
client of a complete request got its own body back, and h11 never failed to parse a byte.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import pytest

from proxy.upstream.client import Origin, UpstreamFailure
from proxy.upstream.response import HIGH_WATER
from proxy.upstream.pool import Http1Pool
from tests.h11_upstream import H11Upstream

pytestmark = pytest.mark.loopback

KEEPALIVE_S = 0.1
READ_TIMEOUT_S = 0.15


class ClientLeft(Exception):
    pass


async def parts_then(parts: list[bytes], pause_s: float, leave: bool) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
        await asyncio.sleep(pause_s)
    if leave:
        raise ClientLeft


async def read_all(response: Any) -> bytes:
    out = b""
    while chunk := await response.read():
        out += chunk
    return out


operations = st.one_of(
    st.tuples(st.just("complete"), st.integers(0, 3000), st.sampled_from(["in hand", "length", "chunked"])),
    st.tuples(st.just("early answer, client leaves"), st.integers(1, 900)),
    st.tuples(st.just("partial upload, client leaves"), st.integers(1, 900)),
    st.tuples(st.just("paused read, client leaves"), st.sampled_from([HIGH_WATER, 2 * HIGH_WATER]), st.booleans()),
    st.tuples(st.just("slow upload"), st.integers(2, 3)),
)


class PoolInterleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.upstream = H11Upstream()
        self.serving = self.upstream.serving()
        port = self.loop.run_until_complete(self.serving.__aenter__())
        self.pool = self.run(self._pool(port))
        self.complete: list[tuple[bytes, bytes]] = []  # (target, body) of each request sent completely
        self.count = 0

    async def _pool(self, port: int) -> Http1Pool:
        return Http1Pool(
            Origin.parse(f"http://127.0.0.1:{port}"), max_connections=3, keepalive_s=KEEPALIVE_S,
            connect_timeout_s=5.0, read_timeout_s=READ_TIMEOUT_S,
        )

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 20))

    def marker(self, size: int) -> bytes:
        self.count += 1
        head = b"{marker-%d}" % self.count
        return head + b"m" * max(0, size - len(head))

    async def operate(self, op: tuple[Any, ...]) -> None:
        try:
            await self._operate(op)
        except UpstreamFailure as failure:
            # Only a streamed body, on a connection reset under it, cannot be sent again.
            in_hand = op[0] == "paused read, client leaves" or op[0] == "complete" and op[2] == "in hand"
            assert self.upstream.resets and not in_hand and failure.status == 502, failure

    async def _operate(self, op: tuple[Any, ...]) -> None:
        kind, *args = op
        pool = self.pool
        if kind == "complete":
            size, mode = args
            body = self.marker(size)
            if mode == "in hand":
                response = await pool.send("POST", b"/echo", [], body)
            else:
                parts = [body[i : i + 700] for i in range(0, len(body), 700)] or [b""]
                length = len(body) if mode == "length" else None
                response = await pool.send("POST", b"/echo", [], parts_then(parts, 0, False), length)
            got = (response.status, await read_all(response))
            response.close()
            assert got == (200, body)  # its own body back, whatever ran beside it
            self.complete.append((b"/echo", body))
        elif kind == "slow upload":  # never READ_TIMEOUT_S without progress, longer in all
            body = self.marker(30)
            parts = [body[i::args[0]] for i in range(args[0])]
            response = await pool.send("POST", b"/echo", [], parts_then(parts, READ_TIMEOUT_S * 0.6, False))
            got = (response.status, await read_all(response))
            response.close()
            assert got == (200, b"".join(parts))
            self.complete.append((b"/echo", b"".join(parts)))
        elif kind in ("early answer, client leaves", "partial upload, client leaves"):
            target = b"/early" if kind.startswith("early") else b"/echo"
            upload = parts_then([self.marker(args[0])], 0.02, True)
            try:
                response = await pool.send("POST", target, [], upload, 1000)
            except ClientLeft:
                return
            assert response.status == 413
            response.close()
        elif kind == "paused read, client leaves":
            size, read_some = args
            response = await pool.send("GET", b"/big/%d" % size, [], b"")
            self.complete.append((b"/big/%d" % size, b""))
            await asyncio.sleep(0.02)
            if read_some:
                await response.read()
            response.close()

    @rule(op=operations)
    def one(self, op: tuple[Any, ...]) -> None:
        self.run(self.operate(op))

    @rule(first=operations, second=operations)
    def two_at_once(self, first: tuple[Any, ...], second: tuple[Any, ...]) -> None:
        async def both() -> None:
            await asyncio.gather(self.operate(first), self.operate(second))

        self.run(both())

    @rule()
    def keepalive_expires(self) -> None:
        self.run(asyncio.sleep(KEEPALIVE_S * 1.2))

    @rule()
    def upstream_closes_idle_connections(self) -> None:
        async def close_and_settle() -> None:
            self.upstream.close_idle()
            for _ in range(100):  # until the pool has seen them go
                if self.pool.pool_state()[1] == 0:
                    return
                await asyncio.sleep(0.01)

        self.run(close_and_settle())

    @rule()
    def upstream_resets_idle_connections_on_their_next_request(self) -> None:
        self.upstream.reset_idle_on_next_request()

    @invariant()
    def upstream_parsed_exactly_the_complete_requests(self) -> None:
        assert self.upstream.errors == []
        parsed = [(r.target, r.body) for r in self.upstream.requests]
        assert Counter(parsed) == Counter(self.complete)

    def teardown(self) -> None:
        try:
            self.run(self.pool.aclose())
            self.loop.run_until_complete(self.serving.__aexit__(None, None, None))
            assert self.pool.pool_state()[2] == 0  # nothing left checked out
        finally:
            self.loop.close()


PoolInterleavings.TestCase.settings = settings(
    max_examples=int(os.environ.get("CACHETALLY_INTERLEAVINGS", "25")),
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_interleavings = PoolInterleavings.TestCase

