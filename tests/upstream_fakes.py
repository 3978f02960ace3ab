"""``UpstreamClient`` implementations for tests: scripted failures, and ASGI apps in process.

The real client (``proxy.upstream.pool``) is tested against real sockets; these stand
in where a test needs an upstream to fail at an exact point, or a fake upstream app
without a server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.asgi.headers import Headers
from proxy.upstream.client import Origin, UpstreamFailure


@dataclass
class ScriptedResponse:
    """Yields ``chunks``, then raises ``error`` (or waits until cancelled if ``hang``)."""

    chunks: list[bytes]
    error: UpstreamFailure | None = None
    hang: bool = False
    status: int = 200
    headers: Headers = field(default_factory=list)
    closed: bool = False
    hanging: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        if self.hang:
            self.hanging.set()
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return b""

    def close(self) -> None:
        self.closed = True


@dataclass
class Sent:
    method: str
    url: str  # the origin-form target
    headers: Headers
    body: bytes
    length: int | None  # the declared length of a streamed body


class ScriptedClient:
    """Records each request (its body read whole) and answers with ``respond(request)``."""

    def __init__(self, respond: Callable[[Sent], ScriptedResponse]) -> None:
        self.respond = respond
        self.requests: list[Sent] = []

    async def send(
        self, method: str, target: bytes, headers: Headers, body: bytes | AsyncIterable[bytes],
        length: int | None = None,
    ) -> Any:
        if not isinstance(body, bytes):
            body = b"".join([chunk async for chunk in body])
        self.requests.append(request := Sent(method, target.decode("latin-1"), headers, body, length))
        return self.respond(request)

    def pool_state(self) -> None:
        return None

    async def aclose(self) -> None:
        pass


class _AsgiResponse:
    def __init__(self, response: httpx.Response) -> None:
        self.status, self.headers = response.status_code, response.headers.raw
        self._chunks = response.aiter_raw()

    async def read(self) -> bytes:
        return await anext(self._chunks, b"")

    def close(self) -> None:
        pass  # the body is in memory (httpx.ASGITransport): nothing to release


class AsgiClient:
    """Sends to an ASGI app in process; ``Host`` and framing are added as on the wire."""

    def __init__(self, app: Any, origin: Origin) -> None:
        self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        self._base = ("https://" if origin.tls else "http://") + origin.host_header.decode() + origin.base_path.decode()

    async def send(
        self, method: str, target: bytes, headers: Headers, body: bytes | AsyncIterable[bytes],
        length: int | None = None,
    ) -> Any:
        if length is not None:
            headers = [*headers, (b"content-length", b"%d" % length)]
        request = httpx.Request(method, self._base + target.decode("latin-1"), headers=headers, content=body)
        return _AsgiResponse(await self._http.send(request, stream=True))

    def pool_state(self) -> None:
        return None

    async def aclose(self) -> None:
        await self._http.aclose()

