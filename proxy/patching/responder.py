"""One patched request's response side: the ``send`` state machine behind
:class:`~proxy.patching.middleware.UsagePatchMiddleware`.

Built per request with the middleware's :class:`~proxy.patching.context.PatchContext`.
:func:`proxy.patching.request_side.run_patched` reads and rewrites the request and replays it
to the inner app with this responder's :meth:`Responder.send`, which patches the response
(a JSON body held and re-measured; an SSE stream passed on as it comes, usage events
rewritten). :func:`proxy.patching.metering.meter` then counts the request once from what
was noted here (:class:`~proxy.accounting.records.notes.RequestNotes`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from starlette.types import Message, Send

from proxy.accounting.records.notes import RequestNotes
from proxy.asgi.error_guard import REWRITTEN, send_rewritten
from proxy.asgi.headers import Headers, RequestHeaders
from proxy.patching.context import PatchContext
from proxy.patching.ghost import GhostHold
from proxy.patching.held_error import rewritten_from
from proxy.patching.model_sniff import NO_MODEL_SNIFF, SNIFF_CHUNKS, sniffed_model
from proxy.patching.passing_event import oversized_reader
from proxy.patching.passing_usage import PassingUsage
from proxy.patching.pd_leg import PREFILL, Leg, hand_over
from proxy.patching.request_body import RequestOptions
from proxy.patching.response_budget import ResponseHold
from proxy.patching import json_exact
from proxy.patching.shapes import shape_for
from proxy.patching.shapes.responses import created_model
from proxy.patching.sse import SSEPatcher
from proxy.patching.usage import ResponseUsage, UsagePatch

class Mode(Enum):
    PASS = 0
    JSON = 1
    SSE = 2
    ERROR = 3  # a framework's 404 or 405, held to be rewritten as the route's error JSON


class Responder:
    def __init__(
        self, ctx: PatchContext, route: str, key: str, echo: str, send: Send, request_headers: RequestHeaders,
        tenant: str, path: str,
    ) -> None:
        self.ctx = ctx
        self.route, self.path = route, path  # path: the route's own, which names its error JSON
        self.key, self.echo, self.tenant = key, echo, tenant
        self.notes = RequestNotes(route)
        self.shape = shape_for(route)  # None: the OpenAI shape (proxy.patching.usage)
        self.request_headers, self._send = request_headers, send
        self.options: RequestOptions | None = None
        self.leg: Leg | None = None  # a disaggregated prefill/decode leg (proxy.patching.pd_leg)
        self.handed: tuple[int, int, str] | None = None  # a decode leg's: its prefill's (prompt, cached, source)
        self.in_response = ResponseUsage()
        self.counted_prompt: int | None = None  # a cut stream's prompt, as the upstream's /tokenize counts it
        self.mode = Mode.PASS
        self.stream = False
        self.ghost_asked = False  # asked for a usage chunk the client did not (proxy.patching.ghost)
        self.completed = False  # a 200 response went out in full
        self._sniff_chunks = SNIFF_CHUNKS
        self._sniff_model = route not in NO_MODEL_SNIFF
        self.status: int | None = None
        self._start: Message | None = None
        self._length: tuple[bytes, bytes] | None = None  # a held start's Content-Length
        self._chunks: list[bytes] = []
        self.held: ResponseHold | None = None  # its response budget's share, once it holds one
        self._sse: SSEPatcher | None = None
        self._hold: GhostHold | None = None
        self._unheld: PassingUsage | None = None
        #: A stream's non-final chunks need only the SSE patcher and the event count now:
        #: nothing to sniff, no ghost usage held, the first byte's time noted.
        self._passing = False

    # -- response side -------------------------------------------------------------------

    def started(self) -> bool:
        """A response start has reached the client: the inner app sent one, and it is not
        held (a JSON body to patch, a 404 or 405 to rewrite)."""
        return self.status is not None and self._start is None

    async def send(self, message: Message) -> None:
        if self._passing and message.get("more_body", False) and message["type"] == "http.response.body":
            body = message.get("body", b"")
            out = self._sse.feed(body)  # type: ignore[union-attr]  # _passing: an SSE stream
            if out:
                self.notes.sse_events(out)
                if out is body:
                    await self._send(message)  # passed on as it came
                else:
                    await self._send({"type": "http.response.body", "body": out, "more_body": True})
            return
        kind = message["type"]
        if kind == "http.response.body":
            mode = self.mode
            if mode is Mode.SSE:
                await self._on_sse(message)
            elif mode is Mode.JSON:
                await self._on_json(message)
            elif mode is Mode.ERROR:
                await self._on_error(message)
            else:
                more, body = message.get("more_body", False), message.get("body", b"")
                if not more:
                    self.completed = self.options is not None and self.status == 200
                self.notes.body(body, more)
                await self._send(message)
                if self._unheld is not None and (payload := self._unheld.fed(body, last=not more)) is not None:
                    self.notes.whole_usage(payload)
                    self._patch(payload)  # the body went out unpatched: this reads its figures
        elif kind == "http.response.start":
            await self._on_start(message)
        else:
            await self._send(message)

    async def _on_start(self, message: Message) -> None:
        if self._start is not None:  # the inner app failed after a held start: its error answer
            self._start, self.mode, self.stream = None, Mode.PASS, False
            self._chunks.clear()
            if self.held is not None:
                self.held.release()
        echo_header = self.ctx.echo_header
        content_type, encoded, length = b"", False, None
        headers: Headers = []
        for name, value in message["headers"]:
            lower = name.lower()
            if lower == echo_header:
                continue
            if lower == b"content-type":
                content_type = value
            elif lower == b"content-length":
                length = (name, value)
                continue  # put back below, unless the body may change
            elif lower == b"content-encoding":
                encoded = True
            headers.append((name, value))
        headers.append((echo_header, self.echo.encode("latin-1")))
        message = {**message, "headers": headers}
        status = self.status = message["status"]
        if status in REWRITTEN and self.ctx.guard is not None:  # its request is on a patched route
            if length is not None:
                headers.append(length)  # an error JSON already is passed on as it came
            self.mode, self._start = Mode.ERROR, message
            return
        if status != 200 or self.options is None:
            pass
        elif encoded:
            self._count_skip("encoded")
        elif content_type.startswith(b"text/event-stream"):
            self.mode, self.stream = Mode.SSE, True
            if self.ghost_asked:
                self._hold = GhostHold()
            if whole := self.shape is not None and self.shape.whole_response_events:
                self.held = ResponseHold(self.ctx.responses)
            self._sse = SSEPatcher(
                self._patch_event,
                max_event_bytes=self.ctx.config.max_response_bytes if whole else self.ctx.config.max_event_bytes,
                budget=(self.held, self.ctx.config.max_event_bytes) if whole else None,
                on_oversize=self._count_skip,
                read_oversized=oversized_reader(self.shape, self._patch_event),
            )
            await self._send(message)
            return
        elif content_type.startswith(b"application/json"):
            self.mode = Mode.JSON
            self._start, self._length = message, length
            return  # held until the body is complete: its length is set then
        else:
            self._count_skip("content_type")
        if length is not None:
            headers.append(length)
        await self._send(message)

    async def _on_sse(self, message: Message) -> None:
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if not more:
            self.completed = self.options is not None and self.status == 200
        self.notes.body(body, more)
        assert self._sse is not None
        if self.in_response.model is None and self._sniff_chunks and body:
            self._sniff_chunks -= 1
            self.notes.sniff_id(body)
            self.in_response.model = sniffed_model(body) if self._sniff_model else created_model(body)
        out = self._sse.feed(body) if body else b""
        if not more:
            out += self._sse.flush()
        if out:
            self.notes.sse_events(out)
        if self._hold is not None:
            out = self._hold.filter(out)
            if not more:
                out += self._hold.release()
            if self.notes.ended and self._hold.holding:  # a held [DONE] has not reached the client
                self.notes.ended = False
        if out is body and body:
            await self._send(message)  # passed on as it came
        elif out or not more:
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
        self._passing = self._hold is None and self.notes.ttft_s is not None and (
            self.in_response.model is not None or not self._sniff_chunks
        )

    def _held_body(self, message: Message) -> bytes | None:
        """Keep one part of a held response's body: the whole body once the last part came."""
        more = message.get("more_body", False)
        body = message.get("body", b"")
        self.notes.body(body, more)
        self._chunks.append(body)
        return None if more else b"".join(self._chunks)

    async def _on_error(self, message: Message) -> None:
        if self._start is None:
            return  # its rewrite was given up: what follows is dropped (proxy.patching.held_error)
        self.held = held = self.held or ResponseHold(self.ctx.responses)
        if (body := rewritten_from(self._held_body(message), self._chunks, held, self.ctx.config)) is not None:
            self.notes.body(b"", False)  # the client's answer is whole, however the inner app's ends
            await send_rewritten(self._send, self.path, self._take_start(), body)

    async def _on_json(self, message: Message) -> None:
        if (whole := self._held_body(message)) is not None:
            self.completed = self.options is not None and self.status == 200
            await self._send_json(whole)
            return
        self.held = held = self.held or ResponseHold(self.ctx.responses)
        if (why := held.keeps(len(self._chunks[-1]), self.ctx.config.max_response_bytes)) is not None:
            self._count_skip(why)
            # Passed on as it comes; its usage is still read as it passes (proxy.patching.passing_usage).
            self.mode, self._unheld = Mode.PASS, PassingUsage(self.shape.body_kind if self.shape is not None else {})
            if self._sniff_model:
                self.in_response.model = sniffed_model(self._chunks[0])
            start = self._take_start()
            if self._length is not None:
                start["headers"].append(self._length)
            await self._send(start)
            parts, self._chunks = self._chunks, []
            await self._unheld.pass_on(parts, self._send)
            held.release()  # the parts held went out: from here each part passes as it comes

    async def _send_json(self, body: bytes) -> None:
        start = self._take_start()
        try:
            payload, encode = json_exact.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            self._count_skip("malformed", unread=False)  # read: no object, so no tokens (vLLM's null)
        else:
            self.notes.whole_usage(payload)
            if (self._patch(payload) is not None) | (  # both, in order: a prefill leg hands over what was read
                    self.leg == PREFILL and hand_over(payload, self.ctx.ledger.usage(self.key), self.in_response)):
                body = encode(payload)
        start["headers"].append((b"content-length", b"%d" % len(body)))
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
        return UsagePatch(self.ctx.ledger.usage(self.key), self.ctx.config.missing, options.want_details,
                          options.one_prompt).apply(payload, self.in_response)

    def _patch_shape(self, payload: dict[str, Any]) -> bool | None:
        assert self.shape is not None
        engine = self.ctx.ledger.usage(self.key)
        changed, whole = self.shape.patch(payload, engine, self.ctx.config.missing, self.in_response)
        if whole is not None and self.mode is Mode.SSE:
            self.notes.whole_usage(whole)  # a JSON body's usage was noted as it arrived
        return changed

    def _patch_event(self, payload: dict[str, Any]) -> bool | None:
        if self.shape is not None:
            return self._patch_shape(payload)
        options = self.options
        assert options is not None
        ghost = self._hold is not None and self._hold.drops(payload)
        self.notes.chunk_usage(payload, dropped=ghost, one_choice=options.one_choice)
        if ghost:
            self._patch(payload)  # observe it for the metrics, then drop it
            return False
        if options.want_details and payload.get("choices"):
            # Tier details belong to the final usage chunk only, not continuous ones.
            return UsagePatch(self.ctx.ledger.usage(self.key), self.ctx.config.missing,
                              one_prompt=options.one_prompt).apply(payload, self.in_response)
        return self._patch(payload)

    def _count_skip(self, reason: str, unread: bool = True) -> None:
        self.ctx.metrics.patch_skipped.labels(reason).inc()
        self.notes.unread |= unread  # what went out unread is not known: its tokens are never taken for none
