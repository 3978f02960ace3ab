"""Reading request headers as ASGI hands them: raw ``(name, value)`` byte pairs, in order.

A header that decides something (the credential, the tenant, the request id, the trace
context) is taken only when the client sent it exactly once: with two copies, the
layers a request passes through (a gateway, vLLM, this proxy) could each read another.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Headers = list[tuple[bytes, bytes]]


def only_header(headers: Iterable[tuple[bytes, bytes]], lower_name: bytes) -> bytes | None:
    """The value of the one header named ``lower_name`` (compared case-insensitively);
    ``None`` when it is absent or repeated."""
    values = [value for name, value in headers if name.lower() == lower_name]
    return values[0] if len(values) == 1 else None


def without(headers: Headers, lower_name: bytes) -> Headers:
    """``headers`` minus every header named ``lower_name`` (compared case-insensitively)."""
    return [(name, value) for name, value in headers if name.lower() != lower_name]


class RequestHeaders:
    """A request's headers, read in one pass (names compared case-insensitively).

    The middleware decides by a few headers (request id, tenant or credential, trace
    context, declared length) and forwards the rest: one pass notes the values of the
    headers named in ``noted`` and keeps, in order, every header not named in ``dropped``
    (the ones the proxy replaces; each of them is among ``noted`` too), instead of one scan
    of every header per decision.
    Asking for a header that was not noted is a ``KeyError``, never a silent "absent".
    """

    __slots__ = ("_names", "_found", "forwarded")

    def __init__(
        self, headers: Iterable[tuple[bytes, bytes]], noted: frozenset[bytes], dropped: frozenset[bytes] = frozenset()
    ) -> None:
        found: dict[bytes, list[bytes]] = {}
        forwarded: Headers = []
        for pair in headers:
            name = pair[0].lower()
            if name in noted:
                if name in found:
                    found[name].append(pair[1])
                else:
                    found[name] = [pair[1]]
                if name in dropped:
                    continue
            forwarded.append(pair)
        self._names = noted
        self._found = found
        #: The request's headers without those named in ``dropped``, in order.
        self.forwarded = forwarded

    def values(self, lower_name: bytes) -> Sequence[bytes]:
        """Every value of the headers named ``lower_name``, in order."""
        if lower_name not in self._names:
            raise KeyError(f"{lower_name!r} was not noted")
        return self._found.get(lower_name, ())

    def only(self, lower_name: bytes) -> bytes | None:
        """The value of the one header named ``lower_name``; ``None`` when absent or repeated."""
        if lower_name not in self._names:
            raise KeyError(f"{lower_name!r} was not noted")
        values = self._found.get(lower_name)
        return values[0] if values is not None and len(values) == 1 else None
