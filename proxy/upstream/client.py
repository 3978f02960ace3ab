"""What upstream mode needs from an HTTP client: the seam between ``Forward`` and the pool.

``proxy.upstream.forward`` speaks only these few calls, in raw ``bytes`` headers, so the
hot path builds no request or response objects of a general-purpose client library. The
one implementation is :class:`proxy.upstream.pool.Http1Pool`; tests script failures at
exact points with their own implementations.

The upstream URL is parsed once, into an :class:`Origin`, when the engine is built; each
request then names only its origin-form target (path and query, as the client sent them).

Every failure a client reports is an :class:`UpstreamFailure` carrying the answer the
client of cachetally gets (the route's error JSON, :mod:`proxy.asgi.errors`): a request that cannot be written as valid
HTTP/1.1 -> 400; no connection, or one that broke -> 502; a timeout -> 504; every
connection busy past the connect timeout -> 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from proxy.asgi.headers import Headers
from proxy.server.logs import redacted

INVALID = 400, "The request cannot be forwarded upstream as valid HTTP/1.1"
BODY_MISMATCH = 400, "The request body does not match its Content-Length"
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
        #: Set by the pool when the request may be sent once more (it cannot have been acted on).
        self.resendable = False


@dataclass(frozen=True, slots=True)
class Origin:
    """The configured upstream URL, parsed once: where to connect, and what every target starts with."""

    host: str
    port: int
    tls: bool
    host_header: bytes
    base_path: bytes  # the URL's path without its trailing "/", prefixed to every target

    @classmethod
    def parse(cls, url: str) -> Origin:
        """Raises ``ValueError`` for anything but ``http(s)://HOST[:PORT][/PATH]``; its
        message shows the URL :func:`redacted`."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {redacted(url)!r}")
        # An "@" after a "/" is not userinfo to urlsplit: "http://user:2024/pw@host" is host "user",
        # port 2024 and a path holding the password, which the ready line would show.
        if parts.username is not None or "@" in url or parts.query or parts.fragment:
            raise ValueError(f"the upstream URL takes no user, query or fragment: {redacted(url)!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)  # .port raises ValueError when out of range
        base = parts.path.rstrip("/")
        if any(ch in base + parts.netloc for ch in " \t\r\n\x00"):
            raise ValueError(f"the upstream URL holds whitespace or a control character: {redacted(url)!r}")
        return cls(parts.hostname, port, tls, parts.netloc.encode("idna"), base.encode("latin-1"))


class UpstreamResponse(Protocol):
    status: int
    #: Raw header pairs, in the upstream's order.
    headers: Headers

    async def read(self) -> bytes:
        """The next chunk of the body as it arrives, undecoded; ``b""`` at its end.

        Raises :class:`UpstreamFailure`."""
        ...

    def close(self) -> None:
        """Return the connection to the pool if both sides of the exchange are done, else
        drop it (so the upstream sees the client's disconnect). Synchronous, so that no
        cancellation can interrupt it halfway."""
        ...


class UpstreamClient(Protocol):
    async def send(
        self, method: str, target: bytes, headers: Headers, body: bytes | AsyncIterable[bytes],
        length: int | None = None,
    ) -> UpstreamResponse:
        """Send the request and wait for the response head.

        ``target`` is origin-form (``/path?query``). ``headers`` hold no ``Host`` and no
        framing: the client adds ``Host`` and frames the body, by its size when it is
        ``bytes``, else by ``length`` (the client's declared ``Content-Length``) or chunked.
        Raises :class:`UpstreamFailure`; an exception raised by a streamed ``body`` is
        raised as is, once the upstream connection has been dropped."""
        ...

    def pool_state(self) -> tuple[int, int, int, int] | None:
        """(open, idle, checked out, queued) connections, when the pool exposes them."""
        ...

    async def aclose(self) -> None: ...
