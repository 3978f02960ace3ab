"""Read, check and (rarely) rewrite the JSON body of a chat or completions request.

The middleware needs a few request options (``stream``, ``stream_options``, ``model``,
``return_cached_tokens_details``) and answers malformed or oversized bodies itself, so
every mode (embedded, upstream, sim) gives the same clear error.

The options the engine acts on are read as the engine reads them: vLLM's request models
are pydantic models in lax mode, so ``"stream": "true"``, ``1`` or ``"on"`` is a stream
there and must be one here (:func:`lax_bool`, held against pydantic's own parsing in
tests/patching/test_request_body.py). A body whose options pydantic would reject is answered 400
by the engine, so it is neither a stream nor rewritten here: ``valid`` is False. A body over the limit
is refused from its ``Content-Length`` before any of it is read, or as soon as the bytes
read pass the limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Message, Receive

DETAILS_FLAG = "return_cached_tokens_details"


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, declared_lengths: Iterable[bytes], limit: int) -> bytes:
    """The whole body; ``BodyTooLarge`` before reading any of it when a ``Content-Length``
    (``declared_lengths``: every value the client sent) says it would be."""
    for value in declared_lengths:
        if value.isdigit() and int(value) > limit:
            raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


@dataclass(slots=True)
class RequestOptions:
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    want_details: bool
    #: The engine's request model accepts ``stream`` and ``stream_options`` as sent.
    valid: bool = True


_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_bool(value: object) -> bool:
    """A JSON value read as pydantic's lax ``bool`` reads it; ``ValueError`` where it refuses.

    ``true``/``false``; the numbers 0 and 1; and, in any case, the strings 0/1, f/t,
    false/true, n/y, no/yes, off/on. Nothing else (no blanks around them, no ``null``).
    """
    if value is True or value is False:
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.isascii():
        lower = value.lower()
        if lower in _TRUE:
            return True
        if lower in _FALSE:
            return False
    raise ValueError("not a boolean")


def optional_bool(value: object) -> bool:
    """An ``Optional[bool]`` field: ``null`` (or absent) reads as false."""
    return False if value is None else lax_bool(value)


def stream_options_of(payload: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``(stream, include_usage, continuous_usage)`` as vLLM reads them; ``ValueError`` for a
    body it answers 400 (a field it cannot parse, or options without a stream).

    vLLM checks the raw body before parsing it: options that are truthy as JSON with a
    ``stream`` that is not are refused, whatever the strings say.
    """
    stream = optional_bool(payload.get("stream"))
    options = payload.get("stream_options")
    if options and not payload.get("stream"):
        raise ValueError("stream options without stream")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise ValueError("stream_options is not an object")
    include = optional_bool(options.get("include_usage"))
    continuous = optional_bool(options.get("continuous_usage_stats"))
    return stream, include, include and continuous


def parse_request(body: bytes) -> tuple[dict[str, Any], RequestOptions]:
    """Raises ``ValueError`` with a client-facing message for a body that is no JSON object."""
    payload = _json_object(body)
    try:
        stream, include_usage, continuous_usage = stream_options_of(payload)
        valid = True
    except ValueError:
        stream = include_usage = continuous_usage = valid = False
    model = payload.get("model")
    return payload, RequestOptions(
        model=model if isinstance(model, str) else None,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        want_details=payload.get(DETAILS_FLAG) is True,
        valid=valid,
    )


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"Request body is not valid JSON: {exc.msg}") from None
    if isinstance(payload, dict):
        return payload
    raise ValueError("Request body must be a JSON object")


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
