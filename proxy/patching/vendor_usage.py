"""Read an engine's own cached-token report, wherever that engine puts it.

Used when no engine event exists (``source=upstream``), and to count a response whose own
value differs from the engine's. Each reader takes one top-level field of a parsed
response body or SSE chunk and returns a non-negative int, or ``None`` when that shape
carries no value. The first reader that knows the value wins. What each engine sends
(fixtures with sources: ``tests/fixtures/upstream/<engine>.json``):

- vLLM: ``usage.prompt_tokens_details.cached_tokens`` with
  ``--enable-prompt-tokens-details``; without it the details are ``null`` (JSON) or
  absent (stream). Continuous-usage chunks never carry them.
- SGLang: the standard field with ``--enable-cache-report``, but only when it is above 0
  (``null`` otherwise, so 0 is indistinguishable from "not reported"). With HiCache and
  ``return_cached_tokens_details`` also ``sglext.cached_tokens_details`` =
  ``{device, host[, storage, storage_backend]}``, which sums to the same number and does
  report 0.
- llama.cpp server: the standard field (recent builds) and ``timings.cache_n`` (all
  builds with timings; ``-1`` or absent when unknown).
- TensorRT-LLM ``trtllm-serve`` and lmdeploy >= 0.14 (chat route): the standard field.
- Ollama: nothing; the ``missing`` policy applies.

Cache writes on these routes: vLLM's ``usage.prompt_tokens_details.created_cache_tokens``
(with ``--enable-prompt-tokens-details``), or OpenAI's ``cache_write_tokens`` in the same
object (what the ``openai`` SDK reads; a server in OpenAI's own shape, another cachetally);
none of the other engines sends them. Where both names carry a count, OpenAI's wins, as its
``cached_tokens`` wins over the vendor fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.accounting.records.record import count as _count

WRITES_KEY = "created_cache_tokens"  # vLLM's name in prompt_tokens_details
OPENAI_WRITES_KEY = "cache_write_tokens"  # OpenAI's, in the same object


def _openai(usage: Any) -> int | None:
    """OpenAI standard: vLLM, SGLang, llama.cpp, TensorRT-LLM, lmdeploy."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def _sglang_ext(ext: Any) -> int | None:
    """SGLang ``sglext.cached_tokens_details``: device + host (+ storage) cache hits."""
    tiers = ext.get("cached_tokens_details") if isinstance(ext, dict) else None
    if not isinstance(tiers, dict):
        return None
    values = [tiers.get("device"), tiers.get("host")]
    if tiers.get("storage") is not None:  # present only with an L3 storage backend
        values.append(tiers["storage"])
    counts = [_count(value) for value in values]
    return _count(sum(c for c in counts if c is not None)) if None not in counts else None  # the sum too


def _llama_cpp(timings: Any) -> int | None:
    """llama.cpp server: ``timings.cache_n`` (prompt tokens reused from the KV cache)."""
    return _count(timings.get("cache_n")) if isinstance(timings, dict) else None


#: Each reader and the top-level field it reads, in the order they are asked.
READERS: tuple[tuple[str, Callable[[Any], int | None]], ...] = (
    ("usage", _openai), ("sglext", _sglang_ext), ("timings", _llama_cpp),
)


def reported_cached_tokens(payload: dict[str, Any]) -> int | None:
    """The first value a reader finds (readers whose field the payload lacks are not asked:
    this runs on every JSON body and usage chunk)."""
    for field, reader in READERS:
        value = payload.get(field)
        if value is not None and (count := reader(value)) is not None:
            return count
    return None


def reported_cache_writes(usage: dict[str, Any]) -> int | None:
    """The upstream's count of the prompt tokens written to its prefix cache, when ``usage``
    has one: under OpenAI's name, else vLLM's."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    writes = _count(details.get(OPENAI_WRITES_KEY))
    return _count(details.get(WRITES_KEY)) if writes is None else writes
