"""``UsagePatchMiddleware``: exact cache figures in every response of a metered route.

The metered routes (chat, completions, Responses, Messages, SageMaker's invocations) and
those refused while billing is on are listed in :mod:`proxy.patching.routes`; where each API keeps
its usage is :mod:`proxy.patching.shapes`.

Pure ASGI, shaped like Starlette's ``GZipMiddleware``: the middleware object holds only
configuration; per-request state lives in a :class:`~proxy.patching.responder.Responder` built for each
request, whose ``send`` is a state machine on ``message["type"]``.

Per request on a patched route:

1. The request id is read (or minted), made unique as a ledger key (across the
   instance's processes too, with ``process_tag``: :func:`~proxy.accounting.request_id.process_tag`), put in
   :data:`~engine_adapter.events.current_request_key` for engine code, forwarded to the
   inner app as ``X-Request-Id``, and the client's id is echoed in the response.
2. A ledger slot is opened before the inner app runs and closed in ``finally``; the
   close is synchronous, so cancellation cannot skip it.
3. The JSON request body is read once (size-capped) for the few options that matter,
   and replayed to the inner app; later ``receive`` calls (disconnects) go straight
   through. The inner app sees this route's headers rewritten by the middleware that
   owns them: the request key, the replayed body's ``Content-Length``, and
   ``Accept-Encoding: identity`` (the response is parsed and patched).
4. The response is patched: a JSON body is held, patched and re-measured; an SSE stream
   is passed on as it comes, with only usage events rewritten (``proxy.patching.sse``).
5. On the way out, the request's one :class:`~proxy.accounting.records.record.UsageRecord`
   is counted in the metrics under its tenant (:mod:`proxy.accounting.tenants`) and, when a
   recorder is configured, handed to it: a queue append, no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.events import current_request_key
from proxy.accounting.metrics import Metrics
from proxy.accounting.records.recorder import Recorder
from proxy.accounting.request_id import RequestIds
from proxy.asgi.error_guard import ErrorGuard
from proxy.asgi.errors import send_error
from proxy.asgi.headers import RequestHeaders, without
from proxy.asgi.paths import forwarded_forms, route_path, tails
from proxy.patching.body_budget import BodyBudget
from proxy.patching.context import CountPrompt, PatchConfig, PatchContext
from proxy.patching.ledger import UsageLedger
from proxy.patching.metering import meter
from proxy.patching.request_side import READ_HEADERS, REPLACED_HEADERS, run_patched
from proxy.patching.response_budget import ResponseBudget
from proxy.patching.responder import Responder
from proxy.patching.route_methods import METHOD_OVERRIDE_HEADERS, answered_as_vllms_router, bodiless_preflight
from proxy.patching.routes import runs_no_engine

#: Request headers the inner app does not get from a metered request: those replaced, and
#: the method overrides, so that the engine runs the ``POST`` that is metered.
_DROPPED = REPLACED_HEADERS | METHOD_OVERRIDE_HEADERS
#: The ``route`` label of a refused path that is no route of the table (a bounded label).
UNKNOWN_ROUTE = "unknown"


class UsagePatchMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        ledger: UsageLedger,
        metrics: Metrics,
        config: PatchConfig = PatchConfig(),
        request_ids: RequestIds = RequestIds(),
        recorder: Recorder | None = None,
        process_tag: str = "",
        count_prompt: CountPrompt | None = None,
    ) -> None:
        """``process_tag``: the last component of this process's keys for clients' ids, when
        several processes serve the port (:func:`proxy.accounting.request_id.process_tag`).
        ``count_prompt``: upstream mode's count of a cut stream's prompt (:class:`PatchContext`)."""
        self.app = app
        self.ledger = ledger
        self.metrics = metrics
        self.config = config
        self.request_ids = request_ids
        self.recorder = recorder
        self.process_tag = process_tag
        self.echo_header = request_ids.header.lower().encode("latin-1")
        guard = app if isinstance(app, ErrorGuard) else None
        self.context = PatchContext(app, guard, config, ledger, metrics, recorder, self.echo_header,
                                    BodyBudget(config.max_request_bytes_held),
                                    ResponseBudget(config.max_response_bytes_held), count_prompt)
        #: Every request header a decision reads, and those the inner app gets replaced.
        self._noted = READ_HEADERS | _DROPPED | config.tenancy.reads | {self.echo_header}
        # Read on every request: looked up once here.
        self._refused = config.refused if config.refuse_unmetered else frozenset()
        self._prefixed = config.refuse_unmetered and config.refuse_prefixed
        self._forwarded = config.forwarded
        self._known = frozenset(config.routes) | config.refused
        self._longest = max(map(len, self._known), default=0)
        self._routes = config.routes
        self._as_vllms_router = config.answer_as_vllms_router
        self._tenant_of = config.tenancy.resolve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "websocket" and route_path(scope) in self._refused:
                await self._refuse(scope, send)
            else:
                await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path in self._refused:
            await self._refuse(scope, send)
            return
        route = self._routes.get(path)
        if (self._as_vllms_router and (route is None or scope["method"] != "POST")
                and await answered_as_vllms_router(scope, send, path, self._routes)):
            return
        if route is None and self._prefixed:
            forms = forwarded_forms(path)
            if (under := self._under_a_prefix(forms)) is not None:
                await self._refuse(scope, send, under)
                return
            method = scope["method"]
            preflight = method == "OPTIONS" and bodiless_preflight(scope)
            if not all(form in self._forwarded or runs_no_engine(form, method, preflight) for form in forms):
                await self._refuse_unknown(send, path)
                return
        headers = RequestHeaders(scope["headers"], self._noted, _DROPPED)
        client_id = self.request_ids.from_headers(headers)
        if route is None or scope["method"] != "POST":
            echo = client_id or self.request_ids.generate()
            await self.app(scope, receive, _EchoId(send, self.echo_header, echo).send)
            return
        key = self.request_ids.unique_key(client_id, self._take, self.process_tag)
        tenant = self._tenant_of(headers)
        responder = Responder(self.context, route, key, client_id or key, send, headers, tenant, path)
        self.ledger.open(key)
        token = current_request_key.set(key)
        try:
            await run_patched(responder, scope, receive)
        finally:
            engine_usage = self.ledger.close(key)
            current_request_key.reset(token)
            meter(responder, engine_usage)

    def serves_model(self, model: str) -> None:
        """Record ``model`` for a request whose response names none (an engine's refusal): for
        a server that learns at startup which model it serves (:mod:`proxy.vllm_middleware`),
        whose name ``--model`` may not be, or that has no ``--model`` (the default model)."""
        self.config = replace(self.config, default_model=model)
        self.context = replace(self.context, config=self.config)

    def _under_a_prefix(self, forms: tuple[str, ...]) -> str | None:
        """The metered or refused route a path ends with after a prefix (Starlette routes
        ``{root_path}/v1/...`` as ``/v1/...``), or is, or ends with, as a hop that normalizes
        paths before the upstream forwards it (``forms``: the path's
        :func:`~proxy.asgi.paths.forwarded_forms`, the path itself first); else ``None``."""
        if found := next((form for form in forms[1:] if form in self._known), None):
            return found
        return next((tail for form in forms for tail in tails(form, self._longest) if tail in self._known), None)

    def refuse_route(self, route: str) -> None:
        """Refuse ``route`` from now on while billing is on, as the refused routes are: for a
        server that learns at startup it cannot meter it (:mod:`proxy.vllm_middleware`:
        ``/invocations`` on a pooling model)."""
        if self.config.refuse_unmetered:
            self._refused = self._refused | {route}

    async def _refuse(self, scope: Scope, send: Send, route: str | None = None) -> None:
        path = route or route_path(scope)  # one of the refused routes, or the route under a prefix: a bounded label
        self.metrics.refused_unmetered.labels(path).inc()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "not metered"})
            return
        why = f"{path} runs the engine unmetered: it is refused while billing is on"
        await send_error(send, path, 403, why)  # the route refused names the error's shape

    async def _refuse_unknown(self, send: Send, path: str) -> None:
        """Refuse ``path``, no route of :mod:`proxy.patching.routes` (upstream mode, billing on):
        the upstream may be a server whose own routes run the engine (``/chat/completions`` on
        llama.cpp, ``/generate`` on SGLang), which no record or key here would cover."""
        self.metrics.refused_unmetered.labels(UNKNOWN_ROUTE).inc()
        why = "no route this server meters or knows to run no engine: it is refused while billing is on"
        await send_error(send, path, 403, why)  # the path names the error's shape (/v1/messages/...)

    def _take(self, key: str) -> bool:
        return key not in self.ledger


class _EchoId:
    __slots__ = ("_send", "_header", "_value")

    def __init__(self, send: Send, header: bytes, value: str) -> None:
        self._send, self._header, self._value = send, header, value.encode("latin-1")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*without(message["headers"], self._header), (self._header, self._value)]
            message = {**message, "headers": headers}
        await self._send(message)
