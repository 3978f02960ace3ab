"""One exchange's response as ``Forward`` reads it: buffered chunks, the read timeout.

The connection (:mod:`proxy.upstream.connection`) feeds it; nothing here decides reuse.
``close`` hands the connection back to the pool, which reuses it only when both sides
of the exchange are done.

The read timeout runs from the moment the request is written in full (or the first byte
of an early answer), restarts with every byte read and stops while reading is paused for
a slow client (``HIGH_WATER`` bytes unread): a client that takes nothing for
``client_send_timeout_s`` is let go by the server (:mod:`proxy.server.client_bounds`). Waiters are woken with a result, never an
exception, so nothing is left unretrieved when nobody waits any more.
"""

from __future__ import annotations

import asyncio

from proxy.asgi.headers import Headers
from proxy.upstream.client import TIMED_OUT, UpstreamFailure
from proxy.upstream.roles import ExchangeConnection

#: Body bytes of one response buffered before reading from the upstream pauses.
HIGH_WATER = 256 * 1024


class Http1Response:
    """Implements ``UpstreamResponse`` for one exchange on one connection."""

    __slots__ = (
        "_buffered", "_chunks", "_read_timeout_s", "_released", "_waiter", "_watchdog", "complete",
        "conn", "error", "headers", "last_read", "loop", "status", "upload",
    )

    def __init__(self, conn: ExchangeConnection, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.conn = conn
        self.loop = loop
        self.status = 0  # 0 until the final head arrives
        self.headers: Headers = []
        self.last_read = 0.0
        self.complete = False  # the body was read from the wire to its end
        self.error: UpstreamFailure | None = None
        self.upload: asyncio.Task[None] | None = None  # a streamed body being written
        self._read_timeout_s = read_timeout_s
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        self._watchdog: asyncio.TimerHandle | None = None

    # -- fed by the connection -------------------------------------------------------------

    def request_written(self) -> None:
        """The read timeout starts now (if an early answer has not started it already)."""
        if self._watchdog is None and not self.complete and self.error is None:
            self.last_read = self.loop.time()
            self._watchdog = self.loop.call_at(self.last_read + self._read_timeout_s, self._check_idle)

    def on_head(self, status: int) -> None:
        self.status = status
        self.request_written()  # an early answer: the upstream is talking, so time it
        self.wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered >= HIGH_WATER:
            self.conn.pause_reading()
        self.wake()

    def on_complete(self) -> None:
        self.complete = True
        self._stop_watchdog()
        self.wake()

    def fail(self, error: UpstreamFailure) -> None:
        if self.error is None and not self.complete:
            self.error = error
            self._stop_watchdog()
            self.wake()

    def delimited_by_close(self) -> bool:
        if self.status in (204, 304):
            return False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    def _check_idle(self) -> None:
        """The read timeout: one timer per response, moved on only when it fires."""
        if self.conn.reading_paused:  # paused for a slow client: the upstream is not silent
            self.last_read = self.loop.time()
        due = self.last_read + self._read_timeout_s
        if self.loop.time() < due:
            self._watchdog = self.loop.call_at(due, self._check_idle)
            return
        self._watchdog = None
        self.conn.their_error(UpstreamFailure(TIMED_OUT, "ReadTimeout"))
        self.conn.abort("ReadTimeout")

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # never an exception: nothing is left unretrieved

    async def wait(self) -> None:
        self._waiter = self.loop.create_future()
        await self._waiter

    # -- UpstreamResponse -------------------------------------------------------------------

    async def read(self) -> bytes:
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self.conn.reading_paused:
                    self.conn.resume_reading()
                return data
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self.wait()

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        self._stop_watchdog()
        conn = self.conn
        upload = self.upload
        if upload is not None:
            if not upload.done():
                upload.cancel()  # the client is done with this exchange: so is its upload
                conn.abandon("UploadAbandoned")
            elif not upload.cancelled():
                upload.exception()  # it failed after the head came; its connection went with it
        conn.pool.finish(conn)
