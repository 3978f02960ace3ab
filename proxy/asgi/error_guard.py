"""The engine app's failures in the route's error JSON (:mod:`proxy.asgi.errors`: OpenAI's,
Anthropic's on the Messages API), whatever framework wrote them.

Used in front of every engine app: vLLM's (FastAPI), the sim (Starlette) and an upstream's
patched routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from http import HTTPStatus

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.asgi.errors import STOPPED, ErrorAnswer, cut_by_stop, send_error, server_stop, stop_answered
from proxy.asgi.paths import logged_path, route_path

logger = logging.getLogger("cachetally.app")


class ErrorGuard:
    """The engine app's failures in the route's error JSON.

    - An exception before any of the response reached the client becomes a 500 (or what
      an :class:`~proxy.asgi.errors.ErrorAnswer` says); a response start held to be
      rewritten has not reached it.
    - A 404 or 405 that is not already an error JSON is re-written as one, with the same
      status and headers (``Allow`` stays). Frameworks answer unknown routes and methods
      in their own shape: FastAPI (vLLM's app) ``{"detail": "Not Found"}``, Starlette
      (the sim) plain text. Only those two statuses are held; every other response
      passes through untouched. ``only_paths``: rewrite on these paths alone (upstream
      mode: a drop-in proxy passes an upstream's other routes through byte for byte).
    - A request the server's stop cancels before its response started gets a 503 (the
      patched routes: :mod:`proxy.patching.stopped`).
    """

    def __init__(self, app: ASGIApp, only_paths: Collection[str] | None = None) -> None:
        self.app = app
        self.only_paths = only_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rewrite = self.rewrites(scope.get("path", ""))
        started = dropping = False
        held: Message | None = None
        chunks: list[bytes] = []
        size = 0

        async def guarded_send(message: Message) -> None:
            nonlocal started, held, dropping, size
            kind = message["type"]
            if kind == "http.response.start":
                if rewrite and message["status"] in REWRITTEN:
                    held = message
                    return
                started = True
            elif held is not None and kind == "http.response.body":
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if more and size <= HELD_ERROR_BYTES:
                    return
                start, held, started, dropping = held, None, True, more
                # Past the bound the rewrite is made from no body (the status's phrase), and
                # the rest of it is dropped as it comes.
                await send_rewritten(send, route_path(scope), start, b"" if more else b"".join(chunks))
                chunks.clear()
                return
            elif dropping and kind == "http.response.body":
                return
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:
            await self._failed(exc, scope, send, started)
        except asyncio.CancelledError as cancelled:  # the server's stop: see proxy.asgi.errors.STOPPED
            if not server_stop(cancelled):
                raise
            if started:
                cut_by_stop(scope)
                return
            await send_error(send, route_path(scope), 503, STOPPED)
            stop_answered()

    def rewrites(self, path: str) -> bool:
        """Whether a 404 or 405 on ``path`` is rewritten as an error JSON."""
        return self.only_paths is None or path in self.only_paths

    async def serve(self, scope: Scope, receive: Receive, send: Send, started: Callable[[], bool]) -> None:
        """Run the engine app for a caller whose ``send`` rewrites a 404 or 405 itself with
        :func:`send_rewritten` (the usage responder, which sees every message anyway): only
        an exception is answered here, as in ``__call__``. ``started``: whether a response
        start has reached the client (one the caller holds has not)."""
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            await self._failed(exc, scope, send, started())

    @staticmethod
    async def _failed(exc: Exception, scope: Scope, send: Send, started: bool) -> None:
        if started and isinstance(exc, ErrorAnswer):
            # A failure the engine app logged (an upstream dead mid-body), after the start went
            # out: nothing can tell the client now. The response is left unfinished, and uvicorn
            # closes the connection without the body's end, so the client sees it short, as at
            # a stop (proxy.asgi.errors.cut_by_stop); let through, it was logged with a traceback.
            return
        # The type only: an exception's text may quote the request.
        logger.error("engine app failed on %s: %s", logged_path(scope), type(exc).__name__)
        if started:
            raise exc
        if isinstance(exc, ErrorAnswer):
            await send_error(send, route_path(scope), exc.status, exc.message)
        else:
            await send_error(send, route_path(scope), 500, "Internal server error")


#: The statuses frameworks answer in their own shape, rewritten as the route's error JSON.
REWRITTEN = frozenset((404, 405))
#: The most of such a body held before its rewrite is given up. A framework's is a few
#: bytes (``{"detail": "Not Found"}``) and an error JSON a few hundred; held without a bound,
#: an inner app's or an upstream's endless error page was held for as long as it came. A
#: metered route's are bounded by the response budget instead (proxy.patching.held_error).
HELD_ERROR_BYTES = 64 << 10
_FRAMEWORK_HEADERS = frozenset((b"content-type", b"content-length"))


async def send_rewritten(send: Send, path: str, start: Message, body: bytes) -> None:
    """Send a held 404/405 on the route ``path`` as its error JSON, unless it already is an error.

    The message is a framework's ``{"detail": str}`` where there is one, else the status
    phrase (Starlette's plain-text "Not Found"); other headers (``Allow``) are kept.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        await send(start)
        await send({"type": "http.response.body", "body": body})
        return
    status = start["status"]
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    message = detail if isinstance(detail, str) else HTTPStatus(status).phrase
    kept = [(k, v) for k, v in start.get("headers", []) if k.lower() not in _FRAMEWORK_HEADERS]
    await send_error(send, path, status, message, kept)
