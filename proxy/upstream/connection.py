"""One upstream HTTP/1.1 connection: both sides' states, the response parser, flow control.

Shaped like h11's connection state machine (``h11/_state.py``): each side of the
exchange has one explicit state, kept in :class:`Connection` and changed only here.

=========  ====================================  =====================================
state      ``ours`` (the request)                ``theirs`` (the response)
=========  ====================================  =====================================
IDLE       nothing written yet                   no final head yet (1xx are skipped)
SEND_BODY  head written, body under way          head read, body under way
DONE       every byte of the body written        body read to its end, keep-alive
MUST_CLOSE                                       ended, but the upstream asked to close
ERROR      abandoned, invalid, or write failed   unparsable, timed out, or cut off
=========  ====================================  =====================================

:meth:`Connection.reusable` is h11's rule, the one place that decides reuse: both sides
DONE, reading not paused, still open. Anything else closes the connection. Bytes that
arrive when no response is expected (on an idle connection, or after a response ended)
are an error too: they could only be the start of a response to a request never sent.

Reading pauses while ``HIGH_WATER`` bytes of one response wait for a slow client, and,
as in uvicorn's ``httptools_impl``, always resumes when the response ends, so a
connection never outlives its response paused. The response is parsed by httptools
(llhttp, the parser uvicorn uses on the server side).

Timeouts: the read timeout runs from the moment the request is written in full (or
the first byte of an early answer), restarts with every byte read and stops while
reading is paused; the write timeout bounds each wait for the upstream to take more of
an upload (``drain``).
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

import httptools

from proxy.upstream.client import TIMED_OUT, UNREACHABLE, Headers, UpstreamFailure

if TYPE_CHECKING:
    from proxy.upstream.pool import Http1Pool

#: Body bytes of one response buffered before reading from the upstream pauses.
HIGH_WATER = 256 * 1024


class State(enum.Enum):
    IDLE = "IDLE"
    SEND_BODY = "SEND_BODY"
    DONE = "DONE"
    MUST_CLOSE = "MUST_CLOSE"
    ERROR = "ERROR"


IDLE, SEND_BODY, DONE, MUST_CLOSE, ERROR = State
_READING = (IDLE, SEND_BODY)  # their states in which response bytes are expected


class Connection(asyncio.Protocol):
    def __init__(self, pool: Http1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ours = IDLE
        self.theirs = IDLE
        self.response: Http1Response | None = None
        self.reading_paused = False
        self.closed = False
        self.owns_slot = False  # counted in the pool's limit (set once the connect succeeded)
        self.idle_since = 0.0  # when the upstream last finished a response: its keep-alive clock
        self._head_only = False
        self._keep_alive = True
        self._interim = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # -- the two sides -------------------------------------------------------------------

    def reusable(self) -> bool:
        """h11's rule: both sides DONE, reading not paused, the connection open."""
        return self.ours is DONE and self.theirs is DONE and not self.reading_paused and not self.closed

    def begin(self, response: Http1Response, head_only: bool) -> None:
        """A new exchange: both sides start IDLE (a reused connection was reusable())."""
        self.ours = self.theirs = IDLE
        self.response, self._head_only = response, head_only

    def wrote_all(self) -> None:
        """Our side is DONE: every byte of the request is in the transport."""
        if self.ours is not ERROR:
            self.ours = DONE
            if self.response is not None:
                self.response.request_written()

    def abandon(self, reason: str) -> None:
        """Our side failed or gave up mid-request: the connection can only be dropped."""
        if self.ours is not DONE:
            self.ours = ERROR
        self.abort(reason)

    def _their_end(self) -> None:
        self.theirs = DONE if self._keep_alive and not self._head_only else MUST_CLOSE
        self.idle_since = self.pool.loop.time()
        if self.reading_paused:
            self.resume_reading()
        if self.response is not None:
            self.response.on_complete()

    def _their_error(self, error: UpstreamFailure) -> None:
        if self.theirs in _READING:
            self.theirs = ERROR
            if self.response is not None:
                self.response.fail(error)

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or self.theirs not in _READING:
            self._their_error(UpstreamFailure(UNREACHABLE, "UnexpectedBytes"))
            self.abort("UnexpectedBytes")  # the start of a response to nothing we sent
            return
        response.last_read = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._their_error(UpstreamFailure(UNREACHABLE, type(exc).__name__))
            self.abort(type(exc).__name__)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        if self.theirs is SEND_BODY and self.response is not None and self.response.delimited_by_close():
            self._keep_alive = False
            self._their_end()  # a body without a length ends with its connection
        else:
            self._their_error(UpstreamFailure(UNREACHABLE, type(exc).__name__ if exc else "ServerDisconnected"))
        self._wake_writer(exc or ConnectionResetError("connection closed"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer(None)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.theirs is not IDLE:  # a second response in the same bytes: nothing asked for it
            self._their_error(UpstreamFailure(UNREACHABLE, "UnexpectedResponse"))
            self.abort("UnexpectedResponse")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.theirs is IDLE and self.response is not None:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.theirs is not IDLE or self.response is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): skipped
            self._interim = True
            self.response.headers.clear()
            return
        self.theirs = SEND_BODY
        self._keep_alive = self.parser.should_keep_alive()
        self.response.on_head(status)
        if self._head_only:  # a response to HEAD has no body, whatever its headers say;
            self._their_end()  # llhttp would wait for Content-Length bytes, so it is not reused

    def on_body(self, body: bytes) -> None:
        if self.theirs is SEND_BODY and self.response is not None:
            self.response.on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif self.theirs is SEND_BODY:
            self._their_end()

    # -- I/O -------------------------------------------------------------------------------

    def write(self, *pieces: bytes) -> None:
        """One write of ``pieces`` (a vectored write: the body is not copied to join them)."""
        if self.transport is not None and not self.closed:
            self.transport.writelines(pieces)

    async def drain(self, timeout_s: float) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        if not self.write_paused or self.closed:
            return
        self._drain = self.pool.loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._drain
        except TimeoutError:
            raise UpstreamFailure(TIMED_OUT, "WriteTimeout") from None

    def _wake_writer(self, exc: BaseException | None) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            if exc is None:
                drain.set_result(None)
            else:
                drain.set_exception(UpstreamFailure(UNREACHABLE, type(exc).__name__))

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def close(self) -> None:
        """Close it and leave the pool at once (``connection_lost`` follows a tick later)."""
        if not self.closed and self.transport is not None:
            self._closed()
            self.transport.close()

    def abort(self, reason: str) -> None:
        """Drop it without flushing what is buffered: a half-written request goes no further."""
        if not self.closed and self.transport is not None:
            self._closed()
            self.transport.abort()

    def _closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)


class Http1Response:
    """Implements ``UpstreamResponse`` for one exchange on one connection."""

    __slots__ = (
        "_buffered", "_chunks", "_read_timeout_s", "_released", "_waiter", "_watchdog", "complete",
        "conn", "error", "headers", "last_read", "loop", "status", "upload",
    )

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
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
        self.conn._their_error(UpstreamFailure(TIMED_OUT, "ReadTimeout"))
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
