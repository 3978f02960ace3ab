"""The event contract between engines and the HTTP side.

Accounting crosses from ``engine_adapter`` to ``proxy`` only through this module (what
else ``proxy`` imports, to build and drive engines: docs/ARCHITECTURE.md). An engine
publishes one :class:`Scheduled` per engine request, when the request is first scheduled,
into an :class:`EventSink`. The key it publishes under is the proxy's request key, which
the middleware puts in :data:`current_request_key` for the duration of the HTTP request;
engine code reads it there instead of parsing its own request ids. An engine whose outputs
may carry several tokens each also tells the sink how many tokens each output handed its
serving layer (:meth:`EventSink.generated`), so that a stream is billed in tokens, not events.
An engine that knows a request's prompt length before its prefill ends announces it
(:meth:`EventSink.added`), so that a request cut before then still has its prompt billed.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Source = Literal["engine", "upstream", "estimate"]

#: The proxy's ledger key for the HTTP request being served, or ``None`` outside one.
#: Set and reset (with its token) by the middleware; read by engine taps.
current_request_key: ContextVar[str | None] = ContextVar("cachetally_request_key", default=None)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One engine request was scheduled; its prompt-cache accounting is now known.

    ``cached_tokens`` counts prompt tokens served from any cache tier. The optional tiers
    split it (``local_cached_tokens + external_cached_tokens == cached_tokens`` when both
    are known) and report the tokens newly written to the cache. On a disaggregated decode
    the tiers are unknown (they are the prefill instance's), and the decode's own figures
    are in ``transferred_tokens`` and ``decode_local_tokens``.
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    local_cached_tokens: int | None = None
    external_cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    source: Source = "engine"
    #: A disaggregated decode only (``cached_tokens`` is then the prefill instance's hits):
    #: prompt tokens whose KV arrived from the prefill instance, a transfer and never a
    #: cache hit, and those this instance found in its own prefix cache instead.
    transferred_tokens: int | None = None
    decode_local_tokens: int | None = None
    #: Which choices of the HTTP response this engine request makes, when the engine knows:
    #: ``first_choice`` up to ``first_choice + choices - 1`` (a completions request over
    #: several prompts runs one engine request per prompt, each with ``n`` choices).
    first_choice: int | None = None
    choices: int = 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.cached_tokens < 0:
            raise ValueError("token counts must be non-negative")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )


@runtime_checkable
class EventSink(Protocol):
    """Where engines publish. Every method is synchronous and must never block."""

    def publish(self, event: Scheduled) -> None: ...

    def generated(self, request_id: str, tokens: int) -> None:
        """``tokens`` more tokens of ``request_id`` reached the engine's serving layer."""

    def added(self, request_id: str, prompt_tokens: int) -> None:
        """An engine request of ``request_id`` was added, its prompt ``prompt_tokens`` tokens
        long as the engine counts it. Its :class:`Scheduled` follows; if none does (the request
        was cut before its prefill ended, or its figures were refused), its prompt stands with
        its cache figures unknown. The sink pairs them by count: an engine that announces one
        engine request of an HTTP request announces each, before publishing its ``Scheduled``."""
