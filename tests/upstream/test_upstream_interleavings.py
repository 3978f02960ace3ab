"""The pool as a Hypothesis state machine over interleavings, against an h11 upstream.

Rules run one operation, or two at once on the same pool: a complete request (body in
hand, streamed with its length, or chunked), an early answer to a partial upload whose
client then leaves, a partial upload abandoned with no answer, a response big enough to
pause reading that the client leaves unread or half read, a slow upload; and, between
them, keep-alive expiry, the upstream closing its idle connections, and the upstream
resetting its idle connections as their next request arrives (the idle-close race: a
request written in full, in hand, is sent once more on a new connection; a streamed one
cannot be and is a 502).

A crowd: more requests at once than the pool has connections, so some wait, and a drawn
few of them leave (cancelled: a client gone, the server's stop) a drawn number of loop
turns after the crowd starts or after a first response is in hand, just before or just
after a response is closed in the same turn. Every request that stays gets its own body
back with a 200; every one that leaves ends cancelled (or completed, if it finished first);
one that left before it was given a connection never reached the upstream; then nothing
is checked out and no waiter is queued.

The invariant, after every step: h11 parsed exactly the requests that were sent
completely (each with its own body: no byte of one inside another, none twice), each
client of a complete request got its own body back, and h11 never failed to parse a byte.
A request that left after it was given a connection counts as complete if h11 parsed it.
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
#: The upstream runs in the pool's own loop, so a stall of that loop (a busy host, a full
#: collection of a long-lived worker's heap) reads as the upstream's silence: at 0.15 s a
#: fresh-clone CI run once saw a ReadTimeout on a GET with no reset drawn, which Hypothesis
#: could not replay and three runs under full CPU load did not repeat. A slow upload's pauses
#: stay a fraction of it.
READ_TIMEOUT_S = 0.5


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


#: (size, which leave, counted from, loop turns, order): more requests than max_connections.
crowds = st.integers(4, 7).flatmap(lambda size: st.tuples(
    st.just(size),
    st.sets(st.integers(0, size - 1), min_size=1),
    st.sampled_from(["the crowd starts", "a first response is in hand"]),
    st.integers(0, 6),
    st.sampled_from(["leave, then a response closes", "a response closes, then leave"]),
))


class GivingPool(Http1Pool):
    """Records the tasks given a connection: a request that leaves before that wrote no byte."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given: set[asyncio.Task[Any] | None] = set()

    async def _acquire(self) -> Any:
        conn = await super()._acquire()
        self.given.add(asyncio.current_task())  # the request is written in this same step
        return conn


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

    async def _pool(self, port: int) -> GivingPool:
        return GivingPool(
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

    @rule(crowd=crowds)
    def crowd_some_leave(self, crowd: tuple[int, set[int], str, int, str]) -> None:
        self.run(self.crowd(*crowd))

    async def fetch(self, body: bytes) -> tuple[tuple[int, bytes], Any]:
        """Send ``body`` in hand and read the answer; the response is left for the crowd to close."""
        response = await self.pool.send("POST", b"/echo", [], body)
        try:
            return (response.status, await read_all(response)), response
        except BaseException:
            response.close()
            raise

    async def crowd(self, size: int, leave: set[int], since: str, turns: int, order: str) -> None:
        bodies = [self.marker(64) for _ in range(size)]
        tasks = [asyncio.ensure_future(self.fetch(body)) for body in bodies]
        closed: set[asyncio.Future[Any]] = set()

        def answered() -> list[asyncio.Future[Any]]:  # in the order they were started
            return [t for t in tasks if t.done() and not t.cancelled() and t.exception() is None and t not in closed]

        def close(task: asyncio.Future[Any]) -> None:
            closed.add(task)
            task.result()[1].close()  # its connection goes to the first waiter, or back to the pool

        if since == "a first response is in hand":
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for _ in range(turns):
            await asyncio.sleep(0)
        ready = answered()[:1]  # one closes in the same turn as the leaving, before or after it
        if order == "a response closes, then leave":
            for task in ready:
                close(task)
        for i in sorted(leave):
            tasks[i].cancel()
        if order == "leave, then a response closes":
            for task in ready:
                close(task)
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:  # close every answer as it comes, so that every waiter is served
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in answered():
                close(task)
        await self.settle()
        parsed = Counter((r.target, r.body) for r in self.upstream.requests)
        for i, (task, body) in enumerate(zip(tasks, bodies)):
            if task.cancelled():
                assert i in leave
                if task in self.pool.given:  # it may have reached the upstream, or not
                    if parsed[(b"/echo", body)]:
                        self.complete.append((b"/echo", body))
                else:
                    head = body[: body.index(b"}") + 1]
                    reached = [r for r in (*self.upstream.requests, *self.upstream.cut) if head in r.body]
                    assert reached == [], f"request {i} left while it waited, yet reached the upstream"
                continue
            assert task.exception() is None, f"request {i} ended in {task.exception()!r}"
            assert task.result()[0] == (200, body)  # its own body back; no 503 while connections idle
            self.complete.append((b"/echo", body))
        _, _, checked_out, waiting = self.pool.pool_state()
        assert (checked_out, waiting) == (0, 0), self.pool.pool_state()

    async def settle(self) -> None:
        """Until the upstream has read to the end of every connection dropped, and the pool has seen them go."""
        for _ in range(100):
            if self.upstream.busy() == 0 and self.pool.pool_state()[2] == 0:
                return
            await asyncio.sleep(0.01)

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

