"""What one cachetally instance keeps, whichever server carries the routes.

An :class:`Accounting` holds the ledger, the metrics, the tenancy and its API-key guard,
and the usage recorder, and wraps an engine's ASGI app in the usage-patching middleware
behind an :class:`~proxy.asgi.error_guard.ErrorGuard`. Two servers use it:

- :class:`proxy.server.app.CachetallyApp`: cachetally's own uvicorn app (sim and upstream engines);
- :class:`proxy.vllm_middleware.CachetallyMiddleware`: inside vLLM's own server
  (``vllm serve --middleware``, which ``cachetally serve`` runs for the vLLM engine).

:meth:`Accounting.running` starts the recorder and the ledger's TTL sweep, and on exit
stops the sweep and drains the recorder, so a graceful stop loses no record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from proxy.accounting.auth import ApiKeyGuard
from proxy.accounting.metrics import Metrics, multiprocess_dir
from proxy.accounting.records.recorder import Recorder, recorder_from_settings
from proxy.accounting.request_id import process_tag
from proxy.accounting.tenants import tenancy_from_settings
from proxy.asgi.error_guard import ErrorGuard
from proxy.patching.context import DEFAULT_ROUTES, CountPrompt, PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.patching.served_models import ServedModels, UpstreamModels
from proxy.server.settings import Settings

logger = logging.getLogger("cachetally.app")

#: How long one fetch of the upstream's /v1/models may take.
MODELS_TIMEOUT_S = 10.0
#: How long the stop waits for the requests uvicorn cancelled to write their records: each
#: ends within a few loop turns; a slot leaked open is not waited for longer.
CANCELLED_REQUESTS_S = 1.0


class Accounting:
    """Ledger, metrics, tenants and records of one instance (see module docstring)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.ledger = UsageLedger(ttl_s=settings.ledger_ttl_s, max_slots=settings.ledger_max_slots)
        self.metrics = Metrics(self.ledger, registry=registry)
        self.tenancy = tenancy_from_settings(settings)
        keys = self.tenancy.keys
        # Upstreams may echo the client's model name: only the models they list are labels.
        upstream = settings.engine == "upstream" and settings.upstream
        self.auth = ApiKeyGuard(keys, settings.auth_exempt_paths, metered=DEFAULT_ROUTES,
                                prefixed=bool(upstream)) if keys else None
        self.models = ServedModels([settings.model] if settings.model else (), checked=bool(upstream))
        self.upstream_models = (
            UpstreamModels(self.models, settings.upstream, settings.upstream_ca, MODELS_TIMEOUT_S,
                           settings.upstream_api_key) if upstream else None
        )
        self.recorder: Recorder | None = recorder_from_settings(settings)
        if self.recorder is not None:
            self.metrics.watch_recorder(self.recorder)
        #: Several processes share the port: this one's keys for clients' ids end with its tag.
        self.process_tag = process_tag() if multiprocess_dir() else ""

    def patch(self, inner: ASGIApp, *, upstream: bool = False,
              count_prompt: CountPrompt | None = None) -> UsagePatchMiddleware:
        """``inner`` behind the error guard and the usage-patching middleware.

        ``upstream``: a drop-in proxy asks for usage chunks the client did not (ghost
        usage), passes ``return_cached_tokens_details`` on, and rewrites framework errors
        on the patched routes only. ``count_prompt``: how it counts the prompt of a stream
        cut before its usage chunk (:meth:`proxy.upstream.engine.UpstreamEngine.count_prompt`).
        """
        s = self.settings
        config = PatchConfig(
            missing=s.missing,  # type: ignore[arg-type]  # validated by Settings
            max_request_bytes=s.max_request_bytes,
            max_response_bytes=s.max_response_bytes,
            max_event_bytes=s.max_event_bytes,
            max_request_bytes_held=s.max_request_bytes_held or max(1 << 30, s.max_request_bytes),
            max_response_bytes_held=s.max_response_bytes_held or max(1 << 30, s.max_response_bytes),
            ghost_usage=upstream,
            strip_details_flag=not upstream,
            default_model=s.model or "unknown",
            tenancy=self.tenancy,
            pd_legs=s.pd_legs,
            drop_kv_transfer_params=upstream and not s.pd_legs,
            models=self.models,
            # Billing is on when anything bills: records, or tenants' counters (from keys or
            # from a gateway's trusted header, which may be billed from /metrics alone).
            refuse_unmetered=(self.tenancy.keys is not None or self.tenancy.header is not None
                              or self.recorder is not None),
            refuse_prefixed=upstream,
            forwarded=frozenset(s.forward_routes),
            answer_as_vllms_router=upstream,
        )
        guarded = ErrorGuard(inner, config.routes.keys() if upstream else None)
        return UsagePatchMiddleware(guarded, ledger=self.ledger, metrics=self.metrics, config=config,
                                    recorder=self.recorder, process_tag=self.process_tag, count_prompt=count_prompt)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The recorder, the TTL sweep and the upstream's model list, for as long as the server runs."""
        if self.recorder is not None:
            self.recorder.start()
        try:
            tasks = [asyncio.create_task(self._sweep_forever())]
            try:
                if self.upstream_models is not None:
                    await self.upstream_models.refresh()
                    tasks.append(asyncio.create_task(self.upstream_models.refresh_forever()))
                yield
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            if self.recorder is not None:
                await self._cancelled_requests_metered()
                await asyncio.to_thread(self.recorder.stop, self.settings.otlp_timeout_s + 5)

    async def _cancelled_requests_metered(self) -> None:
        """Wait, a bounded time, for the requests still open to write their records.

        uvicorn stops the app right after it cancels the requests the drain left running,
        without waiting for them; each writes its record as its task ends, a few loop turns
        later (:mod:`proxy.patching.stopped`), and the recorder's final drain must not miss it.
        A patched request's ledger slot closes just before its record is written.
        """
        deadline = time.monotonic() + CANCELLED_REQUESTS_S
        while len(self.ledger) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _sweep_forever(self) -> None:
        period = max(1.0, self.settings.ledger_ttl_s / 10)
        while True:
            await asyncio.sleep(period)
            evicted = self.ledger.sweep()
            if evicted:
                logger.warning("ledger TTL sweep evicted %d slot(s): a drop guard was missed", evicted)
