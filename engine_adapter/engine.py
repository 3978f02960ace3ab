"""The lifecycle every engine offers the HTTP side.

The proxy starts, stops, mounts and health-checks an engine through :class:`Engine`
without knowing which one it is. It carries no accounting: that flows only through
:class:`~engine_adapter.events.Scheduled`. What ``proxy`` takes from ``engine_adapter``,
and why: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import ASGIApp


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
