"""One patched request's request side: read the body once, refuse what cannot be metered,
rewrite what this route owns, and replay it to the inner app.

The inner app sees the request key as ``X-Request-Id``, the replayed body's
``Content-Length`` and ``Accept-Encoding: identity`` (its response is parsed and patched);
in upstream mode with ghost usage (:mod:`proxy.patching.ghost`) a stream, and in every mode
a streamed beam search, is asked for the usage chunk the client did not request.

A client cannot choose its own count: a chat or completions body loses vLLM's per-request
``stream_interval`` (a cut stream is counted in chunks), and in upstream mode without
``pd_legs`` its ``kv_transfer_params`` (vLLM reports a ``remote_prefill_cached_tokens``
claim as cache reads). While billing is on, a beam search over several prompts is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Message, Receive, Scope

from proxy.asgi.errors import send_error, server_stop, stop_answered
from proxy.asgi.paths import route_path
from proxy.patching.body_budget import BodyBudgetFull, Hold
from proxy.patching.oversized_leg import member_of
from proxy.patching.pd_leg import DECODE, handed, leg_of
from proxy.patching.request_body import (
    DETAILS_FLAG,
    BodyTooLarge,
    ClientGone,
    editable,
    parse_request,
    read_body,
    replay,
    several_prompts,
)
from proxy.patching.responder import Responder
from proxy.patching.stopped import end_stopped

INTERVAL = "stream_interval"
TRANSFER = "kv_transfer_params"
#: The routes whose cut streams have their prompt counted by the upstream (upstream mode).
COUNTED = frozenset(("chat", "completions", "responses", "invocations"))

#: A body that does not fit in what the process may still hold (proxy.patching.body_budget).
BODIES_FULL = "The server is receiving as many request bodies as it may hold; retry"
RETRY_AFTER = [(b"retry-after", b"1")]

#: Request headers replaced before the inner app sees them.
REPLACED_HEADERS = frozenset((b"x-request-id", b"content-length", b"accept-encoding"))
#: Request headers read here and by :func:`proxy.patching.metering.meter`.
READ_HEADERS = frozenset((b"content-length", b"traceparent"))


async def run_patched(r: Responder, scope: Scope, receive: Receive) -> None:
    """Read the request body once, refuse what cannot be metered, rewrite the body and the
    headers this route owns, and run the inner app with ``r`` patching its response.
    ``r.request_headers`` noted :data:`READ_HEADERS` and dropped :data:`REPLACED_HEADERS`."""
    # One try around it all, not a coroutine of its own: a body still coming when the drain
    # ends is answered too, not only the inner app (the server's stop: proxy.patching.stopped).
    hold = Hold(r.ctx.bodies)
    try:
        config = r.ctx.config
        headers = r.request_headers
        try:
            body = await read_body(receive, headers.values(b"content-length"), config.max_request_bytes, hold)
        except BodyTooLarge as too_large:
            if config.pd_legs and not await _read_oversized_leg(r, scope, too_large, receive, hold):
                return
            await send_error(r.send, route_path(scope), 413, f"Request body exceeds {config.max_request_bytes} bytes")
            return
        except BodyBudgetFull:
            await _refuse_full(r, scope)
            return
        except ClientGone:
            r.notes.client_left()
            return
        try:
            payload, r.options = parse_request(body, stream_options=r.shape is None)
        except ValueError as exc:
            await send_error(r.send, route_path(scope), 400, str(exc))
            return
        if config.pd_legs:
            r.leg = leg_of(payload)
            r.handed = handed(payload) if r.leg == DECODE else None
        # use_beam_search is a chat and completions field: the Responses and Messages models drop it.
        beam_search = r.shape is None and r.options.beam_search
        if beam_search:
            # vLLM's beam search runs one engine request per beam per step, each on the prompt
            # plus the tokens so far: the client's prompt is the first, which the response reports.
            r.ctx.ledger.first_event_only(r.key)
        if config.refuse_unmetered and (why := _refusal(r, payload, beam_search)):
            r.ctx.metrics.refused_unmetered.labels(route_path(scope)).inc()
            await send_error(r.send, route_path(scope), 400, why)
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
        scope, receive = {**scope, "headers": forwarded}, replay(body, _watch(r, receive), hold.release)
        # The inner app gets the body from replay and keeps its own: not held here for its whole
        # run, but where a stream cut before its usage chunk would have its prompt counted from it.
        kept = body if r.ctx.count_prompt is not None and r.options.stream and r.route in COUNTED else None
        del body, payload
        guard = r.ctx.guard
        if guard is None:
            await r.ctx.app(scope, receive, r.send)
        else:  # r.send rewrites a framework's 404 or 405 itself: one layer less on every message
            await guard.serve(scope, receive, r.send, r.started)
        if kept is not None and r.leg is None and _cut_before_usage(r):
            await _count_prompt(r, kept, scope)
    except asyncio.CancelledError as cancelled:
        if not server_stop(cancelled):
            raise
        await end_stopped(r, scope)
    finally:
        hold.release()
        if r.held is not None:
            r.held.release()


async def _refuse_full(r: Responder, scope: Scope) -> None:
    """503 for a body that does not fit in what the process may still hold, counted."""
    r.ctx.bodies.refused()
    r.ctx.metrics.bodies_refused.inc()
    await send_error(r.send, route_path(scope), 503, BODIES_FULL, RETRY_AFTER)


async def _read_oversized_leg(
    r: Responder, scope: Scope, too_large: BodyTooLarge, receive: Receive, hold: Hold
) -> bool:
    """The leg of a body refused as too large, and a decode leg's handed figures, so that a
    decode leg the router made larger than its prefill leg still bills its prefill
    (:mod:`proxy.patching.oversized_leg`). ``False`` if the client left before the end, or
    what the leg keeps did not fit in the process's budget (answered 503)."""
    try:
        params = await member_of(too_large.head, too_large.more, receive, TRANSFER,
                                 r.ctx.config.max_request_bytes, hold)
    except ClientGone:
        r.notes.client_left()
        return False
    except BodyBudgetFull:
        await _refuse_full(r, scope)
        return False
    r.leg = leg_of(params)
    r.handed = handed(params) if r.leg == DECODE else None
    return True


