"""Bounds on a client: uvicorn's httptools protocol with nginx's timeouts, both ways, and h11's header bound.

uvicorn's httptools protocol (what uvicorn and vLLM serve with) has none of them, and waits
for a client as long as its socket stays open (docs/RELIABILITY.md §3 has what each held):

- ``client_send_timeout_s`` (nginx's ``send_timeout``): the time between two writes that make
  progress, once the connection's write buffer is full and the app's ``send`` waits in
  uvicorn's flow control. In upstream mode that wait held an upstream connection; in vLLM's
  server the engine went on generating the request.
- ``client_receive_timeout_s`` (nginx's ``client_header_timeout`` and ``client_body_timeout``):
  a header is timed as a whole, from the connection's start (or from the first byte after a
  kept-alive request, blank lines included), a body between two reads. Time the server makes
  the client wait is not counted: reading paused by flow control, a ``100 Continue`` not sent
  yet, a pipelined request's header behind a response still running. Each such wait ends in
  uvicorn's flow control resuming reading (the app's ``receive``, a response's end), and the
  client has a whole bound from there. A body that ends after its answer leaves the
  connection to uvicorn's keep-alive timer, which its bytes stopped.
- A header's size: uvicorn's h11 protocol bounds it (``h11_max_incomplete_event_size``, 16 KiB
  by default; vLLM sets 4 MiB and 256 fields), httptools holds it in memory as it comes. Past
  the bound while it still arrives, or past the fields when it ends: a 431 in OpenAI error JSON.
- Pipelined requests: uvicorn queues them behind the running response without a bound, reading
  on at each response's end (docs/RELIABILITY.md §4); past :data:`MAX_PIPELINED`, a reset.

A client past a timeout is let go as one that left: uvicorn sees ``connection_lost``, a waiting
``send`` returns, ``receive`` says ``http.disconnect``, and the request ends as any disconnect
does (in upstream mode its upstream connection is closed, never pooled; its usage record, if it
reached the engine, says ``disconnected``). Nothing is cancelled inside uvicorn's ``send`` or
``receive``, so no traceback; one warning says it. A connection with no request begun is
aborted with a debug line only (load balancers' probes open such sockets).

Only ``asyncio.Protocol``'s calls, uvicorn's parser callbacks and its flow control's
``resume_reading`` are overridden, each calling uvicorn's own. vLLM's server is vLLM's uvicorn,
built before any cachetally code runs: the middleware puts this protocol in its config at the
lifespan's startup (:func:`bound_vllms_clients`), before uvicorn opens its listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.asgi.errors import error_body

logger = logging.getLogger("cachetally.app")

#: What uvicorn's h11 protocol allows a request's header by default (h11's own default).
H11_MAX_HEADER_BYTES = 16 * 1024
#: Requests queued behind a running one on a connection (HTTP clients pipeline few, if any).
MAX_PIPELINED = 16
_REFUSAL = error_body("", 431, "Request header fields too large")  # before any route is known
_HEADER_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))


class HeaderTooLarge(Exception):
    """Raised in the parser's callback to stop it: a header with too many fields, a request pipelined too deep."""


# What the connection is receiving: nothing the client owes (a request arrived whole, or a
# kept-alive connection between requests: uvicorn's keep-alive timer), a header, a body.
_OWED_NOTHING, _HEADER, _BODY = 0, 1, 2


class ClientBoundsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (what its ``auto`` picks: httptools is a dependency),
    with a client that takes no response bytes for ``send_timeout_s``, or sends too slowly
    for ``receive_timeout_s``, taken for gone."""

    def __init__(self, *args: Any, send_timeout_s: float, receive_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._send_timeout_s = send_timeout_s
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the timer was started
        self._receive_timeout_s = receive_timeout_s
        self._receive_timer: asyncio.TimerHandle | None = None
        self._owed = _OWED_NOTHING
        self._owed_since = 0.0  # the header's start, the body's last read, or a server's wait's end
        self._server_waited = False  # the server made the client wait since _owed_since
        # A header's size and fields: uvicorn's h11 protocol bounds them, its httptools one
        # does not (vLLM sets both limits for h11, 4 MiB and 256, which httptools ignored).
        self._max_header_bytes = self.config.h11_max_incomplete_event_size or H11_MAX_HEADER_BYTES
        self._max_header_fields: int | None = getattr(self.config, "h11_max_header_count", None)
        self._header_bytes = 0  # received since the last header was whole: the next one's
        self._header_refused = self._pipeline_refused = False

    # -- receiving ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _ResumeTold(transport, self._server_wait_over)  # before any request takes it
        self._owe(_HEADER)  # the first request's header is timed from the connection's start

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unset_keepalive_if_required()  # armed in this same read, by on_message_complete
        if self._owed is _OWED_NOTHING:  # a request after the first, on a kept-alive connection
            self._owe(_HEADER)

    def on_headers_complete(self) -> None:
        fields = self._max_header_fields
        if fields is not None and len(self.headers) > fields:  # in one read: the parser stops here
            self._header_refused = True
            raise HeaderTooLarge  # uvicorn takes it for a malformed request: send_400_response
        if len(self.pipeline) >= MAX_PIPELINED:  # all queued behind a response still running
            self._pipeline_refused = True  # uvicorn would queue it: the parser stops here, mid-read
            raise HeaderTooLarge
        super().on_headers_complete()
        self._owe(_BODY)
        self._header_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._header_refused:
            self._refuse_header()
        elif self._pipeline_refused:
            logger.warning("a client pipelined over %d requests behind a running one: connection reset", MAX_PIPELINED)
            self._reset()  # the response running owns the connection's bytes: no answer can go
        else:
            super().send_400_response(msg)

    def data_received(self, data: bytes) -> None:
        if self._owed is _OWED_NOTHING:  # the next header's first byte, or a blank line before it
            self._owe(_HEADER)
        if self._owed is _BODY:  # progress (a header is timed as a whole)
            self._owed_since = self.loop.time()
        else:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._owed is _HEADER and self._header_too_large() and not self.transport.is_closing():
            self._refuse_header()
            return
        # Every server's wait begins here (reading paused, a header asking for 100 Continue, a
        # pipelined header); it ends in flow control's resume_reading.
        if self._owed is not _OWED_NOTHING and self._server_is_the_one_waiting():
            self._server_waited = True

    def _header_too_large(self) -> bool:
        # At most one read (256 KiB) past the bound: the parser holds what it is given.
        fields = self._max_header_fields
        return self._header_bytes > self._max_header_bytes or (
            fields is not None and self.headers is not None and len(self.headers) > fields)

    def _refuse_header(self) -> None:
        logger.warning("a request header over %d bytes or %s fields was refused (431)",
                       self._max_header_bytes, self._max_header_fields or "any number of")
        if self.cycle is not None and not self.cycle.response_complete:
            self._reset()  # a pipelined request's: the response running on the connection owns its bytes
            return
        self.transport.write(_HEADER_TOO_LARGE)
        self.transport.close()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The timer, if it runs, stands down when it fires. An upgrade's request is complete
        # before uvicorn hands the connection to its WebSocket protocol: never timed as one.
        self._owed = _OWED_NOTHING
        upgrade = self.parser.should_upgrade() and self._should_upgrade()  # self.cycle is the last request's
        if not upgrade and self.cycle.response_complete and not self.transport.is_closing():
            # Its answer went before its body's end: uvicorn armed its keep-alive timer then,
            # and the body's bytes stopped it.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._owed is _HEADER:  # the next request's header began: its bound times it, not keep-alive's
            self._unset_keepalive_if_required()

    def _owe(self, what: int) -> None:
        self._owed, self._owed_since, self._server_waited = what, self.loop.time(), False
        if self._receive_timer is None:
            self._time_receive(self._owed_since + self._receive_timeout_s)

    def _time_receive(self, when: float) -> None:
        self._receive_timer = self.loop.call_at(when, self._receive_due)

    def _server_wait_over(self) -> None:
        """Flow control resumed reading: a server's wait may be over, and the client has a whole
        bound from now (the timer stood down while the server waited)."""
        if self._server_waited and not self._server_is_the_one_waiting():
            self._server_waited, self._owed_since = False, self.loop.time()
            if self._receive_timer is None:
                self._time_receive(self._owed_since + self._receive_timeout_s)

    def _receive_due(self) -> None:
        self._receive_timer = None
        if self._owed is _OWED_NOTHING or self.transport.is_closing() or self._server_is_the_one_waiting():
            return  # nothing owed, or the server's wait, whose end times the client again
        now = self.loop.time()
        due = self._owed_since + self._receive_timeout_s
        if now < due:
            self._time_receive(due)
            return
        if self._owed is _HEADER:
            logger.debug("a connection sent no whole request header in %g s (client_receive_timeout_s): "
                         "it is aborted", self._receive_timeout_s)
            # Aborted, not closed: over TLS a close waits for the client's close_notify, which a
            # silent client never sends, for the loop's ssl_shutdown_timeout (30 s) past the bound.
            self.transport.abort()
            return
        logger.warning("a client sent none of its request body for %g s (client_receive_timeout_s): its "
                       "connection is closed, and its request ends as a disconnect", self._receive_timeout_s)
        self._reset()

    def _server_is_the_one_waiting(self) -> bool:
        cycle = self.cycle
        running = cycle is not None and not cycle.response_complete
        if self._owed is _HEADER:  # a pipelined request's header, behind a response still running
            return running
        return self.flow.read_paused or (running and cycle.waiting_for_100_continue)

    # -- sending -------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._time_send()

    def resume_writing(self) -> None:
        # A closing transport (the response whole, keep-alive over or "Connection: close") is
        # never paused again: its timer runs on until the client has taken every byte.
        if not self.transport.is_closing():
            self._stop(self._send_timer)
            self._send_timer = None
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop(self._send_timer)
        self._stop(self._receive_timer)
        super().connection_lost(exc)

    def _time_send(self) -> None:
        if self._send_timer is None:  # writes pause only on a connection uvicorn's protocol holds
            self._unsent = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(self._send_timeout_s, self._send_due)

    def _send_due(self) -> None:
        self._send_timer = None  # connection_lost stops it: the transport is still this one's
        # A closing one too: close() waits for the unsent bytes, for as long as the client
        # keeps its window shut, holding the socket and those bytes with it.
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # the client took some: progress, time the next stretch
            self._time_send()
            return
        logger.warning("a client took no response bytes for %g s (client_send_timeout_s): its connection "
                       "is closed, and a request still running on it ends as a disconnect", self._send_timeout_s)
        self._reset()

    @staticmethod
    def _stop(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _reset(self) -> None:
        """Abort the connection with a reset, as nginx's ``reset_timedout_connection``: a close
        would leave the kernel holding the unsent bytes, in FIN-WAIT-1, for as long as the
        client keeps its window shut."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


