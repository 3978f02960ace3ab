"""The cachetally ASGI app: our own routes, and the engine's routes behind the middleware.

```
API key check (only with --api-key; exempt paths configurable)
/health /metrics /stats          served here
everything else  ─▶ UsagePatchMiddleware ─▶ error guard ─▶ engine app (vLLM, sim, upstream)
```

The engine starts in the lifespan (or in :meth:`CachetallyApp.running`, for tests that
drive the app in process), and a periodic TTL sweep runs beside it. ``on_started`` runs
once the lifespan startup has succeeded: the server process uses it for process-wide
settings that must wait for a started engine (``proxy.cli.settle_heap``).

Accounting: the tenancy (``--api-keys``, ``--tenant-header``, ``--tenants``) goes to the
middleware, and the usage recorder (``--usage-dir``, ``--otlp-endpoint``) starts before the
engine and stops after it, so every request's record is drained on a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from http import HTTPStatus
from collections.abc import AsyncIterator, Callable, Collection

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from engine_adapter.engine import ASGIApp, Engine, Message, Receive, Scope, Send
from engine_adapter.events import EventSink
from proxy.auth import ApiKeyGuard
from proxy.errors import send_error
from proxy.ledger import UsageLedger
from proxy.metrics import Metrics
from proxy.middleware import PatchConfig, UsagePatchMiddleware
from proxy.records.recorder import Recorder, recorder_from_settings
from proxy.settings import Settings
from proxy.tenants import tenancy_from_settings

logger = logging.getLogger("cachetally.app")

EngineFactory = Callable[[EventSink], Engine]


def make_engine(settings: Settings, sink: EventSink) -> Engine:
    """The engine ``settings`` ask for. Engines import lazily: vLLM is heavy and optional."""
    if settings.engine == "sim":
        from engine_adapter.sim import SimConfig, SimEngine

        return SimEngine(
            sink, SimConfig(block_size=settings.sim_block_size, token_delay_s=settings.sim_token_delay_s)
        )
    if settings.engine == "upstream":
        from proxy.upstream import UpstreamEngine

        return UpstreamEngine(settings)
    from engine_adapter.vllm.model_store import DEFAULT_MODEL_NAME, ensure_default_model
    from engine_adapter.vllm.engine import VllmEngine

    if settings.model:
        return VllmEngine(sink, settings.model, settings.engine_args)
    # Serve the default model under its name, not its cache path; user flags still win.
    served = ["--served-model-name", DEFAULT_MODEL_NAME]
    return VllmEngine(sink, str(ensure_default_model()), served + settings.engine_args)


class CachetallyApp:
    def __init__(
        self,
        settings: Settings,
        engine_factory: EngineFactory | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = UsageLedger(ttl_s=settings.ledger_ttl_s, max_slots=settings.ledger_max_slots)
        self.metrics = Metrics(self.ledger)
        self.engine = (engine_factory or (lambda sink: make_engine(settings, sink)))(self.ledger)
        self._on_started = on_started
        self._patched: ASGIApp | None = None
        self._local = {"/health": self._health, "/metrics": self._metrics, "/stats": self._stats}
        self.tenancy = tenancy_from_settings(settings)
        keys = self.tenancy.keys
        self._auth = ApiKeyGuard(settings.api_key, settings.auth_exempt_paths, keys) if settings.api_key or keys else None
        self.recorder: Recorder | None = recorder_from_settings(settings)
        if self.recorder is not None:
            self.metrics.watch_recorder(self.recorder)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CachetallyApp]:
        """Start the engine and the TTL sweep; stop both on exit, whatever happens."""
        if self.recorder is not None:
            self.recorder.start()
        try:
            inner = await self.engine.start()
            s = self.settings
            config = PatchConfig(
                missing=s.missing,  # type: ignore[arg-type]  # validated by Settings
                max_request_bytes=s.max_request_bytes,
                max_response_bytes=s.max_response_bytes,
                max_event_bytes=s.max_event_bytes,
                ghost_usage=s.engine == "upstream",
                strip_details_flag=s.engine != "upstream",
                default_model=s.model or "unknown",
                tenancy=self.tenancy,
            )
            guarded = _ErrorGuard(inner, config.routes.keys() if s.engine == "upstream" else None)
            self._patched = UsagePatchMiddleware(
                guarded, ledger=self.ledger, metrics=self.metrics, config=config, recorder=self.recorder
            )
            sweeper = asyncio.create_task(self._sweep_forever())
            try:
                yield self
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
        finally:
            self._patched = None
            try:
                await self.engine.stop()
            finally:
                if self.recorder is not None:
                    await asyncio.to_thread(self.recorder.stop, self.settings.otlp_timeout_s + 5)

    async def _sweep_forever(self) -> None:
        period = max(1.0, self.settings.ledger_ttl_s / 10)
        while True:
            await asyncio.sleep(period)
            evicted = self.ledger.sweep()
            if evicted:
                logger.warning("ledger TTL sweep evicted %d slot(s): a drop guard was missed", evicted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self._auth is not None and scope["type"] in ("http", "websocket") and not self._auth.allows(scope):
            await self._auth.refuse(scope, send)
            return
        local = self._local.get(scope.get("path", "")) if scope["type"] == "http" else None
        if local is not None:
            if scope["method"] in ("GET", "HEAD"):
                await local(send)
            else:
                await send_error(send, 405, "Method Not Allowed", [(b"allow", b"GET, HEAD")])
        elif self._patched is None:
            if scope["type"] == "http":
                await send_error(send, 503, "cachetally is not running (engine not started)")
        elif scope["type"] == "http" and not self.engine.healthy():
            await send_error(send, 503, f"the {self.engine.name} engine is not healthy")
        else:
            await self._patched(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        began = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self.running())
            except Exception as exc:
                logger.exception("startup failed")
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            if self._on_started is not None:
                self._on_started()
            await send({"type": "lifespan.startup.complete"})
            s = self.settings
            logger.info(
                "cachetally ready on http://%s:%d: engine %s (%s), started in %.1f s",
                s.host, s.port, self.engine.name, self.engine.describe(), time.monotonic() - began,
            )
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})

    async def _health(self, send: Send) -> None:
        if self._patched is not None and self.engine.healthy():
            await _send_bytes(send, 200, b'{"status":"ok"}', b"application/json")
        else:
            await send_error(send, 503, f"the {self.engine.name} engine is not healthy")

    async def _metrics(self, send: Send) -> None:
        body = self.metrics.exposition() + self.engine.metrics_text()
        await _send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())

    async def _stats(self, send: Send) -> None:
        await _send_bytes(send, 200, orjson.dumps(self.metrics.stats_dict()), b"application/json")


async def _send_bytes(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _ErrorGuard:
    """The engine app's failures in OpenAI error JSON.

    - An exception before the response started becomes a 500.
    - A 404 or 405 that is not already an OpenAI error is re-written as one, with the same
      status and headers (``Allow`` stays). Frameworks answer unknown routes and methods
      in their own shape: FastAPI (vLLM's app) ``{"detail": "Not Found"}``, Starlette
      (the sim) plain text. Only those two statuses are held; every other response
      passes through untouched. ``only_paths``: rewrite on these paths alone (upstream
      mode: a drop-in proxy passes an upstream's other routes through byte for byte).
    """

    def __init__(self, app: ASGIApp, only_paths: Collection[str] | None = None) -> None:
        self.app = app
        self.only_paths = only_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rewrite = self.only_paths is None or scope.get("path") in self.only_paths
        started = False
        held: Message | None = None
        chunks: list[bytes] = []

        async def guarded_send(message: Message) -> None:
            nonlocal started, held
            kind = message["type"]
            if kind == "http.response.start":
                started = True
                if rewrite and message["status"] in _REWRITTEN:
                    held = message
                    return
            elif held is not None and kind == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, held = held, None
                await _send_rewritten(send, start, b"".join(chunks))
                return
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:
            # The type only: an exception's text may quote the request.
            logger.error("engine app failed on %s: %s", scope.get("path"), type(exc).__name__)
            if started:
                raise
            await send_error(send, 500, "Internal server error")


_REWRITTEN = frozenset((404, 405))
_FRAMEWORK_HEADERS = frozenset((b"content-type", b"content-length"))


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    """Send a held 404/405 as an OpenAI error, unless it already is one.

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
    await send_error(send, status, message, kept)