def _refusal(r: Responder, payload: dict[str, Any], beam_search: bool) -> str | None:
    """Why billing cannot meter this body, or ``None``."""
    if r.shape is not None:
        return r.shape.refusal(payload)
    if beam_search and several_prompts(payload.get("prompt")):
        # One search per prompt, their steps interleaved: no event says which is a prompt.
        return "use_beam_search with several prompts is not metered on this server; send one prompt per request"
    return None


def _cut_before_usage(r: Responder) -> bool:
    """A stream the upstream started, whose client left before its usage chunk."""
    return r.status == 200 and r.notes.disconnected and not r.notes.errored and r.in_response.prompt_tokens is None


async def _count_prompt(r: Responder, body: bytes, scope: Scope) -> None:
    """The prompt of ``r``'s body as the upstream counts it (:mod:`proxy.upstream.prompt_count`).
    The server's stop ends the ask: the client is gone, nothing to answer, the prompt unknown."""
    assert r.ctx.count_prompt is not None
    try:
        r.counted_prompt = await r.ctx.count_prompt(r.route, body, scope)
    except asyncio.CancelledError as cancelled:
        if not server_stop(cancelled):
            raise
        stop_answered()


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
    # A streamed beam search asks for it everywhere: its answer comes from no generate() call
    # the engine tap sees, so only vLLM's usage chunk counts the tokens of every beam.
    ghost = (config.ghost_usage or options.beam_search) and r.shape is None and options.stream
    ghost = ghost and not options.include_usage
    # vLLM's per-request stream_interval puts that many tokens in one chunk, and a stream cut
    # before its usage chunk is counted in chunks: the client would choose its own count.
    interval = r.shape is None and INTERVAL in payload
    # A claim of the prefill instance's cache hits that the upstream would report as its own.
    transfer = config.drop_kv_transfer_params and TRANSFER in payload
    if not (strip or ghost or interval or transfer):
        return body
    payload, encode = editable(payload, body, options)
    if strip:
        del payload[DETAILS_FLAG]
    if interval:
        del payload[INTERVAL]
    if transfer:
        del payload[TRANSFER]
    if ghost:
        # The client's other options stay (OpenAI's include_obfuscation shapes its stream).
        # continuous_usage_stats only applies with include_usage; keep it off.
        asked = payload.get("stream_options") or {}  # null or an object: a stream vLLM serves
        payload["stream_options"] = {**asked, "include_usage": True, "continuous_usage_stats": False}
        r.ghost_asked = True
    return encode(payload)