class _ResumeTold(FlowControl):
    """uvicorn's flow control, telling its protocol each time it resumes reading: where every
    wait of the server's ends (the app's ``receive`` after a ``100 Continue`` or a paused read,
    a response's end before a pipelined request)."""

    def __init__(self, transport: asyncio.Transport, resumed: Callable[[], None]) -> None:
        super().__init__(transport)
        self._resumed = resumed

    def resume_reading(self) -> None:
        super().resume_reading()
        self._resumed()


def with_client_bounds(send_timeout_s: float, receive_timeout_s: float) -> Callable[..., asyncio.Protocol]:
    """uvicorn's ``http`` option for cachetally's own server (a partial, so that it reaches
    ``--workers N`` processes, which uvicorn starts with its config pickled)."""
    return functools.partial(ClientBoundsProtocol, send_timeout_s=send_timeout_s,
                             receive_timeout_s=receive_timeout_s)


def bound_vllms_clients(config: Any, send_timeout_s: float, receive_timeout_s: float) -> bool:
    """Put the bounds in the ``uvicorn.Config`` that vLLM serves with, where it serves with
    uvicorn's own httptools protocol (its ``auto`` choice); ``False`` where it does not."""
    if getattr(config, "http_protocol_class", None) is not HttpToolsProtocol:
        return False
    config.http_protocol_class = with_client_bounds(send_timeout_s, receive_timeout_s)
    return True
