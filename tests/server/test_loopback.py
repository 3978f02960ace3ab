"""`cachetally serve --engine sim` on 127.0.0.1, driven by the official openai client.

This is the issue's acceptance as a user runs it: a fresh ~600-token prompt reports
cached_tokens == 0 (present, not null); the same prompt again reports what the sim's
prefix cache counted, ((prompt_tokens - 1) // 16) * 16; never more than prompt_tokens.
"""

from __future__ import annotations

import uuid
import httpx
import openai
import pytest

from tests import clients
from tests.servers import metric_value

pytestmark = pytest.mark.loopback


def fresh_prompt(words: int = 590) -> str:
    # A unique first word makes every block of the prompt new to the cache.
    return " ".join([uuid.uuid4().hex, *(f"word{i}" for i in range(words))])


def ask(client: openai.OpenAI, route: str, stream: bool, prompt: str):
    return clients.ask(client, route, stream, prompt, model="sim-model", max_tokens=4)


def sim_cached_total(base_url: str) -> float:
    return metric_value(clients.scrape(base_url), "sim_prompt_tokens_cached_total")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cold_then_warm_reports_exact_cached_tokens(
    sim_client: openai.OpenAI, sim_server: str, route: str, stream: bool
) -> None:
    prompt = fresh_prompt()
    before = sim_cached_total(sim_server)
    cold = ask(sim_client, route, stream, prompt)
    warm = ask(sim_client, route, stream, prompt)

    assert cold.prompt_tokens > 590
    assert cold.prompt_tokens_details is not None
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens == cold.prompt_tokens
    assert warm.prompt_tokens_details.cached_tokens == ((warm.prompt_tokens - 1) // 16) * 16
    assert warm.prompt_tokens_details.cached_tokens <= warm.prompt_tokens
    # ... and that is exactly what the sim's own cache counted over the two requests.
    assert sim_cached_total(sim_server) - before == warm.prompt_tokens_details.cached_tokens


def test_shared_prefix_hits_only_the_shared_blocks(sim_client: openai.OpenAI) -> None:
    shared = fresh_prompt(200)
    ask(sim_client, "completions", False, shared + " alpha")
    usage = ask(sim_client, "completions", False, shared + " beta gamma")
    # The shared part is 201 tokens: its 12 full blocks of 16 hit.
    assert usage.prompt_tokens_details.cached_tokens == 192


def test_request_id_is_echoed_and_traces_to_the_response(sim_server: str) -> None:
    response = httpx.post(
        f"{sim_server}/v1/completions",
        json={"prompt": "hello", "max_tokens": 1},
        headers={"X-Request-Id": "trace-me-42"},
    )
    assert response.headers["x-request-id"] == "trace-me-42"
    minted = httpx.post(f"{sim_server}/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert len(minted.headers["x-request-id"]) == 32


def test_health_and_metrics(sim_server: str) -> None:
    assert httpx.get(f"{sim_server}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{sim_server}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert metric_value(metrics.text, "cachetally_ledger_open_slots") == 0
