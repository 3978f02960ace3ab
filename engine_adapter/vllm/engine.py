"""vLLM, embedded: ``AsyncLLM`` in process, vLLM's own OpenAI app, a tapped engine client.

The app is vLLM's (``build_app`` + ``init_app_state``, found by :mod:`.compat`), bound
to :class:`TappedEngineClient`, which delegates everything to the real ``AsyncLLM`` and
publishes one :class:`~engine_adapter.events.Scheduled` per engine request from the first
``RequestOutput`` of ``generate()``, before the serving layer sees it, with the figures of the request's
first copy (:mod:`engine_adapter.vllm.prefill`; ``n > 1`` fans out). The key is
:data:`~engine_adapter.events.current_request_key`, else vLLM's own request id.
``--enable-prompt-tokens-details`` is left off: the numbers come from the tap.

Lifespan: ``build_app`` gives the FastAPI app a lifespan (``launchers/utils/
server_utils.py``) that starts a task calling ``engine_client.do_log_stats()`` every
``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's periodic throughput / prefix-cache-hit log
line), freezes the GC heap, and on exit shuts down transcription servers and drops
``app.state``. Mounted inside our ASGI app it would never receive a ``lifespan`` scope,
so :meth:`VllmEngine.start` enters ``app.router.lifespan_context`` itself, in the same
``AsyncExitStack`` as the engine client; the caller must not forward ``lifespan`` to
this app. Prometheus metrics need no lifespan: the stat loggers run in the engine
client's output handler.

Tiers: see :mod:`engine_adapter.vllm.prefill`; without them events carry totals only.

Metrics: with one API process vLLM keeps its metrics in ``prometheus_client``'s default
``REGISTRY`` (multiprocess mode only if ``PROMETHEUS_MULTIPROC_DIR`` is set), along with
the default process/platform/GC collectors and the ``http_*`` metrics its instrumentator
adds. :meth:`VllmEngine.metrics_text` exposes ``vllm.v1.metrics.prometheus.
get_prometheus_registry()``, so the proxy's own metrics belong in a separate registry.

Shutdown: vLLM's default ``--shutdown-timeout 0`` SIGKILLs the engine core at once and
leaks its shared memory and semaphores, so we default to a few seconds (about 5 s here).
``start()`` calls vLLM's ``cli_env_setup()``, which sets ``VLLM_WORKER_MULTIPROC_METHOD=
spawn`` in ``os.environ`` unless already set, as ``vllm serve`` does.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import AsyncExitStack
from typing import Any

from engine_adapter.engine import ASGIApp
from engine_adapter.events import EventSink, Scheduled, current_request_key
from engine_adapter.vllm import compat
from engine_adapter.vllm.cpu import machine_flags
from engine_adapter.vllm.prefill import Prefill, PrefillTap

logger = logging.getLogger("cachetally.engine.vllm")

SHUTDOWN_TIMEOUT_S = 10


class TappedEngineClient:
    """Delegates every attribute to vLLM's engine client; ``generate()`` also publishes."""

    def __init__(self, client: Any, sink: EventSink, prefill: PrefillTap | None = None) -> None:
        self._client = client
        self._sink = sink
        self._prefill = prefill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        # vLLM's signature: generate(prompt, sampling_params, request_id, *, ...)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        outputs = self._client.generate(*args, **kwargs)
        published = False
        try:
            async for output in outputs:
                if not published:
                    published = True
                    self._publish(request_id, output)
                yield output
        finally:
            if self._prefill is not None:
                self._prefill.discard(request_id)
            await outputs.aclose()  # on disconnect: vLLM's generate() aborts the request

    def _publish(self, request_id: str | None, output: Any) -> None:
        prompt_ids = getattr(output, "prompt_token_ids", None)
        first = self._prefill.pop(request_id) if self._prefill is not None else None
        if first is None:  # no tap: the output's totals (exact with n = 1)
            cached = getattr(output, "num_cached_tokens", None)
            creation = getattr(output, "num_cache_creation_tokens", None)
            first = Prefill(cached, None, None, creation) if isinstance(cached, int) else None
        if prompt_ids is None or first is None:
            return  # e.g. prompt embeddings: no exact count to publish
        self._sink.publish(Scheduled(
            request_id=current_request_key.get() or str(output.request_id),
            prompt_tokens=len(prompt_ids),
            cached_tokens=first.cached_tokens,
            local_cached_tokens=first.local_cached_tokens,
            external_cached_tokens=first.external_cached_tokens,
            cache_creation_tokens=first.cache_creation_tokens,
            source="engine",
        ))


