"""The lifecycle every engine offers the HTTP side.

DESIGN.md says the event contract (``events.py``) is the only thing ``proxy`` and
``engine_adapter`` share. This protocol is the one addition: the proxy must start, stop,
mount and health-check an engine without knowing which one it is. It carries no
accounting; that still flows only through :class:`~engine_adapter.events.Scheduled`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Engine(Protocol):
    """An engine that serves OpenAI-compatible routes and publishes ``Scheduled`` events."""

    #: Short name for logs and metrics labels (``sim``, ``vllm``).
    name: str

    async def start(self) -> ASGIApp:
        """Start the engine and return the ASGI app serving its routes."""
        ...

    async def stop(self) -> None:
        """Stop the engine and release everything ``start`` acquired. Idempotent."""
        ...

    def healthy(self) -> bool:
        """Whether requests can be served now (cheap, non-blocking)."""
        ...

    def describe(self) -> str:
        """What runs, for the ready line (``model X, dtype float32, cpu``): no secrets."""
        ...

    def metrics_text(self) -> bytes:
        """The engine's own Prometheus exposition, merged into ``/metrics`` (may be empty)."""
        ...
