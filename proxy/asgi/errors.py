"""Errors in the OpenAI error JSON shape, as vLLM's own server writes them."""

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
    so the client sees it short. Let through, the cancellation was logged with a traceback."""
    logger.warning("the server's stop cut a response on %s that could not be ended with an error: its "
                   "client was not taking it, or part of its body had gone out", logged_path(scope))
    stop_answered()


class ErrorAnswer(Exception):
    """An engine app's failure that says how the client is to be told of it, when nothing
    of the response has reached the client yet (:class:`proxy.asgi.error_guard.ErrorGuard`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def error_body(status: int, message: str) -> bytes:
    error_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    )


def error_sse_event(status: int, message: str) -> bytes:
    """The same error as one SSE event, for a stream that already started. Named ``error``:
    the ``anthropic`` SDK skips an unnamed event (a cut stream would read as whole), and the
    ``openai`` SDK raises on the ``error`` object whatever the name."""
    return b"event: error\ndata: " + error_body(status, message) + b"\n\n"


def anthropic_error_sse_event(message: str) -> bytes:
    """The same error in a Messages stream, as Anthropic and vLLM write it: a named ``error``
    event (the ``anthropic`` SDK raises on it; an unnamed event it skips in silence)."""
    return b"event: error\ndata: " + orjson.dumps(
        {"type": "error", "error": {"type": "api_error", "message": message}}
    ) + b"\n\n"


def stream_error_event(path: str, status: int, message: str) -> bytes:
    """The error event for a stream on ``path`` that already started: a Messages stream's
    own shape on ``/v1/messages`` (its clients read named events only), else OpenAI's."""
    if path == "/v1/messages":
        return anthropic_error_sse_event(message)
    return error_sse_event(status, message)


async def send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_body(send, status, error_body(status, message), b"application/json", headers or ())