class VllmEngine:
    """The embedded vLLM engine serving vLLM's own OpenAI routes (see module docstring)."""

    name = "vllm"

    def __init__(self, sink: EventSink, model: str, engine_args: Sequence[str] = (),
                 host: str | None = None, port: int | None = None) -> None:
        self._sink = sink
        self._model = model
        self._engine_args = list(engine_args)
        self._host, self._port = host, port
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._prefill: PrefillTap | None = None

    def serve_argv(self) -> list[str]:
        """vLLM serve flags: our defaults first, the user's ``engine_args`` last (they win)."""
        argv = ["--model", self._model, "--enable-prefix-caching",
                "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        if self._host is not None:
            argv += ["--host", self._host]
        if self._port is not None:
            argv += ["--port", str(self._port)]
        return argv + machine_flags(self._engine_args) + self._engine_args

    def parse_args(self) -> Any:
        parser_class = compat.require("FlexibleArgumentParser")
        parser = compat.require("make_arg_parser")(parser_class(prog="cachetally (vLLM engine args)"))
        args = parser.parse_args(self.serve_argv())
        if (validate := compat.resolve("validate_parsed_serve_args")) is not None:
            validate(args)
        return args

    async def start(self) -> ASGIApp:
        if self._stack is not None:
            raise RuntimeError("VllmEngine already started")
        compat.check_version_once(logger)
        compat.log_missing_once(logger)
        init_app_state = compat.require("init_app_state")
        build_async_engine_client = compat.require("build_async_engine_client")
        build_app = compat.require("build_app")

        began = time.monotonic()
        if (cli_env_setup := compat.resolve("cli_env_setup")) is not None:
            cli_env_setup()  # spawn the engine core, as `vllm serve` does
        args = self.parse_args()
        if (configure_logging := compat.resolve("configure_logging_from_args")) is not None:
            configure_logging(args)
        self._stack = stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(build_async_engine_client(args))
            self._prefill = PrefillTap(self._client)
            stack.callback(self._prefill.uninstall)
            tapped = TappedEngineClient(self._client, self._sink, self._prefill)
            supported_tasks = await self._client.get_supported_tasks()
            app = build_app(args, supported_tasks, self._client.model_config)
            await init_app_state(tapped, app.state, args, supported_tasks)
            await stack.enter_async_context(app.router.lifespan_context(app))
        except BaseException:
            await self.stop()
            raise
        logger.debug("vLLM engine started in %.1f s", time.monotonic() - began)
        return app

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            client = self._client
            try:
                await stack.aclose()  # lifespan exit, prefill hook removed, engine core shut down
            finally:
                self._client = self._prefill = None
                multiprocessing.active_children()  # reap the engine core: no zombie left
                if client is not None:
                    # vLLM 0.32 keeps AsyncLLM alive to interpreter exit, where its __del__
                    # calls shutdown() again with module globals already gone and prints a
                    # TypeError traceback after every clean stop. It is shut down: make the
                    # second call a no-op.
                    client.shutdown = lambda *args, **kwargs: None

    def describe(self) -> str:
        config = getattr(self._client, "model_config", None)
        if config is None:
            return "not started"
        names = getattr(config, "served_model_name", None) or self._model
        name = names[0] if isinstance(names, list) else names
        dtype = str(getattr(config, "dtype", "?")).removeprefix("torch.")
        import torch

        return f"model {name}, dtype {dtype}, {'cuda' if torch.cuda.is_available() else 'cpu'}"

    def healthy(self) -> bool:
        client = self._client
        return client is not None and not getattr(client, "errored", True)

    def metrics_text(self) -> bytes:
        registry = compat.resolve("get_prometheus_registry") if self._client is not None else None
        if registry is None:
            return b""
        from prometheus_client import generate_latest

        return generate_latest(registry())
