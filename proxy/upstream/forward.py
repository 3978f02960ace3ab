"""One request forwarded upstream and its response streamed back (``UpstreamEngine``'s app).

The exchange runs in the request's own task: send the request (the body streamed as
``receive`` yields it, by the pool's upload task, so that an early answer such as a 401
or 413 is relayed while the upload is still under way), relay the response chunk by chunk as it arrives, and close the
upstream response in ``finally`` on success, error and disconnect alike. Beside it, one
watcher task waits, once the request body is consumed, for ``http.disconnect`` and then
cancels the exchange. A client that goes away therefore closes the upstream connection
at once, so the engine sees the disconnect and aborts; without the watcher a ``send``
after a disconnect is silently dropped (ASGI 2.3) and the stream would be read to its
end. Closing a response is synchronous (:class:`~proxy.upstream.client.UpstreamResponse`),
so a cancellation can never land halfway through it and leave a connection checked out.

Failures: no connection or a broken one before the headers -> 502, a timeout -> 504, a
full connection pool -> 503, all in the route's error JSON. After the headers went out, an SSE
stream gets one SSE error event and ends; any other body is cut off by raising (the
server then drops the connection) rather than ended cleanly, so a truncated body is never
mistaken for a complete one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from proxy.asgi.errors import ErrorAnswer, error_sse_event, send_error
from proxy.asgi.headers import Headers
from proxy.asgi.paths import logged_path, route_path
from proxy.upstream.client import UpstreamClient, UpstreamFailure, UpstreamResponse
from proxy.upstream.hop_headers import declared_length, request_headers, response_headers

logger = logging.getLogger("cachetally.upstream")

_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")


class UpstreamBodyError(ErrorAnswer):
    """The upstream failed after the response started, and the body is not SSE: a 502 if
    the client has not had the start yet (a JSON body is held to be patched)."""


class _ClientGone(Exception):
    """The client disconnected while its request body was being forwarded."""


def is_sse(headers: Headers) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream") for name, value in headers)


class Forward:
    __slots__ = ("authorization", "body_done", "client", "gone", "receive", "scope", "send", "target")

    def __init__(self, client: UpstreamClient, target: bytes, scope: Scope, receive: Receive, send: Send,
                 authorization: bytes | None = None) -> None:
        """``authorization``: the upstream's own credential, sent in place of the client's."""
        self.client, self.target, self.authorization = client, target, authorization
        self.scope, self.receive, self.send = scope, receive, send
        self.body_done = asyncio.Event()
        self.gone = False  # the client disconnected

    async def run(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch_disconnect(task))
        try:
            await self._exchange()
        except asyncio.CancelledError:
            # Our own cancellation (the watcher saw the client leave) ends the request
            # quietly; any other (server shutdown) goes on.
            if self.gone and task.uncancel() == 0:
                return
            raise
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, exchange: asyncio.Task[object]) -> None:
        await self.body_done.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        exchange.cancel()

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
        scope = self.scope
        headers = request_headers(scope["headers"], self.authorization)
        try:
            if streamed:
                length = declared_length(scope["headers"])
                response = await self.client.send(
                    scope["method"], self.target, headers, self._stream_body(body), length
                )
            else:
                response = await self.client.send(scope["method"], self.target, headers, body)
        except _ClientGone:
            return
        except UpstreamFailure as exc:
            if self.gone:
                return
            logger.warning("upstream %s %s: %s -> %d", scope["method"], logged_path(scope), exc.reason, exc.status)
            await send_error(self.send, route_path(scope), exc.status, exc.message)
            return
        try:
            await self._relay(response)
        finally:
            response.close()

    async def _stream_body(self, first: bytes) -> AsyncIterator[bytes]:
        if first:
            yield first
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                raise _ClientGone
            more = message.get("more_body", False)
            if not more:
                self.body_done.set()
            if chunk := message.get("body", b""):
                yield chunk
            if not more:
                return

    async def _relay(self, response: UpstreamResponse) -> None:
        send, read = self.send, response.read
        await send({"type": "http.response.start", "status": response.status,
                    "headers": response_headers(response.headers, response.status)})
        tail = b"\n\n"
        try:
            while chunk := await read():
                tail = (tail + chunk[-4:])[-4:]  # never copy the whole chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamFailure as exc:
            if self.gone:  # the client left mid-upload after an early answer: nobody to tell
                return
            scope = self.scope
            logger.warning("upstream %s %s failed mid-response: %s", scope["method"], logged_path(scope), exc.reason)
            if not is_sse(response.headers):
                raise UpstreamBodyError(502, exc.message) from None
            # Close a half-sent event first, so the error event is parsed on its own.
            prefix = b"" if tail.endswith(_EVENT_ENDS) else b"\n\n"
            event = prefix + error_sse_event(route_path(scope), exc.status, exc.message)
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
