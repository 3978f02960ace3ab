"""Reading request headers as ASGI hands them: raw ``(name, value)`` byte pairs, in order.

A header that decides something (the credential, the tenant, the request id, the trace
context) is taken only when the client sent it exactly once: with two copies, the
layers a request passes through (a gateway, vLLM, this proxy) could each read another.
"""

from __future__ import annotations

from collections.abc import Iterable


def header_values(headers: Iterable[tuple[bytes, bytes]], lower_name: bytes) -> list[bytes]:
    """Every value of the headers named ``lower_name`` (compared case-insensitively), in order."""
    return [value for name, value in headers if name.lower() == lower_name]


def only_header(headers: Iterable[tuple[bytes, bytes]], lower_name: bytes) -> bytes | None:
    """The value of the one header named ``lower_name``; ``None`` when it is absent or repeated."""
    values = header_values(headers, lower_name)
    return values[0] if len(values) == 1 else None


def without(headers: list[tuple[bytes, bytes]], lower_name: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` minus every header named ``lower_name`` (compared case-insensitively)."""
    return [(name, value) for name, value in headers if name.lower() != lower_name]
