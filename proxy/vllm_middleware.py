"""cachetally inside vLLM's own OpenAI server: one flag on ``vllm serve``.

```
vllm serve MODEL --middleware proxy.vllm_middleware.CachetallyMiddleware
```

vLLM adds the class with ``app.add_middleware`` after its own middlewares, so it is the
outermost layer of each API server's app. Starlette builds that stack on the first ASGI
call, the lifespan, by which time vLLM has bound the app to its engine client
(``init_app_state`` sets ``app.state.engine_client``). At ``lifespan.startup`` the
middleware taps that client (:class:`engine_adapter.vllm.tap.EngineTap`), bounds how
long a stop waits for the requests vLLM's engine left (:data:`REQUESTS_LEFT_S`) and how
long a client may take none of its response (``client_send_timeout_s``) or send nothing
of its request (``client_receive_timeout_s``); at
shutdown it removes the tap and drains the usage records. Each API server process of
``--api-server-count N`` builds its own app, so each taps its own client.

Being outermost, it also runs before vLLM's own ``--api-key`` check. So the first thing
it does with a request is that same check, as vLLM configured it (:func:`behind_vllm_auth`):
a request vLLM would refuse gets vLLM's 401 before its body is read, and no record.
vLLM checks its key under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only; the metered
routes it leaves open (SageMaker's ``/invocations``) need its key here (:func:`vllms_key_guard`).

Per request it is what ``cachetally serve`` has always put in front of vLLM's routes:
exact ``cached_tokens`` in JSON and SSE, final and continuous-usage chunks, 0 included;
tiers on request; request ids; tenants and usage records; the route's error JSON for 404/405
and for a dead engine (503 at once; vLLM's own watchdog then stops the server).

Settings come from the default TOML file and ``CACHETALLY_*`` environment variables
(:func:`proxy.server.settings.load_settings`), the only channel that reaches every API server
process. vLLM's ``--enable-prompt-tokens-details`` stays off: the numbers come from the tap.

Routes: ``/stats`` is served here; ``/metrics`` and ``/health`` are vLLM's own. The
``cachetally_*`` series are registered in prometheus_client's default registry, which
vLLM's ``/metrics`` exposes with one API server; with several, vLLM sets
``PROMETHEUS_MULTIPROC_DIR`` and its ``/metrics`` sums every process's files, ours included
(they are native prometheus_client series: :mod:`proxy.accounting.metrics`). ``/stats`` is computed
from those same collected counters, so it agrees with ``/metrics`` whichever process answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.vllm import compat
from engine_adapter.vllm.tap import EngineTap
from proxy.accounting.auth import GUARDED_PREFIXES, ApiKeyGuard
from proxy.accounting.tenants import DEFAULT_TENANT, KeyTable
from proxy.asgi.errors import STOPPED, send_error
from proxy.asgi.paths import route_path
from proxy.patching.context import DEFAULT_ROUTES
from proxy.server.client_bounds import bound_vllms_clients
from proxy.server.instance import Accounting
from proxy.server.logs import configure_logging
from proxy.server.own_routes import read_only, ready_line, send_stats
from proxy.server.settings import Settings, load_settings

logger = logging.getLogger("cachetally.vllm")


class CachetallyMiddleware:
    """Pure ASGI; holds the instance's accounting and, once started, the engine tap."""

    def __init__(self, app: ASGIApp) -> None:
        from prometheus_client import REGISTRY

        self.app = app
        settings = load_settings()
        configure_logging(settings.log_level)
        self.accounting = Accounting(settings, registry=REGISTRY)
        self._patched = self.accounting.patch(app)
        self._client: Any = None
        self._tap: EngineTap | None = None
        #: :meth:`_route`, behind vLLM's own API-key check once the lifespan found one.
        self._front: ASGIApp = self._route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        auth = self.accounting.auth
        if auth is not None and kind in ("http", "websocket") and not auth.allows(scope):
            await auth.refuse(scope, send)
            return
        await self._front(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        path = route_path(scope) if kind == "http" else ""
        if path == "/stats":
            await read_only(scope, send, self._stats)
        elif path in DEFAULT_ROUTES and self._tap is not None and self._tap.stopping:
            # vLLM's stop closed the engine client, and with one API server drains the engine
            # for --shutdown-timeout while it still accepts: vLLM would fail the request with a
            # 500 (its tokenizer pool is shut). It never runs, so it has no record.
            await send_error(send, path, 503, STOPPED)
        elif path in DEFAULT_ROUTES and getattr(self._client, "errored", False):
            await send_error(send, path, 503, "the vllm engine is not healthy")
        else:
            await self._patched(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = scope.get("app")  # the FastAPI app: Starlette puts itself in every scope
        if refusal := self._spoofable_tenants(app):
            await receive()  # lifespan.startup: fail it, so that uvicorn exits
            await send({"type": "lifespan.startup.failed", "message": refusal})
            return
        async with contextlib.AsyncExitStack() as stack:

            async def lifespan_receive() -> Message:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await stack.enter_async_context(self.accounting.running())
                    self._tap_engine(app, stack)
                    _bound_vllms_server(app, self.accounting.settings)
                    self._patched.serves_model(_served_name(app))  # what vLLM names in its responses
                    if _pooling_only(app):  # /invocations runs only pooling handlers, which the tap never sees
                        self._patched.refuse_route(INVOCATIONS)
                    self._front = behind_vllm_auth(app, self._route)
                    if self.accounting.auth is None:  # cachetally's own keys guard /invocations already
                        self.accounting.auth = vllms_key_guard(app, self.accounting.settings)
                return message

            async def lifespan_send(message: Message) -> None:
                if message["type"] == "lifespan.startup.complete":
                    logger.info(ready_line(*_describe(app)))
                elif message["type"].startswith("lifespan.shutdown."):
                    _state_for_tasks_left(app)
                    await stack.aclose()  # tap removed, records drained, before vLLM says done
                await send(message)

            await self.app(scope, lifespan_receive, lifespan_send)

    def _spoofable_tenants(self, app: Any) -> str | None:
        """Why the server must not start, if a tenant header sits beside vLLM's own ``--api-key``
        (or ``VLLM_API_KEY``): that key is a credential whose tenant is ``default``, and with
        the header any holder of it could bill any tenant (:mod:`proxy.accounting.tenants`)."""
        keys = getattr(getattr(getattr(app, "state", None), "args", None), "api_key", None)
        keys = [keys] if isinstance(keys, str) else keys or [os.environ.get("VLLM_API_KEY")]
        if any(keys) and self.accounting.tenancy.header is not None:
            return ("CACHETALLY_TENANT_HEADER cannot be combined with vLLM's --api-key: give the keys "
                    "to cachetally instead (CACHETALLY_API_KEYS_FILE names each key's tenant)")
        return None

    def _tap_engine(self, app: Any, stack: contextlib.AsyncExitStack) -> None:
        client = getattr(getattr(app, "state", None), "engine_client", None)
        if client is None:
            raise RuntimeError("no vLLM engine client on app.state: is this vLLM's OpenAI server?")
        tap = EngineTap(client, self.accounting.ledger, pd_legs=self.accounting.settings.pd_legs)
        self._client, self._tap = client, tap
        stack.callback(tap.uninstall)
        stack.callback(setattr, self, "_client", None)
        stack.callback(setattr, self, "_tap", None)

    async def _stats(self, send: Send) -> None:
        await send_stats(send, self.accounting.metrics.stats_dict())  # every process's, as /metrics


#: How long vLLM's HTTP server waits, once a stop has shut its engine client, for the
#: requests still in flight (uvicorn's ``timeout_graceful_shutdown``). vLLM's
#: ``--shutdown-timeout`` has already drained the engine by then (one API server; with
#: several, each API server's client stops at once and the engines after them), and vLLM
#: cancels its output handler without failing the requests it served: one still running
#: never gets another token. vLLM sets no limit, so uvicorn waited for them until the
#: process was killed, each client cut off and its usage record never written. Past this,
#: uvicorn cancels them and each is answered with the 503 or SSE error of a stopped request
#: (:mod:`proxy.patching.stopped`); a response that was whole needs no more than this to go out.
REQUESTS_LEFT_S = 1.0


def _bound_vllms_server(app: Any, settings: Settings) -> None:
    """Bounds on the uvicorn server vLLM runs ``app`` in (``app.state.server``, set before it
    serves): :data:`REQUESTS_LEFT_S` for the requests a stop leaves, unless the server has a
    limit of its own, and the client timeouts (:func:`proxy.server.client_bounds.bound_vllms_clients`):
    a client that stops reading, whose request the engine would go on generating, and one
    that sends its request too slowly, or nothing, which would hold its socket for good."""
    config = getattr(getattr(getattr(app, "state", None), "server", None), "config", None)
    if config is None:
        return
    if config.timeout_graceful_shutdown is None:
        config.timeout_graceful_shutdown = REQUESTS_LEFT_S
    if not bound_vllms_clients(config, settings.client_send_timeout_s, settings.client_receive_timeout_s):
        logger.warning("vLLM's server does not run uvicorn's httptools protocol: client_send_timeout_s and "
                       "client_receive_timeout_s are not applied, and a client that stops reading, or "
                       "sending, holds its request")


def _state_for_tasks_left(app: Any) -> None:
    """An empty ``app.state`` where vLLM's shutdown deleted it (to drop its engine client).

    vLLM's ``with_cancellation`` handlers leave their disconnect listener running when the
    server's stop cancels them (:data:`REQUESTS_LEFT_S`); the listener ends by reading
    ``request.app.state``, which may be after that ``del``: without a state it fails (a
    traceback in the log); in the empty one it finds nothing to count and ends. The ``del``
    is the last step of vLLM's lifespan, so none runs in between."""
    if app is not None and "state" not in vars(app):
        app.state = State()


#: SageMaker's route: vLLM validates its body against chat and completions first, then the pooling requests.
INVOCATIONS = "/invocations"


def _pooling_only(app: Any) -> bool:
    """Whether vLLM runs a pooling model (``--runner pooling``): without the generate task it
    serves no chat or completions, and ``/invocations`` dispatches every body to a pooling
    handler. ``False`` where the runner cannot be read: nothing is refused on a guess."""
    config = getattr(getattr(getattr(app, "state", None), "engine_client", None), "model_config", None)
    return getattr(config, "runner_type", None) == "pooling"


def behind_vllm_auth(app: Any, inner: ASGIApp) -> ASGIApp:
    """``inner`` behind vLLM's own API-key check, built as vLLM built it; ``inner`` if it has none.

    vLLM adds its ``AuthenticationMiddleware`` (``--api-key``, ``VLLM_API_KEY``) before the
    ``--middleware`` classes, so it sits inside this one: without a check of our own, a
    request vLLM refuses would have its body read and a usage record written. This builds a
    second instance of vLLM's class from the entry vLLM registered on ``app.user_middleware``,
    with the same keys, so the same routes are guarded and a refusal is vLLM's own 401,
    sent before anything of cachetally runs. vLLM's instance still checks behind it.
    """
    auth_class = compat.resolve("AuthenticationMiddleware")
    for cls, args, kwargs in getattr(app, "user_middleware", ()):
        if auth_class is not None and cls is auth_class:
            return cls(inner, *args, **kwargs)
    return inner


def vllms_key_guard(app: Any, settings: Settings) -> ApiKeyGuard | None:
    """vLLM's own keys (``--api-key``, ``VLLM_API_KEY``, as vLLM registered its check) on the
    metered routes vLLM leaves open: SageMaker's ``/invocations``, outside the prefixes vLLM
    guards. It runs the engine and is billed, and vLLM's key is a credential whose tenant is
    ``default``: a keyless request there was billed to that tenant, which no credential gave
    it. ``auth_exempt_paths`` opens it again, as it does beside cachetally's own keys (a
    SageMaker endpoint that sends none). ``None`` where vLLM checks no key."""
    auth_class = compat.resolve("AuthenticationMiddleware")
    for cls, _, kwargs in getattr(app, "user_middleware", ()):
        # vLLM 0.32 and 0.33 register it with ``tokens=``
        if auth_class is not None and cls is auth_class and (tokens := kwargs.get("tokens")):
            keys = KeyTable(dict.fromkeys(tokens, DEFAULT_TENANT))
            left_open = [route for route in DEFAULT_ROUTES if not route.startswith(GUARDED_PREFIXES)]
            # vLLM's own check answers the rest, with its own 401, behind this one
            return ApiKeyGuard(keys, settings.auth_exempt_paths, metered=left_open, prefixes=())
    return None


def _describe(app: Any) -> tuple[str, str, str, float]:
    """Where vLLM listens, the engine, what runs and how long the start took: the ready line's parts."""
    import psutil  # vLLM's own dependency
    import torch

    state = app.state
    args = state.args
    config = state.engine_client.model_config
    name = _served_name(app)
    dtype = str(getattr(config, "dtype", "?")).removeprefix("torch.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    servers = getattr(args, "api_server_count", 1) or 1
    which = f", API server pid {os.getpid()} of {servers}" if servers > 1 else ""
    started = time.time() - psutil.Process().create_time()
    where = f"http://{args.host or '0.0.0.0'}:{args.port}"
    return where, "vllm", f"model {name}, dtype {dtype}, {device}{which}", started


def _served_name(app: Any) -> str:
    """vLLM's first served model name (``--served-model-name``, else the model as given): the
    name vLLM answers with when the request named no other it serves."""
    config = app.state.engine_client.model_config
    names = getattr(config, "served_model_name", None) or config.model
    return names[0] if isinstance(names, list) else names
