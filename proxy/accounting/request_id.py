"""Request ids: read the client's, validate it, mint one when absent or invalid.

The client's id is echoed back; the ledger key must also be unique among open requests,
so when two in-flight requests carry the same id the later one gets a suffixed key. The
key (not the raw header) is what reaches engines and upstreams, so a response id like
``chatcmpl-<key>`` and engine logs trace back to the HTTP request, and it is the
``request_id`` of the usage record, which billing pipelines join and deduplicate on.

With several processes behind one port (``--workers N``, vLLM's ``--api-server-count N``)
each has its own ledger, so "in flight" must span them all. Rather than ask the others
(shared state that can fail: a full disk, no file descriptors left, a directory a tmp
cleaner removed, and I/O that blocks the event loop), each process makes the keys it gives
out its own: a client's id gets the process's tag (:func:`process_tag`, ``.p<pid>``) as
its last component, and the pids of live processes differ, so two processes never hold
the same key, and one process's ledger decides the rest. Nothing can fail and no I/O is
done. Minted keys need no tag: 128 random bits. The echoed ``X-Request-Id`` stays the
client's.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from proxy.asgi.headers import RequestHeaders

_MAX_KEY = 128
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def is_valid_request_id(value: str) -> bool:
    """At most 128 characters of ``[A-Za-z0-9._:-]``: safe to echo and to log."""
    return _VALID.fullmatch(value) is not None


def mint_request_id() -> str:
    """32 random hex digits (as ``uuid4().hex``, at a quarter of its cost)."""
    return os.urandom(16).hex()


@dataclass(frozen=True, slots=True)
class RequestIds:
    header: str = "x-request-id"
    generate: Callable[[], str] = mint_request_id
    validate: Callable[[str], bool] = is_valid_request_id

    def __post_init__(self) -> None:
        if self.header != self.header.lower():
            raise ValueError(f"the request id header is named in lower case, not {self.header!r}")

    def from_headers(self, headers: RequestHeaders) -> str | None:
        """The client's id if it sent exactly one valid one, else ``None`` (``headers``
        noted :attr:`header`)."""
        found = headers.only(self.header.encode("latin-1"))
        if found is None:
            return None
        try:
            value = found.decode("ascii")
        except UnicodeDecodeError:
            return None
        return value if self.validate(value) else None

    def unique_key(self, client_id: str | None, take: Callable[[str], bool], tag: str = "") -> str:
        """The ledger key: the client's id (then ``tag``, the process's own, with several
        processes) if ``take`` gets it, else one with a random suffix before ``tag`` that
        it gets. At most 128 characters."""
        if client_id is None:
            base, tag = self.generate(), ""
        else:
            base = client_id
        key = base[: _MAX_KEY - len(tag)] + tag
        while not take(key):
            suffix = f".{secrets.token_hex(4)}{tag}"
            key = base[: _MAX_KEY - len(suffix)] + suffix
        return key


def process_tag() -> str:
    """This process's last key component: ``.p<pid>``, unique among the live processes of a host."""
    return f".p{os.getpid()}"
