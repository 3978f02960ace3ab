"""``UpstreamEngine``: cachetally as a drop-in proxy in front of a running server.

Every route is forwarded to ``settings.upstream`` + path + query; the middleware patches
chat and completions on the way back, everything else (``/v1/models``, ``/tokenize``,
errors) passes through byte for byte. The engine publishes no events: usage comes from
the upstream's own report (``proxy.vendor_usage``, ``source=upstream``).

One shared upstream client is created in :meth:`start` (the app's lifespan) and closed in
:meth:`stop`: an HTTP/1.1 keep-alive pool (:mod:`proxy.upstream_http1`, chosen over httpx
and aiohttp by measurement, see docs/PERFORMANCE.md) unless a client is injected (tests).
The pool is sized for about a thousand concurrent streams; a request that finds it full waits
``connect_timeout_s``, then gets 503. The per-request work is in
:mod:`proxy.upstream_forward`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import quote

from engine_adapter.engine import ASGIApp, Receive, Scope, Send
from proxy.errors import send_error
from proxy.middleware import DEFAULT_ROUTES
from proxy.settings import Settings
from proxy.upstream_client import UpstreamClient
from proxy.upstream_forward import Forward
from proxy.upstream_http1 import Http1Client

logger = logging.getLogger("cachetally.upstream")

#: Upper bound on connections to the upstream (each open stream holds one).
MAX_CONNECTIONS = 1024
#: Idle connections older than this are closed rather than reused: below the 5 s keep-alive
#: of uvicorn-based servers (vLLM, SGLang), so that we, not the upstream, end an idle
#: connection, and a request is never sent on one the upstream is closing.
KEEPALIVE_EXPIRY_S = 4.0

#: Parsed upstream targets kept (by path + query); the cache is cleared when it is full.
URL_CACHE_SIZE = 1024

#: Routes whose bodies the middleware parses: the upstream must not compress them.
_PATCHED_PATHS = frozenset(DEFAULT_ROUTES)


class UpstreamEngine:
    """Forwards to a running OpenAI-compatible server; implements ``Engine``."""

    name = "upstream"

    def __init__(self, settings: Settings, client: Callable[[], UpstreamClient] | None = None) -> None:
        """``client``: makes the upstream client at :meth:`start` (default: the HTTP/1.1 pool)."""
        if not settings.upstream:
            raise ValueError("UpstreamEngine needs settings.upstream (http://HOST:PORT)")
        self.base_url = settings.upstream.rstrip("/")
        self._make_client = client or (
            lambda: Http1Client(
                max_connections=MAX_CONNECTIONS,
                keepalive_s=KEEPALIVE_EXPIRY_S,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.read_timeout_s,
            )
        )
        self._client: UpstreamClient | None = None
        # The targets repeat (a handful of routes), so each is built and parsed once.
        self._targets: dict[bytes, object] = {}

    async def start(self) -> ASGIApp:
        if self._client is None:
            self._client = self._make_client()
        return self.app

    async def stop(self) -> None:
        client, self._client = self._client, None
        self._targets.clear()
        if client is not None:
            await client.aclose()

    def describe(self) -> str:
        return f"forwarding to {self.base_url}"

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
            await send_error(send, 503, "The upstream engine is not running")
            return
        target = self._target(client, scope)
        if target is None:
            await send_error(send, 400, "The request target must be an absolute path")
            return
        await Forward(client, target, scope["path"] in _PATCHED_PATHS, scope, receive, send).run()

    def _target(self, client: UpstreamClient, scope: Scope) -> object | None:
        """:meth:`url_for`, parsed by ``client``, from a cache keyed by the raw target."""
        raw_path: bytes | None = scope.get("raw_path")
        if not raw_path:
            url = self.url_for(scope)
            return None if url is None else client.target(url)
        key = raw_path + b"?" + scope.get("query_string", b"")
        target = self._targets.get(key)
        if target is None:
            url = self.url_for(scope)
            if url is None:
                return None
            if len(self._targets) >= URL_CACHE_SIZE:
                self._targets.clear()
            target = self._targets[key] = client.target(url)
        return target

    def url_for(self, scope: Scope) -> str | None:
        """``upstream`` + the request's raw path + query, encoding left as the client sent it.

        ``None`` unless the path starts with ``/``: the upstream is fixed by configuration,
        and a target such as ``@evil.example/x`` (which h11 passes on as ``raw_path``)
        appended to ``http://host:port`` would turn the configured address into userinfo
        and pick another host.
        """
        raw_path: bytes | None = scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else quote(scope["path"])
        if not path.startswith("/"):
            return None
        query: bytes = scope.get("query_string", b"")
        return self.base_url + path + ("?" + query.decode("latin-1") if query else "")

    def metrics_text(self) -> bytes:
        """Pool gauges, read from the connection pool when it has the expected shape (else empty)."""
        state = self._client.pool_state() if self._client is not None else None
        if state is None:
            return b""
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
        ).encode()
