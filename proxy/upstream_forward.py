"""One request forwarded upstream and its response streamed back (``UpstreamEngine``'s app).

Per request, two tasks race in one anyio task group:

- the exchange: send the request (body streamed as ``receive`` yields it), relay the
  response chunk by chunk (``aiter_raw``), and close the upstream response in ``finally``,
  shielded from cancellation, on success, error and disconnect alike;
- the watcher: once the request body is consumed, wait for ``http.disconnect``.

Whichever ends first cancels the other. A client that goes away therefore closes the
upstream connection at once, so the engine sees the disconnect and aborts; without the
watcher a ``send`` after a disconnect is silently dropped (ASGI 2.3) and the stream would
be read to its end.

Failures: no connection or a broken one before the headers -> 502, a timeout -> 504, a
full connection pool -> 503, all in OpenAI error JSON. After the headers went out, an SSE
stream gets one SSE error event and ends; any other body is cut off by raising (the
server then drops the connection) rather than ended cleanly, so a truncated body is never
mistaken for a complete one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import anyio
import httpx

from engine_adapter.engine import Receive, Scope, Send
from proxy.errors import error_sse_event, send_error
from proxy.hop_headers import request_headers, response_headers

logger = logging.getLogger("cachetally.upstream")

_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")


class UpstreamBodyError(Exception):
    """The upstream failed after the response started, and the body is not SSE."""


class _ClientGone(Exception):
    """The client disconnected while its request body was being forwarded."""


def failure(exc: httpx.TransportError) -> tuple[int, str]:
    """The status and client-facing message for an upstream failure (no upstream URL)."""
    if isinstance(exc, httpx.PoolTimeout):
        return 503, "Upstream connection pool exhausted"
    if isinstance(exc, httpx.TimeoutException):
        return 504, "Upstream server timed out"
    return 502, "Upstream server unreachable or connection lost"


async def aclose_shielded(response: httpx.Response) -> None:
    """``response.aclose()`` run to completion even if the request is being cancelled."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


class Forward:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url: httpx.URL | str,
        timeout: dict[str, float | None],
        identity: bool,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.client, self.url, self.timeout, self.identity = client, url, timeout, identity
        self.scope, self.receive, self.send = scope, receive, send
        self.body_done = asyncio.Event()

    async def run(self) -> None:
        # An anyio task group, not bare asyncio tasks: httpcore guards its close path with
        # anyio shielded scopes, which stop anyio's cancellation but not a raw
        # Task.cancel(). Cancelled natively mid-close, a response stayed checked out of the
        # pool for good (about 1.5% of client drops in the disconnect soak).
        error: Exception | None = None
        async with anyio.create_task_group() as tasks:

            async def exchange() -> None:
                nonlocal error
                try:
                    await self._exchange()
                except Exception as exc:  # re-raised below, outside the task group
                    error = exc
                finally:
                    tasks.cancel_scope.cancel()

            async def watch() -> None:
                await self._watch_disconnect()
                tasks.cancel_scope.cancel()

            tasks.start_soon(exchange)
            tasks.start_soon(watch)
        if error is not None:
            raise error

    async def _watch_disconnect(self) -> None:
        await self.body_done.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass

    async def _exchange(self) -> None:
        # Up to the first non-empty chunk: a body that ends there is sent whole, with its
        # length; only a longer one is streamed (chunked unless the client gave a length).
        while True:
            first = await self.receive()
            if first["type"] == "http.disconnect":
                return
            body: bytes = first.get("body", b"")
            streamed = bool(first.get("more_body", False))
            if body or not streamed:
                break
        if not streamed:
            self.body_done.set()
        # Not client.build_request: that would add the client's default headers (Accept,
        # Accept-Encoding: gzip, User-Agent) to what the client sent.
        request = httpx.Request(
            self.scope["method"],
            self.url,
            headers=request_headers(self.scope["headers"], identity=self.identity, keep_length=streamed),
            content=self._stream_body(body) if streamed else body,
            extensions={"timeout": self.timeout},
        )
        try:
            response = await self.client.send(request, stream=True)
        except _ClientGone:
            return
        except httpx.TransportError as exc:
            status, message = failure(exc)
            logger.warning(
                "upstream %s %s: %s -> %d", request.method, request.url.path, type(exc).__name__, status
            )
            await send_error(self.send, status, message)
            return
        try:
            await self._relay(response)
        finally:
            await aclose_shielded(response)

    async def _stream_body(self, first: bytes) -> AsyncIterator[bytes]:
        if first:
            yield first
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            more = message.get("more_body", False)
            if not more:
                self.body_done.set()
            if chunk := message.get("body", b""):
                yield chunk
            if not more:
                return

    async def _relay(self, response: httpx.Response) -> None:
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        await self.send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": response_headers(response.headers.raw),
            }
        )
        tail = b"\n\n"
        try:
            async for chunk in response.aiter_raw():
                if chunk:
                    tail = (tail + chunk[-4:])[-4:]  # never copy the whole chunk
                    await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            status, message = failure(exc)
            request = response.request
            logger.warning(
                "upstream %s %s failed mid-response: %s", request.method, request.url.path, type(exc).__name__
            )
            if not sse:
                raise UpstreamBodyError(message) from None
            # Close a half-sent event first, so the error event is parsed on its own.
            prefix = b"" if tail.endswith(_EVENT_ENDS) else b"\n\n"
            event = prefix + error_sse_event(status, message)
            await self.send({"type": "http.response.body", "body": event, "more_body": False})
            return
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
