"""What number is written into ``usage.prompt_tokens_details.cached_tokens``, and where it comes from.

1. An engine event exists: its value is exact and wins. A different value already in the
   response is overwritten and counted as a mismatch.
2. No event, but the response carries a value (standard or vendor field): keep it,
   written into the standard field, ``source=upstream``.
3. Neither: the ``missing`` policy, ``zero`` (write 0) or ``omit`` (leave the response as
   it is); the request counts as ``cache=unknown``. Nothing is ever estimated.

Cache writes (prompt tokens the engine wrote to its prefix cache) go in the same object
under vLLM's own name, ``created_cache_tokens``, when the engine event reports them for the
whole request; otherwise the field stays as the response had it (``source=upstream``: the
upstream's own count, which the usage record keeps).

0 is a value. Per-tier detail goes into a separate top-level ``cached_tokens_details``
object, only when the client asked for it, and never changes the standard fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from proxy.patching.ledger import EngineUsage
from proxy.patching.vendor_usage import WRITES_KEY, reported_cache_writes, reported_cached_tokens

Missing = Literal["zero", "omit"]
DETAILS_KEY = "cached_tokens_details"


@dataclass(slots=True)
class ResponseUsage:
    """What the response itself said: its model and usage figures, and how often the engine's
    figure overwrote them; the last usage object that reports a figure wins."""

    model: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    source: str | None = None  # engine | upstream | None (unknown)
    mismatches: int = 0


@dataclass(slots=True)
class UsagePatch:
    """Per-request patching context; ``apply`` is called on every JSON payload."""

    engine: EngineUsage | None
    missing: Missing = "zero"
    details: bool = False

    def apply(self, payload: dict[str, Any], in_response: ResponseUsage) -> bool | None:
        """Patch ``payload`` in place. ``True`` if changed, ``None`` if untouched."""
        model = payload.get("model")
        if isinstance(model, str):
            in_response.model = model
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            return None
        prompt_tokens = usage.get("prompt_tokens")
        reported = reported_cached_tokens(payload)
        value, source = self._resolve(prompt_tokens, reported)
        if self.engine is not None and reported is not None and reported != value:
            in_response.mismatches += 1
        if isinstance(prompt_tokens, int):
            in_response.prompt_tokens = prompt_tokens
        in_response.cached_tokens, in_response.source = value, source
        changed = False
        if value is not None:
            details = usage.get("prompt_tokens_details")
            if not isinstance(details, dict):
                details = usage["prompt_tokens_details"] = {}
                changed = True
            if details.get("cached_tokens") != value or type(details.get("cached_tokens")) is not int:
                details["cached_tokens"] = value
                changed = True
            writes = self._writes(prompt_tokens) if source == "engine" else None
            if writes is not None and details.get(WRITES_KEY) != writes:
                details[WRITES_KEY] = writes
                changed = True
        in_response.cache_creation_tokens = reported_cache_writes(usage)  # as patched: the engine's, else its own
        if self.details:
            payload[DETAILS_KEY] = self._details(value, source)
            changed = True
        return True if changed else None

    def _writes(self, prompt_tokens: Any) -> int | None:
        engine = self.engine
        if engine is None or (isinstance(prompt_tokens, int) and prompt_tokens != engine.prompt_tokens):
            return None  # a per-prompt usage chunk: writes are known for the whole request only
        return engine.cache_creation_tokens

    def _resolve(self, prompt_tokens: Any, reported: int | None) -> tuple[int | None, str | None]:
        engine = self.engine
        if engine is not None:
            value = engine.cached_for(prompt_tokens)
            if value is not None:
                return value, "engine"
        if reported is not None and not (isinstance(prompt_tokens, int) and reported > prompt_tokens):
            return reported, "upstream"  # never more reads than the prompt it reports
        return (0 if self.missing == "zero" else None), None

    def _details(self, value: int | None, source: str | None) -> dict[str, Any]:
        engine = self.engine if source == "engine" else None
        return {
            "local": engine.local_cached_tokens if engine else None,
            "external": engine.external_cached_tokens if engine else None,
            "created": engine.cache_creation_tokens if engine else None,
            "source": source or "unknown",
        }
