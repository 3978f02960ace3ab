"""Which headers a reverse proxy passes on, each way (RFC 9110 §7.6.1).

Hop-by-hop headers describe one connection, not the message: ``Connection`` and every
header it names, ``Keep-Alive``, ``TE``, ``Trailer(s)``, ``Transfer-Encoding``,
``Upgrade`` and the ``Proxy-*`` family. They are dropped both ways. Toward the upstream,
``Host`` and ``Content-Length`` go too: the pool writes ``Host`` from the configured URL
and frames the body itself (:func:`declared_length` hands it the client's length for a
streamed body). From the upstream response, ``Date`` and ``Server`` are dropped too,
because uvicorn writes its own (as nginx does).

Headers stay raw ``bytes`` pairs, in order, so repeated headers survive. Nothing here
logs: ``Authorization`` passes through untouched and is never printed, unless the
upstream has a key of its own (``upstream_api_key``) and the client was authenticated
(:class:`~proxy.upstream.engine.UpstreamEngine`): then the client's credentials
(``Authorization``, and the ``x-api-key`` of Anthropic's clients) stay here, and the
upstream gets its key instead, so a tenant's key never reaches it.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.asgi.headers import Headers

HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade"}
)
_REQUEST_ONLY = frozenset({b"host", b"content-length"})
#: With the upstream's own key: the client's credentials stay here too.
_REQUEST_ONLY_AND_CREDENTIALS = _REQUEST_ONLY | {b"authorization", b"x-api-key"}
_RESPONSE_ONLY = frozenset({b"date", b"server"})


def _connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a ``Connection`` header declares hop-by-hop (``Connection: close, X-Foo``)."""
    listed: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b",") if token.strip())
    return listed


def _filter(headers: Headers, also: frozenset[bytes] | set[bytes]) -> Headers:
    drop = HOP_BY_HOP | also | _connection_listed(headers)
    return [
        (name, value)
        for name, value in headers
        if (lower := name.lower()) not in drop and not lower.startswith(b"proxy-")
    ]


def request_headers(headers: Headers, authorization: bytes | None = None) -> Headers:
    """The client's headers as sent upstream: end-to-end ones only, no ``Host``, no framing;
    with ``authorization`` (the upstream's own), that in place of the client's credentials."""
    if authorization is None:
        return _filter(headers, _REQUEST_ONLY)
    return [*_filter(headers, _REQUEST_ONLY_AND_CREDENTIALS), (b"authorization", authorization)]


def declared_length(headers: Headers) -> int | None:
    """The client's ``Content-Length`` (the server in front already refused a bad one), or ``None``."""
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def response_headers(headers: Headers, status: int = 200) -> Headers:
    """The upstream's response headers as sent to the client (``Content-Length`` kept, but
    on a 304: there it may state the length of the unsent representation, RFC 9110 §8.6,
    and the server in front would read it as body bytes owed and fail the connection)."""
    kept = _filter(headers, _RESPONSE_ONLY)
    if status == 304:
        return [(name, value) for name, value in kept if name.lower() != b"content-length"]
    return kept


def keep_alive_timeout(value: bytes) -> float | None:
    """The ``timeout=`` of a ``Keep-Alive`` header (RFC 2068 §19.7.1.1: ``timeout=5, max=100``),
    in seconds; ``None`` when it names none, or none that is a whole number of seconds."""
    for param in value.split(b","):
        name, _, number = param.partition(b"=")
        if name.strip().lower() == b"timeout":
            number = number.strip().strip(b'"')
            return float(number) if number.isdigit() and len(number) <= 9 else None
    return None
