"""An aiohttp connection pool behind httpx's transport interface, for ``UpstreamEngine``.

httpx stays the interface (requests, responses, exceptions, ``aiter_raw``), so
``proxy.upstream_forward`` and the tests' injected transports are unchanged; only the
connections and HTTP/1.1 parsing are aiohttp's. httpcore's pool scans every connection
and every waiting request on each acquire and release (encode/httpx#3215), so its cost
per request grows with the number of open connections; aiohttp's connector does not, and
parses with its C parser. The numbers that chose it are in docs/PERFORMANCE.md.

What is sent and relayed:

- the body comes as the upstream sent it (``auto_decompress`` off: ``aiter_raw``
  semantics); redirects are not followed; ``trust_env`` is off; cookies are neither
  stored nor sent (``DummyCookieJar``: a shared jar would leak one client's cookies
  into another's requests);
- no default headers are added beyond ``Host`` and the body framing
  (``Content-Length`` or chunked): aiohttp's automatic ``Accept``, ``Accept-Encoding``,
  ``User-Agent`` and ``Content-Type`` are skipped;
- the request target is used as given (``encoded=True``: no re-quoting of the path).

Errors become the httpx exceptions ``proxy.upstream_forward.failure`` maps: no
connection -> ``ConnectError`` (502), broken before or during the response ->
``RemoteProtocolError`` (502), read timeout -> ``ReadTimeout`` (504), connect timeout ->
``ConnectTimeout`` (504), or ``PoolTimeout`` (503) when every connection was checked out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx
from yarl import URL

#: Headers aiohttp would add on its own; the client's own (forwarded) win, or none.
_SKIP_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
#: Framing headers httpx adds; aiohttp frames the body itself.
_FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding"})
_URL_CACHE_SIZE = 1024


def _text(value: bytes) -> str:
    # aiohttp writes header strings as UTF-8: decode so that valid UTF-8 round-trips
    # byte for byte (latin-1 would double-encode it).
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One ``aiohttp.ClientSession`` (one ``TCPConnector``) sized like ``limits``."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def open(self) -> None:
        """Create the session; call from the event loop that will use it."""
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._limits.max_connections or 0,
                limit_per_host=0,
                keepalive_timeout=self._limits.keepalive_expiry or 15.0,
                use_dns_cache=True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=_SKIP_AUTO,
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )

    def pool_state(self) -> tuple[int, int, int, int] | None:
        """(open, idle, checked out, queued) from the connector, or None if it has no such state."""
        session = self._session
        connector = session.connector if session is not None else None
        try:
            idle = sum(len(conns) for conns in connector._conns.values())  # type: ignore[union-attr]
            checked_out = len(connector._acquired)  # type: ignore[union-attr]
            queued = sum(len(waiters) for waiters in connector._waiters.values())  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            return None
        return idle + checked_out, idle, checked_out, queued

    def _url(self, url: httpx.URL) -> URL:
        text = str(url)
        parsed = self._urls.get(text)
        if parsed is None:
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            parsed = self._urls[text] = URL(text, encoded=True)
        return parsed

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._session is None:
            self.open()
        session = self._session
        assert session is not None
        connector = session.connector
        timeout = request.extensions.get("timeout", {})
        whole = isinstance(request.stream, httpx.ByteStream)
        headers = [
            (_text(name), _text(value))
            for name, value in request.headers.raw
            # A streamed body keeps the client's Content-Length (aiohttp then sends it as is).
            if (lower := name.lower()) not in _FRAMING or (lower == b"content-length" and not whole)
        ]
        body_error: list[BaseException] = []
        data = (request.content or None) if whole else _body(request, body_error)
        full = connector is not None and 0 < connector.limit <= len(getattr(connector, "_acquired", ()))
        try:
            response = await session.request(
                request.method,
                self._url(request.url),
                headers=headers,
                data=data,
                allow_redirects=False,
                compress=None,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeout.get("pool"),
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        except aiohttp.ConnectionTimeoutError as exc:
            error: type[httpx.TransportError] = httpx.PoolTimeout if full else httpx.ConnectTimeout
            raise error(str(exc), request=request) from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if body_error:  # the request body's own failure (the client left), not the upstream's
                raise body_error[0] from None
            raise _mapped(exc, request) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request),
            request=request,
        )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _mapped(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one
        return httpx.ReadTimeout(str(exc), request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc), request=request)
    return httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request)


async def _body(request: httpx.Request, error: list[BaseException]) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream:  # type: ignore[union-attr]
            yield chunk
    except Exception as exc:
        error.append(exc)
        raise


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _mapped(exc, self._request) from exc

    async def aclose(self) -> None:
        # Synchronous on purpose: nothing here can be interrupted by a cancellation. A
        # body read to its end returns the connection to the pool; an unfinished one
        # closes it, so the upstream sees the disconnect.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()
