"""Optional API key on the proxy itself (``--api-key``, ``CACHETALLY_API_KEY``).

With a key set, every HTTP or WebSocket request must carry ``Authorization: Bearer
<key>`` (exactly one such header), compared with :func:`hmac.compare_digest` so the time
taken does not tell how much of a guess was right. Paths in ``auth_exempt_paths`` (exact
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


class ApiKeyGuard:
    def __init__(self, key: str, exempt_paths: Iterable[str] = ()) -> None:
        if not key:
            raise ValueError("the API key must not be empty")
        self._key = key.encode()
        self._exempt = frozenset(exempt_paths)

    def allows(self, scope: Scope) -> bool:
        if scope.get("path") in self._exempt:
            return True
        supplied = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
        if len(supplied) != 1:
            return False
        scheme, _, token = supplied[0].strip().partition(b" ")
        # compare_digest on the whole token, whatever its length: no early exit on a prefix.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def refuse(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await send_error(
            send, 401, "Missing or invalid API key", headers=[(b"www-authenticate", b"Bearer")]
        )
