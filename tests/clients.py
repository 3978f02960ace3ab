"""Client-side helpers shared by the loopback and real-engine tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import httpx
import openai

#: vLLM's prefix-cache block size on CPU: a warm prompt reports its full blocks.
VLLM_CPU_BLOCK = 128


def fresh_prompt(words: int = 160) -> str:
    """Unique from its first token, so no block of it is cached yet.

    160 words are 472 tokens of the default model: three whole 128-token blocks and part of
    a fourth. A real engine computes every token of a cold prompt, and on a CPU without
    bf16 that prefill is most of what a real-engine test costs, so prompts are no longer
    than what a test checks needs.
    """
    return " ".join([uuid.uuid4().hex, *(f"topic{i % 37} item{i}" for i in range(words // 2))])


def expected_stats(usages: Iterable[tuple[int, int]]) -> dict[str, int | float]:
    """What ``/stats`` must say after requests that reported these (prompt, cached) tokens."""
    pairs = list(usages)
    hits = sum(cached > 0 for _, cached in pairs)
    prompt = sum(p for p, _ in pairs)
    cached = sum(c for _, c in pairs)
    return {
        "total_requests": len(pairs),
        "hit_requests": hits,
        "miss_requests": len(pairs) - hits,
        "unknown_requests": 0,
        "hit_rate": round(hits / len(pairs), 4),
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "token_hit_rate": round(cached / prompt, 4),
    }


def scrape(base_url: str) -> str:
    """The server's ``/metrics`` exposition."""
    return httpx.get(f"{base_url}/metrics").text


def ask(
    client: openai.OpenAI,
    route: str,
    stream: bool,
    prompt: str | list[str],
    *,
    model: str,
    include_usage: bool = True,
    max_tokens: int = 3,
    **extra: Any,
) -> Any:
    """One chat or completions request; the usage the client saw (``None`` if it asked for none).

    A stream must carry exactly one usage chunk when it asked for usage, and none otherwise.
    """
    kwargs: dict[str, Any] = {"model": model, "max_tokens": max_tokens, **extra}
    if stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": include_usage}}
    if route == "chat":
        assert isinstance(prompt, str)
        result = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    else:
        result = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        return result.usage
    usages = [chunk.usage for chunk in result if chunk.usage is not None]
    assert len(usages) == (1 if include_usage else 0)
    return usages[0] if usages else None
