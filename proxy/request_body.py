"""Read, check and (rarely) rewrite the JSON body of a chat or completions request.

The middleware needs a few request options (``stream``, ``stream_options``, ``model``,
``return_cached_tokens_details``) and answers malformed or oversized bodies itself, so
every mode (embedded, upstream, sim) gives the same clear error. A body over the limit
is refused from its ``Content-Length`` before any of it is read, or as soon as the bytes
read pass the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from engine_adapter.engine import Message, Receive

DETAILS_FLAG = "return_cached_tokens_details"


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    for name, value in headers:
        if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
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


def parse_request(body: bytes) -> tuple[dict[str, Any], RequestOptions]:
    """Raises ``ValueError`` with a client-facing message for a body that is no JSON object."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"Request body is not valid JSON: {exc.msg}") from None
    if not isinstance(payload, dict):
        raise ValueError("Request body must be a JSON object")
    stream_options = payload.get("stream_options")
    if not isinstance(stream_options, dict):
        stream_options = {}
    model = payload.get("model")
    return payload, RequestOptions(
        model=model if isinstance(model, str) else None,
        stream=payload.get("stream") is True,
        include_usage=stream_options.get("include_usage") is True,
        continuous_usage=stream_options.get("continuous_usage_stats") is True,
        want_details=payload.get(DETAILS_FLAG) is True,
    )


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
