"""What the pool, a connection and a response need of each other, and nothing more.

The pool owns connections, a connection feeds one response at a time, and a response
hands its connection back to the pool when the client is done with it. Each side sees
the others only through these protocols, so the three modules import none of each other
in a circle: :mod:`proxy.upstream.pool` builds both concrete types, the other two know
only these.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from proxy.asgi.headers import Headers
from proxy.upstream.client import UpstreamFailure


class ConnectionOwner(Protocol):
    """The pool, as a connection and its response see it."""

    loop: asyncio.AbstractEventLoop

    def forget(self, conn: ExchangeConnection) -> None:
        """``conn`` closed (by either side): it leaves the pool and frees its place."""

    def finish(self, conn: ExchangeConnection) -> None:
        """The exchange on ``conn`` ended: the pool reuses or closes it."""


class ResponseSink(Protocol):
    """One exchange's response, as the connection feeds it."""

    headers: Headers
    last_read: float

    def request_written(self) -> None: ...

    def on_head(self, status: int) -> None: ...

    def on_body(self, body: bytes) -> None: ...

    def on_complete(self) -> None: ...

    def fail(self, error: UpstreamFailure) -> None: ...

    def delimited_by_close(self) -> bool: ...


class ExchangeConnection(Protocol):
    """A connection, as its response and the pool's owner calls see it."""

    pool: ConnectionOwner
    reading_paused: bool

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def their_error(self, error: UpstreamFailure) -> None: ...

    def abort(self, reason: str) -> None: ...

    def abandon(self, reason: str) -> None: ...
