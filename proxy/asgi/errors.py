"""The errors cachetally answers itself, in the shape the route's clients read: vLLM's own.

OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) everywhere but on
the Messages API (``/v1/messages`` and the routes under it: ``count_tokens``), where vLLM
answers in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``) and the
``anthropic`` SDK reads ``error.type`` and ``error.message`` from it. The HTTP status is the
same in both; the ``type`` there is Anthropic's name for it (:data:`_ANTHROPIC_TYPES`), not
the OpenAI name vLLM leaves in its own (``translate_error_response``): a client that reads
the type gets Anthropic's vocabulary, whoever refused.
"""

from __future__ import annotations

import asyncio
import logging

from http import HTTPStatus

import orjson

from starlette.types import Send

from proxy.asgi.paths import logged_path
from proxy.asgi.replies import send_body

logger = logging.getLogger("cachetally.app")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

#: The Messages API: its routes answer errors in Anthropic's shape.
_MESSAGES = "/v1/messages"
#: Anthropic's error types by status, as its API documents them (413 ``request_too_large``,
#: 529 ``overloaded_error``) and its SDK names them (504 ``timeout_error``). A 503 says
#: "try again later" as Anthropic's overload does. Any other 4xx is ``invalid_request_error``
#: (Anthropic's own rule), any other 5xx ``api_error``.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


#: What the client of a request the server's stop ended is told (a 503: another instance
#: may serve it). uvicorn cancels the requests still running ``shutdown_timeout_s`` after
#: SIGTERM; left to it, one whose response had not started gets a plain-text 500.
STOPPED = "The server stopped before the request finished; retry it"
#: The message uvicorn cancels those requests with (``uvicorn.Server.shutdown``).
UVICORN_STOP = "Task cancelled, timeout graceful shutdown exceeded"


def server_stop(cancelled: BaseException) -> bool:
    """Whether ``cancelled`` is the server's stop, which :data:`STOPPED` answers. Any other
    cancellation (a caller's own, an outer ``asyncio.timeout``) is not the request's to
    answer: swallowed, it would tell a live client the server stopped, and its caller that
    nothing was cancelled (an outer timeout would never raise)."""
    return cancelled.args == (UVICORN_STOP,)


def stop_answered() -> None:
    """The current task answered the server's stop itself: its cancellation is spent, and
    the task ends as any request that was answered."""
    task = asyncio.current_task()
    assert task is not None
    task.uncancel()


def cut_by_stop(scope: dict) -> None:
    """The server's stop cut the current task's response, which could not be told of it (its
    client was not taking it, or part of a body that is not SSE had gone out): the task ends
    with the response unfinished, and uvicorn closes the connection without the body's end,
    so the client sees it short; uvicorn logs its own line for that ("ASGI callable returned
    without completing response."). Let through, the cancellation was logged with a traceback."""
    logger.warning("the server's stop cut a response on %s that could not be ended with an error: its "
                   "client was not taking it, or part of its body had gone out", logged_path(scope))
    stop_answered()


class ErrorAnswer(Exception):
    """An engine app's failure that says how the client is to be told of it, when nothing
    of the response has reached the client yet (:class:`proxy.asgi.error_guard.ErrorGuard`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _messages_route(path: str) -> bool:
    """Whether the route ``path`` (:func:`~proxy.asgi.paths.route_path`) is the Messages API's."""
    return path == _MESSAGES or path.startswith(_MESSAGES + "/")


def error_body(path: str, status: int, message: str) -> bytes:
    """The error for a request to the route ``path``, in the shape its clients read; ``""``
    where no route is known yet (a request head refused before it was routed)."""
    if _messages_route(path):
        error_type = _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
        return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})
    error_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    )


def error_sse_event(path: str, status: int, message: str) -> bytes:
    """The same error as one SSE event, for a stream that already started. Named ``error``,
    as Anthropic and vLLM name a Messages stream's: the ``anthropic`` SDK skips an unnamed
    event (a cut stream would read as whole), and the ``openai`` SDK raises on the ``error``
    object whatever the name."""
    return b"event: error\ndata: " + error_body(path, status, message) + b"\n\n"


async def send_error(
    send: Send, path: str, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer a request to the route ``path`` with an error (:func:`error_body`)."""
    await send_body(send, status, error_body(path, status, message), b"application/json", headers or ())
