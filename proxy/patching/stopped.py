"""A patched request that the server's stop cancels, ended in the API's own error shape.

``cachetally serve`` (sim and upstream engines) waits ``shutdown_timeout_s`` after SIGTERM
for the requests in flight, then uvicorn cancels their tasks (in vLLM's server,
:data:`~proxy.vllm_middleware.REQUESTS_LEFT_S` after vLLM stopped its engine client). Left
to uvicorn, a request whose response had not reached the client gets a plain-text 500 and
a stream is cut off mid-body (an incomplete chunked body, no error). Here the request's own task ends it
instead: a 503 in the route's error JSON while nothing was sent (a JSON body is held to be
patched until it is whole), or one SSE error event that ends a stream already started.
Its usage record is then written as for any failed request (``outcome`` ``error``). The
engine's other routes get the same 503 from :class:`~proxy.asgi.error_guard.ErrorGuard`.
Only uvicorn's cancellation is answered so (:func:`~proxy.asgi.errors.server_stop`).

The answer goes out only if the connection takes it at once. uvicorn does not wait for the
tasks it cancelled: it stops the app (the recorder's final drain) right after. A stream
whose client stopped reading would wait on it forever, and its record, written once the
task ends, would miss that drain; such a stream is cut, as uvicorn cuts it, but with one warning
in the log, not uvicorn's traceback (:func:`~proxy.asgi.errors.cut_by_stop`).
"""

from __future__ import annotations

import asyncio

from proxy.asgi.errors import STOPPED, cut_by_stop, error_sse_event, send_error, stop_answered
from proxy.asgi.paths import route_path
from proxy.patching.responder import Mode, Responder


async def end_stopped(r: Responder, scope: dict) -> None:
    """End the request ``r`` the server's stop cancelled: answered, or cut where it cannot
    be (a body that is neither held nor SSE already went out in part: only a cut connection
    says it is short; or a connection that does not take the answer at once)."""
    answered = True
    try:
        async with asyncio.timeout(0):  # a send that does not wait finishes before it fires
            if not r.started():
                await send_error(r.send, route_path(scope), 503, STOPPED)
            elif r.mode is Mode.SSE and not r.completed:
                # A blank line first ends an event the patcher may hold half of; alone it is no event.
                event = b"\n\n" + error_sse_event(route_path(scope), 503, STOPPED)
                await r.send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                answered = False
    except TimeoutError:
        answered = False
    if answered:
        stop_answered()
    else:
        cut_by_stop(scope)
