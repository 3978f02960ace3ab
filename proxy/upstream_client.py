"""What upstream mode needs from an HTTP client: the seam between ``Forward`` and the pool.

``proxy.upstream_forward`` speaks only these few calls, in raw ``bytes`` headers, so the
hot path builds no request or response objects of a general-purpose client library. The
one implementation is :mod:`proxy.upstream_http1`; tests script failures at exact
points with their own implementations.

Every failure a client reports is an :class:`UpstreamFailure` carrying the answer the
client of cachetally gets (OpenAI error JSON): no connection, or one that broke -> 502; a
timeout -> 504; every pooled connection busy past the connect timeout -> 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Protocol

from proxy.hop_headers import Headers

UNREACHABLE = 502, "Upstream server unreachable or connection lost"
TIMED_OUT = 504, "Upstream server timed out"
POOL_FULL = 503, "Upstream connection pool exhausted"


class UpstreamFailure(Exception):
    """The upstream could not be reached or failed mid-exchange.

    ``status`` and ``message`` are what the client is told (they never contain the
    upstream URL); ``reason`` names the underlying error for the log.
    """

    def __init__(self, answer: tuple[int, str], reason: str) -> None:
        super().__init__(f"{answer[1]} ({reason})")
        self.status, self.message = answer
        self.reason = reason


class UpstreamResponse(Protocol):
    status: int
    #: Raw header pairs, in the upstream's order.
    headers: Headers

    async def read(self) -> bytes:
        """The next chunk of the body as it arrives, undecoded; ``b""`` at its end.

        Raises :class:`UpstreamFailure`."""
        ...

    def close(self) -> None:
        """Return the connection to the pool if the body was read to its end, else drop it
        (so the upstream sees the client's disconnect). Synchronous, so that no
        cancellation can interrupt it halfway."""
        ...


class UpstreamClient(Protocol):
    def target(self, url: str) -> object:
        """``url`` (as the client sent it: no re-quoting) parsed for :meth:`send`."""
        ...

    async def send(
        self, method: str, target: object, headers: Headers, body: bytes | AsyncIterable[bytes]
    ) -> UpstreamResponse:
        """Send the request and wait for the response head. Adds only ``Host`` and body
        framing to ``headers``. Raises :class:`UpstreamFailure`."""
        ...

    def pool_state(self) -> tuple[int, int, int, int] | None:
        """(open, idle, checked out, queued) connections, when the pool exposes them."""
        ...

    async def aclose(self) -> None: ...
