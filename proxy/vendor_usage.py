"""Read an engine's own cached-token report, wherever that engine puts it.

Used only when no engine event exists (``source=upstream``). Each reader takes a parsed
response body or SSE chunk and returns a non-negative int, or ``None`` when that shape
carries no value. The first reader that knows the value wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reader = Callable[[dict[str, Any]], int | None]


def _count(value: Any) -> int | None:
    # bool is an int subclass; a JSON true is not a token count.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _openai(payload: dict[str, Any]) -> int | None:
    """OpenAI standard: vLLM (--enable-prompt-tokens-details), SGLang, llama.cpp, lmdeploy."""
    details = (payload.get("usage") or {}).get("prompt_tokens_details")
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def _llama_cpp(payload: dict[str, Any]) -> int | None:
    """llama.cpp server: ``timings.cache_n`` (prompt tokens reused from the KV cache)."""
    timings = payload.get("timings")
    return _count(timings.get("cache_n")) if isinstance(timings, dict) else None


READERS: tuple[Reader, ...] = (_openai, _llama_cpp)


def reported_cached_tokens(payload: dict[str, Any]) -> int | None:
    for reader in READERS:
        value = reader(payload)
        if value is not None:
            return value
    return None
