"""The upstream connection pool: one ``aiohttp.ClientSession`` (one ``TCPConnector``).

Chosen by measurement over httpx, the owner's choice (docs/PERFORMANCE.md): httpcore's
pool scans every connection and every waiting request on each acquire and release
(encode/httpx#3215), so its cost per request grows with the number of open connections;
aiohttp's connector does not, and parses with its C parser. It is used directly, behind
the few calls of :mod:`proxy.upstream_client`, not behind httpx's transport interface:
httpx's request and response objects cost about as much CPU per request as aiohttp
itself.

What is sent and relayed:

- the body comes as the upstream sent it (``auto_decompress`` off); redirects are not
  followed; ``trust_env`` is off (a reverse proxy must not route its upstream calls
  through ``HTTP(S)_PROXY`` or add ``.netrc`` credentials); cookies are neither stored
  nor sent (``DummyCookieJar``: a shared jar would leak one client's cookies into
  another's requests);
- no default headers are added beyond ``Host`` and the body framing
  (``Content-Length`` or chunked): aiohttp's automatic ``Accept``, ``Accept-Encoding``,
  ``User-Agent`` and ``Content-Type`` are skipped;
- the request target is used as given (``encoded=True``: no re-quoting of the path).

Failures become :class:`~proxy.upstream_client.UpstreamFailure`: no connection or a
broken one -> 502, connect or read timeout -> 504, or 503 when the timeout was spent
waiting for a pooled connection because every one was checked out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable

import aiohttp
from yarl import URL

from proxy.hop_headers import Headers
from proxy.upstream_client import POOL_FULL, TIMED_OUT, UNREACHABLE, UpstreamFailure

#: Headers aiohttp would add on its own; the client's own (forwarded) win, or none.
_SKIP_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


def _text(value: bytes) -> str:
    # aiohttp writes header strings as UTF-8: decode so that valid UTF-8 round-trips
    # byte for byte (latin-1 would double-encode it).
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def failure(exc: BaseException) -> UpstreamFailure:
    """The failure a client of cachetally is answered with, for an aiohttp error."""
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one
        return UpstreamFailure(TIMED_OUT, type(exc).__name__)
    return UpstreamFailure(UNREACHABLE, type(exc).__name__)


class AiohttpResponse:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Headers = list(response.raw_headers)

    async def read(self) -> bytes:
        try:
            return await self._response.content.readany()
        except _ERRORS as exc:
            raise failure(exc) from exc

    def close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpClient:
    """Implements ``UpstreamClient``; create it in the event loop that will use it."""

    def __init__(
        self, *, max_connections: int, keepalive_s: float, connect_timeout_s: float, read_timeout_s: float
    ) -> None:
        self.max_connections = max_connections
        # ``connect`` bounds the wait for a pooled connection plus the connect itself.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=0, keepalive_timeout=keepalive_s, use_dns_cache=True
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO,
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def target(self, url: str) -> URL:
        return URL(url, encoded=True)

    def _all_checked_out(self) -> bool:
        acquired = getattr(self._session.connector, "_acquired", ())
        return 0 < self.max_connections <= len(acquired)

    async def send(
        self, method: str, target: object, headers: Headers, body: bytes | AsyncIterable[bytes]
    ) -> AiohttpResponse:
        full = self._all_checked_out()
        try:
            response = await self._session.request(
                method,
                target,  # type: ignore[arg-type]  # a URL from target()
                headers=[(_text(name), _text(value)) for name, value in headers],
                data=body or None,
                allow_redirects=False,
                compress=None,
                timeout=self._timeout,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamFailure(POOL_FULL if full else TIMED_OUT, type(exc).__name__) from exc
        except _ERRORS as exc:
            raise failure(exc) from exc
        return AiohttpResponse(response)

    def pool_state(self) -> tuple[int, int, int, int] | None:
        connector = self._session.connector
        try:
            idle = sum(len(conns) for conns in connector._conns.values())  # type: ignore[union-attr]
            checked_out = len(connector._acquired)  # type: ignore[union-attr]
            queued = sum(len(waiters) for waiters in connector._waiters.values())  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            return None
        return idle + checked_out, idle, checked_out, queued

    async def aclose(self) -> None:
        await self._session.close()
