"""Client-side helpers shared by the loopback and real-engine tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def engine_block_size(base_url: str) -> int:
    """The prefix-cache block size of the vLLM engine behind ``base_url``, as it reports it
    (the ``block_size`` label of ``vllm:cache_config_info`` on ``/metrics``, served by vLLM
    itself or through cachetally). A warm prompt reports the whole blocks of all but its
    last token; the size depends on the platform (128 on a CPU, 16 by default on a CUDA GPU)
    and on ``--block-size``, so tests ask the engine rather than assume one."""
    sizes = {
        int(sample.labels["block_size"])
        for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)
        for sample in family.samples
        if sample.name == "vllm:cache_config_info"
    }
    assert len(sizes) == 1, f"vllm:cache_config_info block sizes on {base_url}/metrics: {sizes}"
    return sizes.pop()


def warm_hit(prompt_tokens: int, block: int) -> int:
    """What a repeat of a ``prompt_tokens`` prompt finds in vLLM's prefix cache: the whole
    blocks of all but its last token, which vLLM always computes."""
    return (prompt_tokens - 1) // block * block


def fresh_prompt(words: int = 160) -> str:
    """Unique from its first token, so no block of it is cached yet.

    160 words are 472 tokens of the default model: more than two whole blocks at any size
    vLLM uses for it (three and part of a fourth at a CPU's 128, 14 at the tests' 32, 29 at a
    CUDA GPU's 16). A real engine computes every token of a cold prompt, and on a CPU without
    bf16 that prefill is most of what a real-engine test costs, so prompts are no longer than
    what a test checks needs.
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
