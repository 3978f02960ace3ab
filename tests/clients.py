"""Client-side helpers shared by the loopback and real-engine tests."""

from __future__ import annotations

from typing import Any

import httpx
import openai


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
