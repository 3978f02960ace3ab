"""`cachetally serve --engine sim` on 127.0.0.1, driven by the official openai client.

This is the issue's acceptance as a user runs it: a fresh ~600-token prompt reports
cached_tokens == 0 (present, not null); the same prompt again reports what the sim's
prefix cache counted, ((prompt_tokens - 1) // 16) * 16; never more than prompt_tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.servers import metric_value, running_server

pytestmark = pytest.mark.loopback


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server(["-m", "proxy.cli", "serve", "--engine", "sim", "--log-level", "warning"]) as (url, _):
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def fresh_prompt(words: int = 590) -> str:
    # A unique first word makes every block of the prompt new to the cache.
    return " ".join([uuid.uuid4().hex, *(f"word{i}" for i in range(words))])


def ask(client: openai.OpenAI, route: str, stream: bool, prompt: str):
    """One request; returns the usage object the client saw."""
    kwargs = {"model": "sim-model", "max_tokens": 4}
    if stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
    if route == "chat":
        result = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    else:
        result = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        return result.usage
    usages = [chunk.usage for chunk in result if chunk.usage is not None]
    assert len(usages) == 1, "exactly one usage chunk"
    return usages[0]


def sim_cached_total(base_url: str) -> float:
    return metric_value(httpx.get(f"{base_url}/metrics").text, "sim_prompt_tokens_cached_total")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cold_then_warm_reports_exact_cached_tokens(
    client: openai.OpenAI, base_url: str, route: str, stream: bool
) -> None:
    prompt = fresh_prompt()
    before = sim_cached_total(base_url)
    cold = ask(client, route, stream, prompt)
    warm = ask(client, route, stream, prompt)

    assert cold.prompt_tokens > 590
    assert cold.prompt_tokens_details is not None
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens == cold.prompt_tokens
    assert warm.prompt_tokens_details.cached_tokens == ((warm.prompt_tokens - 1) // 16) * 16
    assert warm.prompt_tokens_details.cached_tokens <= warm.prompt_tokens
    # ... and that is exactly what the sim's own cache counted over the two requests.
    assert sim_cached_total(base_url) - before == warm.prompt_tokens_details.cached_tokens


def test_shared_prefix_hits_only_the_shared_blocks(client: openai.OpenAI) -> None:
    shared = fresh_prompt(200)
    ask(client, "completions", False, shared + " alpha")
    usage = ask(client, "completions", False, shared + " beta gamma")
    # The shared part is 201 tokens: its 12 full blocks of 16 hit.
    assert usage.prompt_tokens_details.cached_tokens == 192


def test_request_id_is_echoed_and_traces_to_the_response(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": "hello", "max_tokens": 1},
        headers={"X-Request-Id": "trace-me-42"},
    )
    assert response.headers["x-request-id"] == "trace-me-42"
    minted = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert len(minted.headers["x-request-id"]) == 32


def test_health_and_metrics(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{base_url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert metric_value(metrics.text, "cachetally_ledger_open_slots") == 0
