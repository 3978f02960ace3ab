"""Optional API keys on the proxy itself (``--api-key``, ``--api-keys FILE``).

With a key set, every HTTP or WebSocket request must carry ``Authorization: Bearer
<key>`` (exactly one such header), compared with :func:`hmac.compare_digest` so the time
taken does not tell how much of a guess was right. ``--api-keys`` adds a file of keys,
each naming its tenant (:mod:`proxy.tenants`); the single ``--api-key`` stays valid and
belongs to the ``default`` tenant. Paths in ``auth_exempt_paths`` (exact
match, e.g. ``/health`` for a load balancer, ``/metrics`` for Prometheus) are open; none
are by default. A refusal is a 401 in OpenAI error JSON. Neither the key nor the header
is ever logged.

The client's ``Authorization`` header still reaches the engine unchanged: in upstream
mode the upstream may check the same key itself.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from engine_adapter.engine import Scope, Send
from proxy.errors import send_error
from proxy.tenants import KeyTable, bearer_token


class ApiKeyGuard:
    def __init__(
        self, key: str | None, exempt_paths: Iterable[str] = (), keys: KeyTable | None = None
    ) -> None:
        if key is not None and not key:
            raise ValueError("the API key must not be empty")
        if key is None and not keys:
            raise ValueError("an API key guard needs a key or a key table")
        self._key = key.encode() if key is not None else None
        self._keys = keys if keys else None
        self._exempt = frozenset(exempt_paths)

    def allows(self, scope: Scope) -> bool:
        if scope.get("path") in self._exempt:
            return True
        token = bearer_token(scope["headers"])
        if token is None:
            return False
        # compare_digest on the whole token, whatever its length: no early exit on a prefix.
        if self._key is not None and hmac.compare_digest(token, self._key):
            return True
        return self._keys is not None and self._keys.tenant_for(token) is not None

    async def refuse(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await send_error(
            send, 401, "Missing or invalid API key", headers=[(b"www-authenticate", b"Bearer")]
        )
