"""What number is written into ``usage.prompt_tokens_details.cached_tokens``, and where it comes from.

1. An engine event exists: its value is exact and wins. A different value already in the
   response is overwritten and counted as a mismatch.
2. No event, but the response carries a value (standard or vendor field): keep it,
   written into the standard field, ``source=upstream``; but not for a completions request
   of several prompts, whose one figure no upstream can be trusted to sum: vLLM 0.32
   reports one prompt's reads there (the last prompt's in JSON, the first to answer in a
   stream), and no writes.
3. Neither: the ``missing`` policy, ``zero`` (write 0) or ``omit`` (leave the response as
   it is); the request counts as ``cache=unknown``. Nothing is ever estimated.

Cache writes (prompt tokens the engine wrote to its prefix cache) go in the same object
under OpenAI's name, ``cache_write_tokens`` (what the ``openai`` SDK reads), and vLLM's,
``created_cache_tokens`` (what vLLM's own clients read): the engine event's count when it
reports them for the whole request; else the response's own under either name (OpenAI's
wins where both are there), when it is a count of what the reads leave of the prompt, which
the usage record keeps. Writes past that stay as the response had them, and unknown.

0 is a value. Per-tier detail goes into a separate top-level ``cached_tokens_details``
object, only when the client asked for it, and never changes the standard fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from proxy.accounting.records.record import count
from proxy.patching.ledger import EngineUsage
from proxy.patching.vendor_usage import OPENAI_WRITES_KEY, WRITES_KEY, reported_cache_writes, reported_cached_tokens

Missing = Literal["zero", "omit"]
DETAILS_KEY = "cached_tokens_details"


def believed(prompt: int | None, reads: int | None, writes: int | None) -> tuple[int | None, int | None]:
    """An upstream's cache reads and writes, as far as they can be figures of ``prompt``: none
    without a prompt count (a float, a string, a bool, absent), no reads past the prompt
    (vLLM reports a client's ``remote_prefill_cached_tokens`` claim so), and no writes past
    what the reads leave of it."""
    if prompt is None:
        return None, None
    reads = reads if reads is not None and reads <= prompt else None
    writes = writes if writes is not None and (reads or 0) + writes <= prompt else None
    return reads, writes


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
    #: The input figures an opening event reported as it came (Messages' ``message_start``), which
    #: a later usage object that omits one of them keeps, as the client's SDK reads it.
    opening: dict[str, Any] | None = None


@dataclass(slots=True)
class UsagePatch:
    """Per-request patching context; ``apply`` is called on every JSON payload."""

    engine: EngineUsage | None
    missing: Missing = "zero"
    details: bool = False
    #: The request is one engine request: the response's own figures can be its (rule 2).
    one_prompt: bool = True

    def apply(self, payload: dict[str, Any], in_response: ResponseUsage) -> bool | None:
        """Patch ``payload`` in place. ``True`` if changed, ``None`` if untouched."""
        model = payload.get("model")
        if isinstance(model, str):
            in_response.model = model
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            return None
        prompt = count(usage.get("prompt_tokens"))
        reported = reported_cached_tokens(payload)
        value, source = self._resolve(prompt, reported, payload)
        if self.engine is not None and reported is not None and reported != value:
            in_response.mismatches += 1
        if prompt is not None:
            in_response.prompt_tokens = prompt
        in_response.cached_tokens, in_response.source = value, source
        writes = self._writes(prompt) if source == "engine" else None
        if writes is None:  # the response's own: the engine's per-prompt chunk's, else believed
            writes = reported_cache_writes(usage)
            if source != "engine":
                writes = believed(prompt, value or 0, writes)[1] if self.one_prompt else None
        in_response.cache_creation_tokens = writes
        changed = False
        if value is not None:
            details = usage.get("prompt_tokens_details")
            if not isinstance(details, dict):
                details = usage["prompt_tokens_details"] = {}
                changed = True
            if details.get("cached_tokens") != value or type(details.get("cached_tokens")) is not int:
                details["cached_tokens"] = value
                changed = True
            if writes is not None and _name_writes(details, writes):
                changed = True
        if self.details:
            payload[DETAILS_KEY] = self._details(value, source)
            changed = True
        return True if changed else None

    def _writes(self, prompt_tokens: int | None) -> int | None:
        engine = self.engine
        if engine is None or (prompt_tokens is not None and prompt_tokens != engine.prompt_tokens):
            return None  # a per-prompt usage chunk: writes are known for the whole request only
        return engine.cache_creation_tokens

    def _resolve(self, prompt_tokens: int | None, reported: int | None,
                 payload: dict[str, Any]) -> tuple[int | None, str | None]:
        engine = self.engine
        if engine is not None:
            value = engine.cached_for(prompt_tokens, _choice(payload))
            if value is not None:
                return value, "engine"
        if self.one_prompt and (reads := believed(prompt_tokens, reported, None)[0]) is not None:
            return reads, "upstream"
        return (0 if self.missing == "zero" else None), None

    def _details(self, value: int | None, source: str | None) -> dict[str, Any]:
        engine = self.engine if source == "engine" else None
        return {
            "local": engine.local_cached_tokens if engine else None,
            "external": engine.external_cached_tokens if engine else None,
            "created": engine.cache_creation_tokens if engine else None,
            "source": source or "unknown",
        }


def _name_writes(details: dict[str, Any], writes: int) -> bool:
    """Write ``writes`` under OpenAI's name and vLLM's; whether that changed ``details``."""
    openai, vllm = details.get(OPENAI_WRITES_KEY), details.get(WRITES_KEY)
    if openai == vllm == writes and type(openai) is int and type(vllm) is int:
        return False
    details[WRITES_KEY] = details[OPENAI_WRITES_KEY] = writes
    return True


def _choice(payload: dict[str, Any]) -> int | None:
    """The index of the one choice a stream chunk carries (a per-prompt usage chunk's)."""
    choices = payload.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        index = choices[0].get("index")
        return index if type(index) is int else None
    return None
