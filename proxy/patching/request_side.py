"""One patched request's request side: read the body once, refuse what cannot be metered,
rewrite what this route owns, and replay it to the inner app.

The inner app sees the request key as ``X-Request-Id``, the replayed body's
``Content-Length`` and ``Accept-Encoding: identity`` (its response is parsed and patched);
in upstream mode with ghost usage (:mod:`proxy.patching.ghost`) a stream is asked for the
usage chunk the client did not request.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Message, Receive, Scope

from proxy.asgi.errors import send_error
from proxy.asgi.paths import route_path
from proxy.patching.pd_leg import leg_of
from proxy.patching.request_body import (
    DETAILS_FLAG,
    BodyTooLarge,
    ClientGone,
    editable,
    parse_request,
    read_body,
    replay,
)
from proxy.patching.responder import Responder

#: Request headers replaced before the inner app sees them.
REPLACED_HEADERS = frozenset((b"x-request-id", b"content-length", b"accept-encoding"))
#: Request headers read here and by :func:`proxy.patching.metering.meter`.
READ_HEADERS = frozenset((b"content-length", b"traceparent"))


async def run_patched(r: Responder, scope: Scope, receive: Receive) -> None:
    """Read the request body once, refuse what cannot be metered, rewrite the body and the
    headers this route owns, and run the inner app with ``r`` patching its response.
    ``r.request_headers`` noted :data:`READ_HEADERS` and dropped :data:`REPLACED_HEADERS`."""
    config = r.ctx.config
    headers = r.request_headers
    try:
        body = await read_body(receive, headers.values(b"content-length"), config.max_request_bytes)
    except BodyTooLarge:
        await send_error(r.send, 413, f"Request body exceeds {config.max_request_bytes} bytes")
        return
    except ClientGone:
        r.notes.client_left()
        return
    try:
        payload, r.options = parse_request(body)
    except ValueError as exc:
        await send_error(r.send, 400, str(exc))
        return
    if config.pd_legs:
        r.leg = leg_of(payload)
    if r.options.beam_search:
        # vLLM's beam search runs one engine request per beam per step, each on the prompt
        # plus the tokens so far: the client's prompt is the first, which the response reports.
        r.ctx.ledger.first_event_only(r.key)
    if r.shape is not None and config.refuse_unmetered and (why := r.shape.refusal(payload)):
        r.ctx.metrics.refused_unmetered.labels(route_path(scope)).inc()
        await send_error(r.send, 400, why)
        return
    body = _rewrite(r, payload, body)
    # This route's headers are ours to rewrite: the request key, the length of the body
    # as replayed, and an unencoded response, because it is parsed and patched.
    forwarded = [
        *headers.forwarded,
        (b"x-request-id", r.key.encode()),
        (b"content-length", b"%d" % len(body)),
        (b"accept-encoding", b"identity"),
    ]
    scope, receive = {**scope, "headers": forwarded}, replay(body, _watch(r, receive))
    guard = r.ctx.guard
    if guard is None:
        await r.ctx.app(scope, receive, r.send)
    else:  # r.send rewrites a framework's 404 or 405 itself: one layer less on every message
        await guard.serve(scope, receive, r.send, r.started)


def _watch(r: Responder, receive: Receive) -> Receive:
    async def watched() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect":
            r.notes.client_left()
        return message

    return watched


def _rewrite(r: Responder, payload: dict[str, Any], body: bytes) -> bytes:
    options, config = r.options, r.ctx.config
    assert options is not None
    strip = config.strip_details_flag and DETAILS_FLAG in payload
    ghost = config.ghost_usage and r.shape is None and options.stream and not options.include_usage
    if not (strip or ghost):
        return body
    payload, encode = editable(payload, body, options)
    if strip:
        del payload[DETAILS_FLAG]
    if ghost:
        # continuous_usage_stats only applies with include_usage; keep it off.
        payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
        r.ghost_asked = True
    return encode(payload)
