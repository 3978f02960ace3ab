"""One patched request's state: the ``send`` state machine behind ``UsagePatchMiddleware``.

Built per request by :class:`~proxy.patching.middleware.UsagePatchMiddleware`, which holds only
configuration. The responder reads the request body once (size-capped), rewrites it only
when it must, replays it to the inner app, patches the response (a JSON body held and
re-measured; an SSE stream passed on as it comes, usage events rewritten) and, from the
middleware's ``finally``, counts the request once and hands its usage record
(:mod:`proxy.accounting.records.record`) to the recorder; what the record needs beyond the counted
figures is noted on the way by :class:`~proxy.accounting.records.notes.RequestNotes`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING, Any

import orjson
from engine_adapter.engine import Message, Receive, Scope, Send
from proxy.asgi.errors import send_error
from proxy.patching.ghost import GhostHold
from proxy.patching.ledger import SlotUsage
from proxy.accounting.metrics import RequestRecord
from proxy.patching.pd_leg import DECODE, PREFILL, Leg, leg_of
from proxy.accounting.records.notes import RequestNotes
from proxy.patching.request_body import (
    DETAILS_FLAG,
    BodyTooLarge,
    ClientGone,
    RequestOptions,
    parse_request,
    read_body,
    replay,
)
from proxy.patching.shapes import shape_for
from proxy.patching.sse import SSEPatcher
from proxy.patching.usage import Observation, UsagePatch

if TYPE_CHECKING:
    from proxy.patching.middleware import UsagePatchMiddleware
    from proxy.accounting.records.record import UsageRecord

#: The response's own ``"model"`` field, read from the first SSE bytes of a stream whose
#: usage chunk never comes (the client did not ask for it), so it is labelled like the rest.
#: Inside a JSON string a quote is escaped, so this only matches a real key.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_MODEL_SNIFF_CHUNKS = 4
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
#: Request headers the responder replaces before the inner app sees them.
_REWRITTEN = (b"x-request-id", b"content-length", b"accept-encoding")


Headers = list[tuple[bytes, bytes]]


def without(headers: Headers, lower_name: bytes) -> Headers:
    """``headers`` minus every ``lower_name`` header (case-insensitive)."""
    return [(name, value) for name, value in headers if name.lower() != lower_name]


class _Mode(Enum):
    PASS = 0
    JSON = 1
    SSE = 2


class Responder:
    def __init__(
        self, mw: UsagePatchMiddleware, route: str, key: str, echo: str, send: Send, tenant: str = "default"
    ) -> None:
        self.mw = mw
        self.route = route
        self.key = key
        self.echo = echo
        self.tenant = tenant
        self.notes = RequestNotes(route)
        self.shape = shape_for(route)  # None: the OpenAI shape (proxy.patching.usage)
        self._headers: Headers = []
        self._send = send
        self.options: RequestOptions | None = None
        self.leg: Leg | None = None  # a disaggregated prefill/decode leg (proxy.patching.pd_leg)
        self.seen = Observation()
        self.mode = _Mode.PASS
        self.stream = False
        self.ghost = False
        self.completed = False  # a 200 response went out in full
        self._sniff_chunks = _MODEL_SNIFF_CHUNKS
        self.status: int | None = None
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._sse: SSEPatcher | None = None
        self._hold: GhostHold | None = None

    async def run(self, scope: Scope, receive: Receive) -> None:
        config = self.mw.config
        self._headers = scope["headers"]
        try:
            body = await read_body(receive, scope["headers"], config.max_request_bytes)
        except BodyTooLarge:
            await send_error(self.send, 413, f"Request body exceeds {config.max_request_bytes} bytes")
            return
        except ClientGone:
            self.notes.client_left()
            return
        try:
            payload, self.options = parse_request(body)
        except ValueError as exc:
            await send_error(self.send, 400, str(exc))
            return
        if config.pd_legs:
            self.leg = leg_of(payload)
        if self.shape is not None and config.refuse_unmetered and (why := self.shape.refusal(payload)):
            self.mw.metrics.refused_unmetered.labels(scope["path"]).inc()
            await send_error(self.send, 400, why)
            return
        body = self._rewrite(payload, body)
        # This route's headers are ours to rewrite: the request key, the length of the body
        # as replayed, and an unencoded response, because it is parsed and patched.
        headers = [
            (name, value)
            for name, value in scope["headers"]
            if name.lower() not in _REWRITTEN
        ]
        headers += [
            (b"x-request-id", self.key.encode()),
            (b"content-length", b"%d" % len(body)),
            (b"accept-encoding", b"identity"),
        ]
        await self.mw.app({**scope, "headers": headers}, replay(body, self._watch(receive)), self.send)

    def _watch(self, receive: Receive) -> Receive:
        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.notes.client_left()
            return message

        return watched

    def _rewrite(self, payload: dict[str, Any], body: bytes) -> bytes:
        options, config = self.options, self.mw.config
        assert options is not None
        changed = False
        if config.strip_details_flag and DETAILS_FLAG in payload:
            del payload[DETAILS_FLAG]
            changed = True
        if config.ghost_usage and self.shape is None and options.stream and not options.include_usage:
            # continuous_usage_stats only applies with include_usage; keep it off.
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
            self.ghost = changed = True
        return orjson.dumps(payload) if changed else body

    # -- response side -------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body":
            await self._on_body(message)
        else:
            await self._send(message)

    async def _on_start(self, message: Message) -> None:
        echo_header = self.mw.echo_header
        content_type, encoded = b"", False
        headers: Headers = []
        for name, value in message["headers"]:
            lower = name.lower()
            if lower == echo_header:
                continue
            if lower == b"content-type":
                content_type = value
            elif lower == b"content-encoding":
                encoded = True
            headers.append((name, value))
        headers.append((echo_header, self.echo.encode("latin-1")))
        message = {**message, "headers": headers}
        self.status = message["status"]
        if message["status"] != 200 or self.options is None:
            self.mode = _Mode.PASS
        elif encoded:
            self._skip("encoded")
        elif content_type.startswith(b"text/event-stream"):
            self.mode, self.stream = _Mode.SSE, True
            if self.ghost:
                self._hold = GhostHold()
            message["headers"] = without(headers, b"content-length")
            self._sse = SSEPatcher(
                self._patch_event,
                max_event_bytes=self.mw.config.max_event_bytes,
                on_oversize=lambda: self._count_skip("event_too_large"),
            )
        elif content_type.startswith(b"application/json"):
            self.mode = _Mode.JSON
            self._start = message
            return  # held until the body is complete
        else:
            self._skip("content_type")
        await self._send(message)

    async def _on_body(self, message: Message) -> None:
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if not more:
            self.completed = self.options is not None and self.status == 200
        self.notes.body(body, more)
        if self.mode is _Mode.SSE:
            assert self._sse is not None
            if self.seen.model is None and self._sniff_chunks and body:
                self._sniff_chunks -= 1
                self.notes.sniff_id(body)
                if match := _MODEL_FIELD.search(body):
                    self.seen.model = match.group(1).decode("utf-8", "replace")
            out = self._sse.feed(body) if body else b""
            if not more:
                out += self._sse.flush()
            if out:
                self.notes.sse_events(out)
            if self._hold is not None:
                out = self._hold.filter(out)
                if not more:
                    out += self._hold.release()
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})
        elif self.mode is _Mode.JSON:
            self._chunks.append(body)
            self._size += len(body)
            if not more:
                await self._send_json(b"".join(self._chunks))
            elif self._size > self.mw.config.max_response_bytes:
                self._count_skip("body_too_large")
                self.mode = _Mode.PASS
                await self._send(self._take_start())
                await self._send({"type": "http.response.body", "body": b"".join(self._chunks), "more_body": True})
                self._chunks.clear()
        else:
            await self._send(message)

    async def _send_json(self, body: bytes) -> None:
        start = self._take_start()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            self._count_skip("malformed")
        else:
            self.notes.whole_usage(payload)
            if self._patch(payload) is not None:
                body = orjson.dumps(payload)
                start["headers"] = [
                    *without(start["headers"], b"content-length"),
                    (b"content-length", b"%d" % len(body)),
                ]
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _take_start(self) -> Message:
        start, self._start = self._start, None
        assert start is not None
        return start

    def _patch(self, payload: dict[str, Any]) -> bool | None:
        if self.shape is not None:
            return self._patch_shape(payload)
        options = self.options
        assert options is not None
        return UsagePatch(
            engine=self.mw.ledger.usage(self.key),
            missing=self.mw.config.missing,
            details=options.want_details,
        ).apply(payload, self.seen)

    def _patch_shape(self, payload: dict[str, Any]) -> bool | None:
        assert self.shape is not None
        changed, whole = self.shape.patch(payload, self.mw.ledger.usage(self.key), self.mw.config.missing, self.seen)
        if whole is not None and self.mode is _Mode.SSE:
            self.notes.whole_usage(whole)  # a JSON body's usage was noted as it arrived
        return changed

    def _patch_event(self, payload: dict[str, Any]) -> bool | None:
        if self.shape is not None:
            return self._patch_shape(payload)
        if payload.get("choices") == [] and isinstance(payload.get("usage"), dict):
            # A ghost usage chunk never reaches the client, so it is not among the counted events.
            self.notes.whole_usage(payload, event=self._hold is None)
        if self._hold is not None and payload.get("usage") is not None and payload.get("choices") == []:
            self._patch(payload)  # observe it for the metrics, then drop it
            self._hold.usage_dropped(payload)
            return False
        options = self.options
        assert options is not None
        if options.want_details and payload.get("choices"):
            # Tier details belong to the final usage chunk only, not continuous ones.
            return UsagePatch(self.mw.ledger.usage(self.key), self.mw.config.missing).apply(
                payload, self.seen
            )
        return self._patch(payload)

    def _skip(self, reason: str) -> None:
        self.mode = _Mode.PASS
        self._count_skip(reason)

    def _count_skip(self, reason: str) -> None:
        self.mw.metrics.patch_skipped.labels(reason).inc()

    # -- accounting ----------------------------------------------------------------------

    def finish(self, engine: SlotUsage | None) -> None:
        """Count this request once and submit its usage record. Synchronous: runs in the
        middleware's ``finally``. A prefill leg is counted as a leg only (:mod:`proxy.patching.pd_leg`)."""
        if self.leg == PREFILL:
            self.mw.metrics.legs.count(PREFILL, self.notes.outcome(self.status), engine)
            return
        seen = self.seen
        # A model the engine serves, never a name a client made up: labels must stay bounded.
        model = self.mw.config.models.label(seen.model) if seen.model else self.mw.config.default_model
        completion, completion_source = self.notes.completion(self.stream)
        record = RequestRecord(
            model=model,
            route=self.route,
            stream=self.stream,
            mismatches=seen.mismatches,
            tenant=self.tenant,
            completion_tokens=completion,
        )
        if engine is not None:
            record.prompt_tokens, record.cached_tokens, record.source = (
                engine.prompt_tokens,
                engine.cached_tokens,
                "engine",
            )
            record.local_cached_tokens = engine.local_cached_tokens
            record.external_cached_tokens = engine.external_cached_tokens
            record.cache_write_tokens = engine.cache_creation_tokens
        elif seen.source == "upstream":
            record.prompt_tokens, record.cached_tokens, record.source = (
                seen.prompt_tokens,
                seen.cached_tokens,
                "upstream",
            )
        else:
            record.prompt_tokens = seen.prompt_tokens
        if engine is None and seen.prompt_tokens is None and not self.completed:
            # Rejected (4xx), failed or abandoned before the engine saw it: not a counted
            # request, but the tokens it streamed still count, as its usage record does.
            self.mw.metrics.count_completion(record)
        else:
            self.mw.metrics.record(record)
        if self.leg == DECODE:
            self.mw.metrics.legs.count(DECODE, self.notes.outcome(self.status), engine)
        recorder = self.mw.recorder
        if recorder is not None:
            recorder.submit(self._usage_record(record, engine, completion_source))

    def _usage_record(self, rec: RequestRecord, engine: SlotUsage | None, completion_source: str) -> UsageRecord:
        options = self.options
        return self.notes.record(
            request_id=self.key,
            tenant=self.tenant,
            route=self.route,
            stream=self.stream if options is None else options.stream,
            model=rec.model,
            request_model=options.model if options is not None else None,
            status=self.status,
            outcome=self.notes.outcome(self.status),
            prompt_tokens=rec.prompt_tokens,
            cached_tokens=rec.cached_tokens,
            local_cached_tokens=rec.local_cached_tokens,
            external_cached_tokens=rec.external_cached_tokens,
            cache_creation_tokens=engine.cache_creation_tokens if engine is not None else None,
            source=rec.source,
            completion_tokens=rec.completion_tokens,
            completion_source=completion_source,
            traceparent=_traceparent(self._headers),
        )


def _traceparent(headers: Headers) -> str | None:
    """The client's W3C ``traceparent``, when it sent exactly one that looks like one."""
    found = [value for name, value in headers if name.lower() == b"traceparent"]
    if len(found) != 1 or not _TRACEPARENT.fullmatch(found[0]):
        return None
    return found[0].decode("ascii")
