"""Every byte the pool writes upstream, checked: the request head, and a streamed body's length.

The request head is built only from parts that cannot change its meaning (RFC 9112, the
checks h11 makes before it writes):

- the method is a token;
- the target is origin-form: ``/`` then no control character, space or DEL;
- header names are tokens, and not ``Host``, ``Content-Length`` or
  ``Transfer-Encoding``, which the pool writes itself; header values hold no CR, LF or NUL;
- the framing is the pool's own: ``Content-Length`` for a body in hand or a declared length,
  else chunked.

A streamed body is checked against its declared length before its bytes are written:
a part that would run past it is never written, and the part that completes it is held
until the body is known to end there (the next step of the body's iterator), so the
upstream never sees a complete request whose body the client did not send as declared.
Anything that fails here is :data:`~proxy.upstream.client.INVALID` or
:data:`~proxy.upstream.client.BODY_MISMATCH` (400): nothing of it reaches the upstream,
or its connection is dropped.
"""

from __future__ import annotations

import re
from operator import itemgetter

from proxy.asgi.headers import Headers
from proxy.upstream.client import BODY_MISMATCH, INVALID, UpstreamFailure

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_method = re.compile(_TOKEN).fullmatch
_target = re.compile(rb"/[^\x00-\x20\x7f]*").fullmatch
_name = re.compile(rb"(?!(?:host|content-length|transfer-encoding)\Z)" + _TOKEN, re.IGNORECASE).fullmatch

#: Methods whose empty body is still announced (``Content-Length: 0``), as clients do.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def invalid(reason: str) -> UpstreamFailure:
    return UpstreamFailure(INVALID, reason)


#: Methods, targets and header names already found valid (they repeat from request to request).
_valid_methods: dict[str, bytes] = {}
_valid_names: set[bytes] = set()
_valid_targets: set[bytes] = set()
_CACHE_MAX = 4096
_first = itemgetter(0)


def request_head(method: str, target: bytes, host: bytes, headers: Headers, framing: bytes) -> bytes:
    """The request line, ``Host``, ``headers`` and ``framing`` (see :func:`framing_for`), validated.

    ``host`` comes checked from :class:`~proxy.upstream.client.Origin`. Values are checked
    all at once: every other part holds no CR, LF or NUL, so the head holds exactly one
    line end per line unless a value smuggled one in."""
    raw_method = _valid_methods.get(method)
    if raw_method is None:
        raw_method = _check_method(method)
    if target not in _valid_targets:
        _check_target(target)
    if not _valid_names.issuperset(map(_first, headers)):
        _check_names(headers)
    lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (raw_method, target, host)]
    lines += [b"%s: %s\r\n" % pair for pair in headers]
    lines.append(framing)
    head = b"".join(lines)
    # One CR and one LF per line end (request and host lines, one per header, the
    # framing's); anything more, or a NUL, came in a value.
    ends = len(lines) + framing.count(b"\n")
    if len(head) - len(head.translate(None, b"\r\n\x00")) != 2 * ends:
        raise invalid("InvalidHeaderValue")
    return head


def _check_target(target: bytes) -> None:
    if _target(target) is None:
        raise invalid("InvalidTarget")
    if len(_valid_targets) < _CACHE_MAX and len(target) <= 256:  # bounded in memory too
        _valid_targets.add(target)


def _check_method(method: str) -> bytes:
    raw = method.encode("latin-1", "replace")
    if _method(raw) is None:
        raise invalid("InvalidMethod")
    if len(_valid_methods) < _CACHE_MAX:
        _valid_methods[method] = raw
    return raw


def _check_names(headers: Headers) -> None:
    for name, _ in headers:
        if name not in _valid_names:
            if _name(name) is None:
                raise invalid("InvalidHeaderName")
            if len(_valid_names) < _CACHE_MAX:
                _valid_names.add(name)


def framing_for(method: str, body_size: int | None, length: int | None) -> bytes:
    """The head's last lines: for a body in hand (``body_size``), a declared ``length``, or chunked."""
    if body_size is not None:
        if body_size or method in _BODY_METHODS:
            return b"content-length: %d\r\n\r\n" % body_size
        return b"\r\n"
    if length is not None:
        if length < 0:
            raise invalid("InvalidContentLength")
        return b"content-length: %d\r\n\r\n" % length
    return b"transfer-encoding: chunked\r\n\r\n"


class LengthCheck:
    """What of a streamed body with a declared length may be written, part by part."""

    __slots__ = ("held", "left")

    def __init__(self, length: int) -> None:
        self.left = length
        self.held = b""  # the part that completes the length, written once the body ends

    def part(self, chunk: bytes) -> bytes:
        """The bytes to write now for ``chunk``; raises before a byte past the length is written."""
        if self.held or len(chunk) > self.left:
            raise UpstreamFailure(BODY_MISMATCH, "BodyLongerThanContentLength")
        self.left -= len(chunk)
        if self.left == 0:
            self.held = chunk
            return b""
        return chunk

    def end(self) -> bytes:
        """The body ended: the held bytes, or raises when it ended short."""
        if self.left:
            raise UpstreamFailure(BODY_MISMATCH, "BodyShorterThanContentLength")
        return self.held
