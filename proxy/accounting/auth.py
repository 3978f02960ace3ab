"""Optional API keys on the proxy itself (``--api-key``, ``--api-keys FILE``).

Which routes need a key follows vLLM's own ``--api-key``: paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (after the ``root_path``), every method but ``OPTIONS``
(CORS preflights carry no credentials). Beyond vLLM, every metered route needs one too
(``metered``: SageMaker's ``/invocations``, which vLLM leaves open): it runs the engine and
is billed, and a key names the tenant billed, so no request is billed to a tenant that no
credential gave it. ``/health``, ``/metrics`` and ``/stats`` stay open, so a Kubernetes
probe or a Prometheus scrape needs no key; paths in ``auth_exempt_paths`` (exact match) are
opened as well. In front of an upstream (``prefixed``), whose root path is not known here,
a guarded prefix or metered route after leading segments needs a key too, and so does one a
hop or the upstream's own router may serve the path as (:func:`~proxy.asgi.paths.forwarded_forms`:
``/x/../invocations``, ``/INVOCATIONS``, ``/invocations/``). A guarded request
must carry exactly one ``Authorization: Bearer <key>`` header naming a key of the table
(:class:`KeyTable`: the single ``--api-key`` and the ``--api-keys`` file), looked up by
SHA-256 digest, so neither the time taken nor anything else tells how much of a guess was
right or how long a key is. A refusal is a 401 in the route's error JSON (a WebSocket is closed
with 1008). Neither the key nor the header is ever logged.

The client's ``Authorization`` header still reaches the engine unchanged: in upstream
mode the upstream may check the same key itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Scope, Send

from proxy.accounting.tenants import KeyTable, bearer_token
from proxy.asgi.errors import send_error
from proxy.asgi.headers import only_header
from proxy.asgi.paths import forwarded_forms, route_path, tails

#: Path prefixes that need a key: vLLM's own (``vllm.entrypoints.serve.middleware.authenticate``).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: The scope key (an ASGI extension's) set on a request whose key the guard checked.
AUTHENTICATED = "cachetally.authenticated"


class ApiKeyGuard:
    def __init__(self, keys: KeyTable, exempt_paths: Iterable[str] = (), metered: Iterable[str] = (), *,
                 prefixed: bool = False, prefixes: tuple[str, ...] = GUARDED_PREFIXES) -> None:
        """``prefixes``: the guarded path prefixes; none where another check guards them
        (:func:`proxy.vllm_middleware.vllms_key_guard`: vLLM's own, for its key)."""
        if not keys:
            raise ValueError("an API key guard needs at least one key")
        self._keys = keys
        self._exempt = frozenset(exempt_paths)
        self._metered = frozenset(metered)
        self._prefixed = prefixed
        self._prefixes = prefixes
        self._longest = max(map(len, self._metered), default=0)

    def guards(self, scope: Scope) -> bool:
        """Whether ``scope`` needs a key (module docstring)."""
        if scope.get("method") == "OPTIONS":
            return False
        path = route_path(scope)
        if path in self._exempt:
            return False
        guarded = path.startswith(self._prefixes) or path in self._metered
        return guarded or (self._prefixed and self._route_under_a_prefix(path) is not None)

    def _route_under_a_prefix(self, path: str) -> str | None:
        """The guarded route ``path`` is after some leading segments, or ``None``: an engine
        behind a root path unknown here (an upstream's ``--root-path /api``) routes
        ``/api/v1/...`` as ``/v1/...``. So is a route ``path`` is, or is after leading segments,
        as a hop that normalizes paths before the upstream forwards it
        (:func:`~proxy.asgi.paths.forwarded_forms`): ``/x\\..\\invocations`` is ``/invocations``."""
        for form in forwarded_forms(path):
            if form is not path and (form.startswith(self._prefixes) or form in self._metered):
                return form
            if (found := self._after_leading_segments(form)) is not None:
                return found
        return None

    def _after_leading_segments(self, path: str) -> str | None:
        cut = path.find("/", 1)
        while cut != -1:
            if path.startswith(self._prefixes, cut):
                return path[cut:]
            cut = path.find("/", cut + 1)
        return next((tail for tail in tails(path, self._longest) if tail in self._metered), None)

    def allows(self, scope: Scope) -> bool:
        """Whether ``scope`` may go on: one this guard does not guard, or one whose key it
        knows, which it marks :data:`AUTHENTICATED` (an upstream's own key goes with it)."""
        if not self.guards(scope):
            return True
        token = bearer_token(only_header(scope["headers"], b"authorization"))
        if token is None or self._keys.tenant_for(token) is None:
            return False
        scope[AUTHENTICATED] = True
        return True

    async def refuse(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        path = route_path(scope)
        if self._prefixed:  # the route the upstream serves names the error's shape, as it names a 403's
            path = self._route_under_a_prefix(path) or path  # (a root path may begin /v1 itself)
        await send_error(send, path, 401, "Missing or invalid API key", headers=[(b"www-authenticate", b"Bearer")])
