"""``UpstreamEngine``: cachetally as a drop-in proxy in front of a running server.

Every route is forwarded to ``settings.upstream`` + path + query, but those the middleware
refuses while billing is on (:mod:`proxy.patching.routes`); the middleware patches the
metered routes (chat, completions, Responses, Messages, SageMaker's invocations) on the way
back, everything else (``/v1/models``, ``/tokenize``, errors) passes through byte for byte.
The engine publishes no events: usage comes from the upstream's own report
(``proxy.patching.vendor_usage``, ``source=upstream``).

The upstream URL is parsed once, into an :class:`~proxy.upstream.client.Origin`, when
the engine is built; each request's target is the origin's path + the request's raw path
+ query, checked to be a path (never a host) and left as the client encoded it.

One shared upstream client is created in :meth:`start` (the app's lifespan) and closed in
:meth:`stop`: an HTTP/1.1 keep-alive pool (:mod:`proxy.upstream.pool`, chosen over httpx
and aiohttp by measurement, see docs/PERFORMANCE.md) unless a client is injected (tests).
The pool is sized for about a thousand concurrent streams; a request that finds it full waits
``connect_timeout_s``, then gets 503. The per-request work is in
:mod:`proxy.upstream.forward`. Which headers the upstream sees for the patched routes
(``Accept-Encoding: identity``, the rewritten body's ``Content-Length``) is the
middleware's business (:mod:`proxy.patching.request_side`), not this engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import quote

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.accounting.auth import AUTHENTICATED
from proxy.asgi.errors import send_error
from proxy.asgi.paths import route_path
from proxy.server.settings import Settings
from proxy.upstream.client import Origin, UpstreamClient
from proxy.upstream.forward import Forward
from proxy.upstream.hop_headers import request_headers
from proxy.upstream.pool import Http1Pool
from proxy.upstream.prompt_count import PromptCounter

logger = logging.getLogger("cachetally.upstream")

#: Upper bound on connections to the upstream (each open stream holds one).
MAX_CONNECTIONS = 1024
#: Idle connections older than this are closed rather than reused: below the 5 s keep-alive
#: of uvicorn-based servers (vLLM, SGLang), so that we, not the upstream, end an idle
#: connection. An upstream that announces a shorter one (``Keep-Alive: timeout=N``) gets
#: 80% of it; a request caught by the upstream's close anyway is sent once more when it
#: cannot have been acted on (:mod:`proxy.upstream.resend`).
KEEPALIVE_EXPIRY_S = 4.0


class UpstreamEngine:
    """Forwards to a running OpenAI-compatible server; implements ``Engine``."""

    name = "upstream"

    def __init__(self, settings: Settings, client: Callable[[Origin], UpstreamClient] | None = None) -> None:
        """``client``: makes the upstream client for the origin at :meth:`start` (default: the pool)."""
        if not settings.upstream:
            raise ValueError("UpstreamEngine needs settings.upstream (http://HOST:PORT)")
        self.origin = Origin.parse(settings.upstream)
        self._make_client = client or (
            lambda origin: Http1Pool(
                origin,
                max_connections=MAX_CONNECTIONS,
                keepalive_s=KEEPALIVE_EXPIRY_S,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.read_timeout_s,
                write_timeout_s=settings.write_timeout_s,
                ca_file=settings.upstream_ca,
            )
        )
        self._client: UpstreamClient | None = None
        # The upstream's key stands in for a client's credential only where the client was
        # authenticated: by cachetally's own keys (a request they guard: AUTHENTICATED), or by
        # the gateway a tenant header needs in front (docs/ACCOUNTING.md, "Tenants"), which
        # answers for every request. Else any client that reached cachetally would go upstream
        # with the upstream's key: its credentials go as sent, and the key serves cachetally's
        # own model list alone.
        key = settings.upstream_api_key
        self._authorization = None if key is None else b"Bearer " + key.encode("ascii")
        self._gateway = settings.tenant_header is not None
        self.prompts = PromptCounter(exclude_tools=settings.exclude_tools_when_tool_choice_none)

    async def start(self) -> ASGIApp:
        if self._client is None:
            self._client = self._make_client(self.origin)
        return self.app

    async def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def describe(self) -> str:
        origin = self.origin
        scheme = "https" if origin.tls else "http"
        return f"forwarding to {scheme}://{origin.host_header.decode()}{origin.base_path.decode()}"

    def healthy(self) -> bool:
        # Started is healthy: an unreachable upstream is answered per request (502), and
        # the app refuses every request while this is False, so it must not flap.
        return self._client is not None

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})  # not forwarded
            return
        if scope["type"] != "http":
            return
        client = self._client
        if client is None:
            await send_error(send, route_path(scope), 503, "The upstream engine is not running")
            return
        target = self.target_for(scope)
        if target is None:
            await send_error(send, route_path(scope), 400, "The request target must be an absolute path")
            return
        authorization = self._authorization if self._gateway or scope.get(AUTHENTICATED) else None
        await Forward(client, target, scope, receive, send, authorization).run()

    async def count_prompt(self, route: str, body: bytes, scope: Scope) -> int | None:
        """The prompt tokens of ``body``, a stream cut before its usage chunk, as the upstream's
        ``/tokenize`` counts them, asked with the credentials the request was forwarded with
        (:mod:`proxy.upstream.prompt_count`); ``None`` when unknown."""
        authorization = self._authorization if self._gateway or scope.get(AUTHENTICATED) else None
        return await self.prompts.count(self._client, route, body, request_headers(scope["headers"], authorization))

    @staticmethod
    def target_for(scope: Scope) -> bytes | None:
        """The request's raw path + query (the origin's path is the pool's to add), encoding
        left as the client sent it.

        ``None`` unless the path starts with ``/``: the upstream is fixed by configuration,
        and a target such as ``@evil.example/x`` (which h11 passes on as ``raw_path``) must
        never be read as anything but a path. What else a target may hold is checked where
        it is written (:mod:`proxy.upstream.wire`).
        """
        raw_path: bytes | None = scope.get("raw_path")
        path = raw_path if raw_path else quote(scope["path"]).encode("latin-1")
        if not path.startswith(b"/"):
            return None
        query: bytes = scope.get("query_string", b"")
        return path + b"?" + query if query else path

    def metrics_text(self) -> bytes:
        """Pool gauges, read from the connection pool when it has the expected shape, and the
        counts of cut streams' prompts asked of the upstream."""
        prompts = self.prompts.metrics_text().encode()
        state = self._client.pool_state() if self._client is not None else None
        if state is None:
            return prompts
        open_, idle, checked_out, queued = state
        gauges = (
            ("cachetally_upstream_connections_open", open_, "Connections to the upstream."),
            ("cachetally_upstream_connections_idle", idle, "Idle keep-alive connections to the upstream."),
            (
                "cachetally_upstream_connections_checked_out",
                checked_out,
                "Upstream requests holding a connection (an unclosed response stays here).",
            ),
            ("cachetally_upstream_requests_queued", queued, "Upstream requests waiting for a connection."),
        )
        return "".join(
            f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name} {value}\n" for name, value, help_ in gauges
        ).encode() + prompts
