"""The upstream connection pool: HTTP/1.1 keep-alive connections to one origin, and a fair wait queue.

Chosen over httpx and aiohttp by measurement (docs/PERFORMANCE.md). Only the client side
of a keep-alive pool is written here; the response is parsed by httptools (llhttp). Each
exchange keeps h11's two explicit states (:mod:`proxy.upstream.connection`), everything
written is validated (:mod:`proxy.upstream.wire`), and the pool is tested against h11 as
an independent parser, with a Hypothesis state machine over interleavings
(tests/upstream/test_upstream_interleavings.py).

What is sent: the request line with the target as the client sent it, ``Host`` from the
configured origin, the client's end-to-end headers, then the pool's own framing; nothing
else (no ``User-Agent``, ``Accept``, cookies, proxy settings from the environment). The
response body is relayed as the upstream framed its content (chunked framing removed,
content codings untouched); redirects are relayed, not followed; 1xx are skipped.

A streamed body is written by its own task while the head is awaited, so an early answer
(a 401 or 413 before the upload ends) reaches the client at once. The connection is then
reused only if the upload still completes; if the client leaves or the body is invalid,
it is dropped.

Connections: at most ``max_connections`` open or opening; idle ones reused last-in
first-out while younger than ``keepalive_s`` since the upstream last finished a response,
or than 80% of the idle time the upstream announced (``Keep-Alive: timeout=N``) if that is
shorter (checked when pooled and when taken). A request the upstream cannot have acted on
is sent once more, on a new connection: written in full on a connection reused from idle,
which then closed before one byte of response; a non-idempotent one only when the
connection was reset (:mod:`proxy.upstream.resend`). A request that finds none free waits in a FIFO
queue: a freed connection, or a freed place to connect, is handed to exactly one waiter,
and a waiter that leaves (timeout, cancel) as it is handed one passes it on. Waiting past
``connect_timeout_s`` is a 503. ``https://`` origins verify certificates (system CAs, or
``ca_file``).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable

from proxy.asgi.headers import Headers
from proxy.upstream.client import POOL_FULL, TIMED_OUT, UNREACHABLE, Origin, UpstreamFailure
from proxy.upstream.connection import SEND_BODY, Connection
from proxy.upstream.resend import may_resend
from proxy.upstream.response import Http1Response
from proxy.upstream.wire import LengthCheck, framing_for, request_head

#: Handed to a waiter instead of a connection: a place under the limit, to connect itself.
_ROOM_TO_CONNECT = object()

#: What a waiter is handed: a connection, ``_ROOM_TO_CONNECT``, or ``None`` when the pool closes.
WaiterGets = Connection | object | None


class Http1Pool:
    """Implements ``UpstreamClient``; create it in the event loop that will use it."""

    def __init__(
        self, origin: Origin, *, max_connections: int, keepalive_s: float, connect_timeout_s: float,
        read_timeout_s: float, write_timeout_s: float = 60.0, ca_file: str | None = None,
    ) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._write_timeout_s = write_timeout_s
        self._tls = ssl.create_default_context(cafile=ca_file) if origin.tls else None
        self._idle: list[Connection] = []
        self._places = 0  # connections open or opening (or a place handed to a waiter)
        self._waiters: deque[asyncio.Future[WaiterGets]] = deque()
        self._closed = False

    # -- UpstreamClient --------------------------------------------------------------------

    async def send(
        self, method: str, target: bytes, headers: Headers, body: bytes | AsyncIterable[bytes],
        length: int | None = None,
    ) -> Http1Response:
        framing = framing_for(method, len(body) if isinstance(body, bytes) else None, length)
        head = request_head(method, self.origin.base_path + target, self.origin.host_header, headers, framing)
        try:
            return await self._exchange(method, head, body, length)
        except UpstreamFailure as failure:
            if not failure.resendable:
                raise
            # Once, on a new connection: the others idle as long are as likely to be closing.
            self._close_idle()
            return await self._exchange(method, head, body, length)

    async def _exchange(
        self, method: str, head: bytes, body: bytes | AsyncIterable[bytes], length: int | None
    ) -> Http1Response:
        in_hand = isinstance(body, bytes)
        conn = await self._acquire()
        response = Http1Response(conn, self.loop, self._read_timeout_s)
        conn.begin(response, method == "HEAD")
        try:
            if in_hand:
                conn.write(head, body)  # type: ignore[arg-type]
                if conn.write_paused:  # the upstream may answer before it takes the rest
                    conn.ours = SEND_BODY
                    drain = functools.partial(conn.drain, self._write_timeout_s)
                    response.upload = self.loop.create_task(self._writing(conn, response, drain))
                else:
                    conn.wrote_all()
            else:
                conn.write(head)
                conn.ours = SEND_BODY
                upload = functools.partial(self._upload, conn, response, body, length)
                response.upload = self.loop.create_task(self._writing(conn, response, upload))  # type: ignore[arg-type]
            while not response.status:
                if response.upload is not None and response.upload.done() and not response.upload.cancelled():
                    if (exc := response.upload.exception()) is not None:
                        raise exc
                if response.error is not None:
                    raise response.error
                await response.wait()
        except BaseException as exc:
            response.close()  # pooled only if both sides are done (a cancel can land after the end)
            if isinstance(exc, UpstreamFailure) and may_resend(method, in_hand, conn, exc):
                exc.resendable = True
            raise
        return response

    @staticmethod
    async def _writing(conn: Connection, response: Http1Response, write: Callable[[], Awaitable[None]]) -> None:
        """The rest of a request, written beside its response (so that an early answer, a 413
        before the upstream reads the body, is the client's): a streamed body, or the part of
        an in-hand one the transport still holds. Our side ends DONE or ERROR."""
        try:
            await write()  # made here: a task cancelled before it starts leaves no coroutine unawaited
            conn.wrote_all()
        except BaseException as exc:
            conn.abandon(type(exc).__name__)
            raise
        finally:
            response.wake()

    async def _upload(
        self, conn: Connection, response: Http1Response, body: AsyncIterable[bytes], length: int | None
    ) -> None:
        """Write a streamed body: the client's length, checked, or chunked."""
        check = LengthCheck(length) if length is not None else None
        async for chunk in body:
            if conn.closed:
                raise response.error or UpstreamFailure(UNREACHABLE, "ServerDisconnected")
            if not chunk:
                continue
            if check is None:
                conn.write(b"%x\r\n" % len(chunk), chunk, b"\r\n")
            elif part := check.part(chunk):
                conn.write(part)
            await conn.drain(self._write_timeout_s)
        conn.write(b"0\r\n\r\n" if check is None else check.end())
        await conn.drain(self._write_timeout_s)
        if conn.closed:
            raise response.error or UpstreamFailure(UNREACHABLE, "ServerDisconnected")

    # -- the pool --------------------------------------------------------------------------

    async def _acquire(self) -> Connection:
        deadline = self.loop.time() + self._connect_timeout_s
        while True:
            now = self.loop.time()
            while self._idle:
                conn = self._idle.pop()
                if conn.fresh(now, self._keepalive_s):
                    return conn
                conn.close()
            if self._closed:
                raise UpstreamFailure(UNREACHABLE, "ClientClosed")
            if self._places < self.max_connections and not self._waiters:
                self._places += 1
                return await self._connect(deadline)
            handed = await self._wait(deadline)
            if handed is None:
                continue  # the pool closed
            if handed is _ROOM_TO_CONNECT:
                return await self._connect(deadline)
            assert isinstance(handed, Connection)
            if not handed.closed:
                return handed
            # closed between hand-over and wake-up: its place was freed, so queue again

    async def _wait(self, deadline: float) -> WaiterGets:
        waiter: asyncio.Future[WaiterGets] = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                handed = waiter.result()
                if isinstance(exc, TimeoutError):
                    return handed  # it came in time; the timer fired in the same turn
                self._pass_on(handed)  # cancelled as it was handed one: the next waiter gets it
                raise
            waiter.cancel()
            if waiter in self._waiters:  # _hand drops a waiter cancelled before it runs, and serves the next
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise UpstreamFailure(POOL_FULL, "PoolTimeout") from None
            raise

    def _hand(self, handed: WaiterGets) -> bool:
        """Give ``handed`` to the first waiter still waiting; False if there is none."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(handed)
                return True
        return False

    def _pass_on(self, handed: WaiterGets) -> None:
        if handed is _ROOM_TO_CONNECT:
            self._free_slot()
        elif handed is not None:
            assert isinstance(handed, Connection)
            self._pool(handed)

    def _free_slot(self) -> None:
        if self._closed or not self._hand(_ROOM_TO_CONNECT):
            self._places -= 1

    async def _connect(self, deadline: float) -> Connection:
        """Open a connection in a place (slot) the caller holds; the place is freed if it fails."""
        made: list[Connection] = []

        def protocol() -> Connection:
            made.append(Connection(self))
            return made[-1]

        origin = self.origin
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can drop the result of a
            # connect that completes as it is cancelled, and leave that connection open.
            async with asyncio.timeout_at(deadline):
                _, conn = await self.loop.create_connection(protocol, origin.host, origin.port, ssl=self._tls)
        except BaseException as exc:
            for half_made in made:  # a cancel or timeout can land after connection_made
                half_made.close()
            self._free_slot()
            if isinstance(exc, TimeoutError):
                raise UpstreamFailure(TIMED_OUT, "ConnectTimeout") from None
            if isinstance(exc, OSError):  # ssl.SSLError included
                raise UpstreamFailure(UNREACHABLE, type(exc).__name__) from exc
            raise
        conn.owns_slot = True
        return conn

    def finish(self, conn: Connection) -> None:
        """An exchange ended: its connection is pooled if reusable(), else closed."""
        conn.response = None
        if conn.reusable() and not self._closed:
            self._pool(conn)
        else:
            conn.close()

    def _pool(self, conn: Connection) -> None:
        if conn.closed:
            return
        if not conn.fresh(self.loop.time(), self._keepalive_s):
            conn.close()  # the upstream may be closing it already
        elif not self._hand(conn):
            self._idle.append(conn)

    def forget(self, conn: Connection) -> None:
        """``conn`` is closed (by either side): its place goes to a waiter, or is freed."""
        if conn in self._idle:
            self._idle.remove(conn)
        if conn.owns_slot:
            conn.owns_slot = False
            self._free_slot()

    def pool_state(self) -> tuple[int, int, int, int]:
        idle = sum(1 for conn in self._idle if not conn.closed)
        return self._places, idle, self._places - idle, len(self._waiters)

    def _close_idle(self) -> None:
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()

    async def aclose(self) -> None:
        self._closed = True
        self._close_idle()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # it finds the pool closed
        await asyncio.sleep(0)  # let the transports run connection_lost
