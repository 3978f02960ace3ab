"""A whole response in two ASGI messages: the head, with its type and length, then the body."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Send


async def send_body(
    send: Send, status: int, body: bytes, content_type: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
