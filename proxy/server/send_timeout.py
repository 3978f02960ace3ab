"""``client_send_timeout_s``: a client that stops taking its response is treated as gone.

nginx's ``send_timeout`` (default 60 s): the bound is on the time between two writes to
the client that make progress, not on the whole response. uvicorn has none: once the
connection's write buffer is full, the app's ``send`` waits in uvicorn's flow control
until the client reads, however long that is. In upstream mode that wait holds an upstream
connection (its read timeout rests while reading is paused for the slow client), so a few
hundred sockets that never read would take the whole pool; in sim mode it holds the
simulated request.

The bound is kept where the waiting is, on the server's side of the connection: while the
transport has paused the app's writes (its buffer above the high-water mark), a timer runs;
when it fires and the client took no byte of that buffer since it was started, the
connection is aborted, a closing one too (its response whole: a close waits for the unsent
bytes, for as long as the client keeps its window shut). uvicorn then sees what it sees when a client leaves
(``connection_lost``): the waiting ``send`` returns, ``receive`` says ``http.disconnect``,
and the request ends as any disconnect does (in upstream mode its exchange is cancelled and
its upstream connection closed, never pooled, so the upstream aborts the request; its usage
record says ``disconnected``). Nothing is cancelled inside uvicorn's ``send``, so no
traceback and no "returned without completing response" line; one warning says it. (A
timeout around the app's ``send`` would do both: the app would return with its response
unfinished, and uvicorn, seeing no disconnect, would log that line and only ``close`` the
transport, which waits for the unsent bytes of a client that takes none.)

Only ``asyncio.Protocol``'s own calls are overridden. vLLM's server (``--engine vllm``,
``vllm serve --middleware``) is vLLM's uvicorn, built before any cachetally code runs: the
middleware puts this protocol in its config at the lifespan's startup
(:func:`bound_vllms_clients`), before uvicorn opens its listener, which reads the protocol
from there. A slow client holds more there: vLLM's engine goes on generating its request.
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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("cachetally.app")


class SendTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (what its ``auto`` picks: httptools is a dependency),
    with a client whose writes make no progress for ``send_timeout_s`` taken for gone."""

    def __init__(self, *args: Any, send_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._send_timeout_s = send_timeout_s
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the timer was started

    def pause_writing(self) -> None:
        super().pause_writing()
        self._time_send()

    def resume_writing(self) -> None:
        # A closing transport (the response whole, keep-alive over or "Connection: close") is
        # never paused again: its timer runs on until the client has taken every byte.
        if not self.transport.is_closing():
            self._stop_timer()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _time_send(self) -> None:
        if self._send_timer is None:  # writes pause only on a connection uvicorn's protocol holds
            self._unsent = self.transport.get_write_buffer_size()
            self._send_timer = asyncio.get_running_loop().call_later(self._send_timeout_s, self._timed_out)

    def _stop_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _timed_out(self) -> None:
        self._send_timer = None  # connection_lost stops it: the transport is still this one's
        client = self.transport
        # A closing one too: close() waits for the unsent bytes, for as long as the client
        # keeps its window shut, holding the socket and those bytes with it.
        unsent = client.get_write_buffer_size()
        if unsent < self._unsent:  # the client took some: progress, time the next stretch
            self._time_send()
            return
        logger.warning("a client took no response bytes for %g s (client_send_timeout_s): its connection "
                       "is closed, and a request still running on it ends as a disconnect", self._send_timeout_s)
        # A reset, as nginx's reset_timedout_connection: a close would leave the kernel holding
        # the unsent megabytes, in FIN-WAIT-1, for as long as the client keeps its window shut.
        sock = client.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.abort()


def with_send_timeout(send_timeout_s: float) -> Callable[..., asyncio.Protocol]:
    """uvicorn's ``http`` option for cachetally's own server (a partial, so that it reaches
    ``--workers N`` processes, which uvicorn starts with its config pickled)."""
    return functools.partial(SendTimeoutProtocol, send_timeout_s=send_timeout_s)


def bound_vllms_clients(config: Any, send_timeout_s: float) -> bool:
    """Put the bound in the ``uvicorn.Config`` that vLLM serves with, where it serves with
    uvicorn's own httptools protocol (its ``auto`` choice); ``False`` where it does not."""
    if getattr(config, "http_protocol_class", None) is not HttpToolsProtocol:
        return False
    config.http_protocol_class = with_send_timeout(send_timeout_s)
    return True
