"""The cachetally ASGI app for the sim and upstream engines: our routes, the engine's behind the middleware.

(The vLLM engine runs inside vLLM's own server instead: :mod:`proxy.vllm_middleware`.)

```
API key check (only with --api-key or --api-keys; exempt paths configurable)
/health /metrics /stats          served here
everything else  ─▶ UsagePatchMiddleware ─▶ error guard ─▶ engine app (sim, upstream)
```

The engine starts in the lifespan (or in :meth:`CachetallyApp.running`, for tests that
drive the app in process), and a periodic TTL sweep runs beside it. ``on_started`` runs
once the lifespan startup has succeeded: the server process uses it for process-wide
settings that must wait for a started engine (``proxy.server.heap.settle_heap``).

Accounting (:mod:`proxy.server.instance`): the tenancy (``--api-keys``, ``--tenant-header``,
``--tenants``) goes to the middleware, and the usage recorder (``--usage-dir``,
``--otlp-endpoint``) starts before the engine and stops after it, so every request's
record is drained on a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_adapter.engine import Engine
from engine_adapter.events import EventSink
from proxy.accounting.metrics import multiprocess_dir
from proxy.asgi.errors import STOPPED, send_error
from proxy.asgi.paths import route_path
from proxy.asgi.replies import send_body
from proxy.server.engine_series import SharedEngineSeries
from proxy.server.instance import Accounting
from proxy.server.own_routes import read_only, ready_line, send_stats
from proxy.server.settings import Settings

logger = logging.getLogger("cachetally.app")

EngineFactory = Callable[[EventSink], Engine]


def make_engine(settings: Settings, sink: EventSink) -> Engine:
    """The engine ``settings`` ask for. Engines import lazily: vLLM is heavy and optional."""
    if settings.engine == "sim":
        from engine_adapter.sim import SimConfig, SimEngine

        return SimEngine(sink, SimConfig(block_size=settings.sim_block_size, token_delay_s=settings.sim_token_delay_s,
                                         prefill_delay_s=settings.sim_prefill_delay_s))
    if settings.engine == "upstream":
        from proxy.upstream.engine import UpstreamEngine

        return UpstreamEngine(settings)
    raise ValueError(f"engine {settings.engine!r} runs in vLLM's own server (proxy.vllm_middleware), not here")


class CachetallyApp:
    def __init__(
        self,
        settings: Settings,
        engine_factory: EngineFactory | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.accounting = accounting = Accounting(settings)
        self.ledger, self.metrics, self.recorder = accounting.ledger, accounting.metrics, accounting.recorder
        self.engine = (engine_factory or (lambda sink: make_engine(settings, sink)))(self.ledger)
        self._on_started = on_started
        self._patched: ASGIApp | None = None
        #: With several workers, this worker's engine series, written for every scrape to sum.
        self._engine_series: SharedEngineSeries | None = None
        self._stopped = False  # the engine stopped: a request uvicorn still runs (pipelined) is told so
        self._local = {"/health": self._health, "/metrics": self._metrics, "/stats": self._stats}
        self._auth = accounting.auth

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CachetallyApp]:
        """Start the engine beside the recorder and the TTL sweep; stop all three on exit."""
        async with self.accounting.running():
            publishing: asyncio.Task[None] | None = None
            try:
                inner = await self.engine.start()
                # The upstream engine's (proxy.upstream.prompt_count): no other engine has one.
                counter = getattr(self.engine, "count_prompt", None)
                self._patched = self.accounting.patch(inner, upstream=self.settings.engine == "upstream",
                                                      count_prompt=counter)
                if multiprocess_dir() is not None:
                    if self._engine_series is None:  # kept across a restart: it holds what it already wrote
                        self._engine_series = SharedEngineSeries(self.engine.metrics_text)
                    publishing = asyncio.create_task(self._engine_series.run())
                yield self
            finally:
                if publishing is not None:
                    publishing.cancel()
                if self._engine_series is not None:  # the worker may exit whole: no one would drop its gauges
                    self._engine_series.retire()
                self._patched, self._stopped = None, True
                await self.engine.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self._auth is not None and scope["type"] in ("http", "websocket") and not self._auth.allows(scope):
            await self._auth.refuse(scope, send)
            return
        local = self._local.get(route_path(scope)) if scope["type"] == "http" else None
        if local is not None:
            await read_only(scope, send, local)
        elif self._patched is None:
            if scope["type"] == "http":
                why = STOPPED if self._stopped else "cachetally is not running (engine not started)"
                await send_error(send, route_path(scope), 503, why)
        elif scope["type"] == "http" and not self.engine.healthy():
            await send_error(send, route_path(scope), 503, f"the {self.engine.name} engine is not healthy")
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
            where = f"http://{self.settings.host}:{self.settings.port}"
            logger.info(ready_line(where, self.engine.name, self.engine.describe(), time.monotonic() - began))
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})

    async def _health(self, send: Send) -> None:
        if self._patched is not None and self.engine.healthy():
            await send_body(send, 200, b'{"status":"ok"}', b"application/json")
        else:
            await send_error(send, "/health", 503, f"the {self.engine.name} engine is not healthy")

    async def _metrics(self, send: Send) -> None:
        if self._engine_series is not None:  # several workers: summed from the files, this one's written first
            if self._patched is not None:  # a stopped engine's gauges stay retired
                self._engine_series.publish()
            body = self.metrics.exposition()
        else:
            body = self.metrics.exposition() + self.engine.metrics_text()
        await send_body(send, 200, body, CONTENT_TYPE_LATEST.encode())

    async def _stats(self, send: Send) -> None:
        await send_stats(send, self.metrics.stats_dict())
