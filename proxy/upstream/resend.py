"""When the pool may send a request a second time: the idle-close race, and nothing else.

An upstream closes a keep-alive connection when it has been idle for its timeout; a
request written on it at that moment gets no answer. What the common clients do:
httpx (httpcore) checks that an idle connection has not become readable (closed) before
reusing it, and never resends; urllib3 resends a sent request only for the methods of
``Retry.allowed_methods``, idempotent ones by default; aiohttp resends once on a reused
connection, idempotent methods only (its ``IDEMPOTENT_METHODS``, the set used here).
RFC 9112 §9.3.1 forbids a proxy to retry a non-idempotent request automatically unless it
knows the request was never applied. (A closed idle connection is never reused here: the
event loop tells the connection at once, and nothing is awaited between taking one and
writing on it.)

So: a request is resent once when it was written in full, in hand (so it can be written
again as it was), on a connection reused from idle, which then closed before one byte of
response. An idempotent one always; a POST only when the connection was reset: the
upstream's kernel discarded request bytes no process read, so it cannot have acted on it.
A clean close does not say so (an upstream that read a POST and then died looks the same)
and stays a 502. The pool's keep-alive limit, under the upstream's own, keeps that case rare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.upstream.client import UNREACHABLE, UpstreamFailure
from proxy.upstream.connection import DONE

if TYPE_CHECKING:
    from proxy.upstream.connection import Connection


def may_resend(method: str, in_hand: bool, conn: Connection, failure: UpstreamFailure) -> bool:
    """The request the pool just failed on ``conn`` may be sent once more (see the module)."""
    if not (in_hand and conn.exchanges > 1 and conn.ours is DONE and not conn.heard):
        return False
    if failure.status != UNREACHABLE[0]:
        return False
    return method in _IDEMPOTENT or failure.reason in _RESET


_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_RESET = frozenset({"ConnectionResetError", "BrokenPipeError"})
