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
are an error too: they could only be the start of a response to a request never sent. So
is a ``101 Switching Protocols``: no request asks for an upgrade (``Upgrade`` is a
hop-by-hop header, never forwarded), and what follows it is not HTTP.

Reading pauses while a slow client leaves too much of one response unread
(:mod:`proxy.upstream.response`), and, as in uvicorn's ``httptools_impl``, always
resumes when the response ends, so a connection never outlives its response paused. The
response is parsed by httptools (llhttp, the parser uvicorn uses on the server side).
The write timeout bounds each wait for the upstream to take more of an upload
(``drain``); the read timeout is the response's.
"""

from __future__ import annotations

import asyncio
import enum

import httptools

from proxy.upstream.client import TIMED_OUT, UNREACHABLE, UpstreamFailure
from proxy.upstream.hop_headers import keep_alive_timeout
from proxy.upstream.roles import ConnectionOwner, ResponseSink


class State(enum.Enum):
    IDLE = "IDLE"
    SEND_BODY = "SEND_BODY"
    DONE = "DONE"
    MUST_CLOSE = "MUST_CLOSE"
    ERROR = "ERROR"


IDLE, SEND_BODY, DONE, MUST_CLOSE, ERROR = State
_READING = (IDLE, SEND_BODY)  # their states in which response bytes are expected
#: Of the idle time the upstream announces (``Keep-Alive: timeout=N``), the part we reuse a
#: connection in: we, not the upstream, end an idle connection (5 s announced -> 4 s).
KEEPALIVE_SHARE = 0.8


class Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionOwner) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ours = IDLE
        self.theirs = IDLE
        self.response: ResponseSink | None = None
        self.reading_paused = False
        self.closed = False
        self.owns_slot = False  # counted in the pool's limit (set once the connect succeeded)
        self.idle_since = 0.0  # when the upstream last finished a response: its keep-alive clock
        self.idle_limit: float | None = None  # the upstream's announced keep-alive timeout, our share
        self.exchanges = 0  # begun on this connection: more than one, and it was reused
        self.heard = False  # a byte of this exchange's response arrived
        self._head_only = False
        self._keep_alive = True
        self._interim = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # -- the two sides -------------------------------------------------------------------

    def reusable(self) -> bool:
        """h11's rule: both sides DONE, reading not paused, the connection open."""
        return self.ours is DONE and self.theirs is DONE and not self.reading_paused and not self.closed

    def begin(self, response: ResponseSink, head_only: bool) -> None:
        """A new exchange: both sides start IDLE (a reused connection was reusable())."""
        self.ours = self.theirs = IDLE
        self.response, self._head_only = response, head_only
        self.exchanges += 1
        self.heard = False

    def fresh(self, now: float, limit_s: float) -> bool:
        """Open, and idle for less than ``limit_s`` or the upstream's own limit, if shorter."""
        if self.idle_limit is not None:
            limit_s = min(limit_s, self.idle_limit)
        return not self.closed and now - self.idle_since < limit_s

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

    def their_error(self, error: UpstreamFailure) -> None:
        """Their side failed (unparsable, timed out, cut off): the response gets ``error``."""
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
            self.their_error(UpstreamFailure(UNREACHABLE, "UnexpectedBytes"))
            self.abort("UnexpectedBytes")  # the start of a response to nothing we sent
            return
        response.last_read = self.pool.loop.time()
        self.heard = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # not one family
            self.their_error(UpstreamFailure(UNREACHABLE, type(exc).__name__))
            self.abort(type(exc).__name__)

    def connection_lost(self, exc: Exception | None) -> None:
        by_them = not self.closed  # we mark our own close or abort before the transport ends
        self._closed()
        response = self.response
        if by_them and exc is None and self.theirs is SEND_BODY and response and response.delimited_by_close():
            self._keep_alive = False
            self._their_end()  # a body without a length ends with its connection (theirs, not ours)
        else:
            reason = type(exc).__name__ if exc else "ServerDisconnected" if by_them else "ClosedMidResponse"
            self.their_error(UpstreamFailure(UNREACHABLE, reason))
        self._wake_writer(exc or ConnectionResetError("connection closed"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer(None)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.theirs is not IDLE:  # a second response in the same bytes: nothing asked for it
            self.their_error(UpstreamFailure(UNREACHABLE, "UnexpectedResponse"))
            self.abort("UnexpectedResponse")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.theirs is IDLE and self.response is not None:
            self.response.headers.append((name, value))
            if name.lower() == b"keep-alive" and (timeout := keep_alive_timeout(value)) is not None:
                self.idle_limit = timeout * KEEPALIVE_SHARE

    def on_headers_complete(self) -> None:
        if self.theirs is not IDLE or self.response is None:
            return
        status = self.parser.get_status_code()
        if status == 101:  # a switch to another protocol: we never ask for one (Upgrade is hop-by-hop)
            self.their_error(UpstreamFailure(UNREACHABLE, "UnexpectedUpgrade"))
            self.abort("UnexpectedUpgrade")
            return
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
