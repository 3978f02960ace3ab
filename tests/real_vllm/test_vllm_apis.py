"""The Anthropic Messages and OpenAI Responses APIs on the shared real vLLM server
(``cachetally serve``, usage records on, so billing is on), driven by the official
``anthropic`` and ``openai`` SDKs, JSON and streamed.

Each path reports 0 reads cold and the full blocks warm; Anthropic's three input figures
add up to the prompt (counted by vLLM's ``/tokenize`` with the same messages) cold and warm;
the reads of all these requests add up to vLLM's own ``vllm:prompt_tokens_cached_total``
delta; each request moves ``cachetally_requests_total`` under its route and writes one
usage record. Routes that run the engine unmetered are refused and counted."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests import clients
from tests.clients import fresh_prompt, warm_hit
from tests.servers import Pace, metric_value
from tests.real_vllm.test_vllm_records import records_for

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

VLLM_CACHED = "vllm:prompt_tokens_cached_total"


@pytest.fixture(scope="module")
def model(vllm_server: str) -> str:
    return httpx.get(f"{vllm_server}/v1/models").json()["data"][0]["id"]


@pytest.fixture
def claude(vllm_server: str, vllm_pace: Pace) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=vllm_server, api_key="unused", max_retries=0,
                             timeout=vllm_pace.timeout(4)) as client:
        yield client


@pytest.fixture
def oai(vllm_server: str, vllm_pace: Pace) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0,
                       timeout=vllm_pace.timeout(4)) as client:
        yield client


def prompt_size(server: str, model: str, prompt: str) -> int:
    """The chat-templated prompt's token count, from vLLM's tokenizer (no engine step)."""
    answer = httpx.post(f"{server}/tokenize", json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True})
    return answer.json()["count"]


# Each asks once and returns (prompt, reads, writes) as the client saw them, and its request id.
Ask = Callable[[Any, str, str, str], tuple[int, int, int | None]]


def messages_json(client: anthropic.Anthropic, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    message = client.messages.create(model=model, max_tokens=2,
                                     messages=[{"role": "user", "content": prompt}],
                                     extra_headers={"x-request-id": rid})
    return _anthropic(message.usage.model_dump())


def messages_sse(client: anthropic.Anthropic, model: str, prompt: str, rid: str, *,
                 start_known: bool = True) -> tuple[int, int, int | None]:
    """``start_known``: the engine's figures are known at ``message_start`` (embedded mode);
    in front of vLLM they come with the final ``message_delta`` only."""
    with client.messages.stream(model=model, max_tokens=2,
                                messages=[{"role": "user", "content": prompt}],
                                extra_headers={"x-request-id": rid}) as stream:
        events = list(stream)
    start = [e for e in events if e.type == "message_start"]
    deltas = [e for e in events if e.type == "message_delta"]
    assert len(start) == 1 and len(deltas) == 1
    first, final = _anthropic(start[0].message.usage.model_dump()), _anthropic(deltas[0].usage.model_dump())
    if start_known:
        assert first == final  # message_start already knows the prompt and its cache figures
    else:
        assert first[0] == final[0]
    return final


def _anthropic(usage: dict[str, Any]) -> tuple[int, int, int | None]:
    reads, writes = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
    assert isinstance(reads, int), "cache_read_input_tokens is always present, 0 included"
    return usage["input_tokens"] + reads + (writes or 0), reads, writes


def responses_json(client: openai.OpenAI, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    response = client.responses.create(model=model, input=prompt, max_output_tokens=2, temperature=0,
                                       extra_headers={"x-request-id": rid})
    return _responses(response.usage.model_dump())


def responses_sse(client: openai.OpenAI, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    with client.responses.stream(model=model, input=prompt, max_output_tokens=2, temperature=0,
                                 extra_headers={"x-request-id": rid}) as stream:
        events = list(stream)
    done = [e for e in events if e.type in ("response.completed", "response.incomplete", "response.failed")]
    assert len(done) == 1
    return _responses(done[0].response.usage.model_dump())


def _responses(usage: dict[str, Any]) -> tuple[int, int, int | None]:
    details = usage["input_tokens_details"]
    return usage["input_tokens"], details["cached_tokens"], details.get("cache_write_tokens")


PATHS = {
    "messages-json": ("messages", messages_json),
    "messages-sse": ("messages", messages_sse),
    "responses-json": ("responses", responses_json),
    "responses-sse": ("responses", responses_sse),
}


def test_cold_zero_warm_full_blocks_every_path_metered_and_summing_to_vllm(
    vllm_server: str, vllm_block: int, vllm_usage_dir: Path, model: str, claude: anthropic.Anthropic,
    oai: openai.OpenAI,
) -> None:
    metrics_before = clients.scrape(vllm_server)
    ids: dict[str, tuple[str, str]] = {}
    reported: dict[str, list[tuple[int, int, int | None]]] = {}
    for name, (route, ask) in PATHS.items():
        prompt = fresh_prompt()
        size = prompt_size(vllm_server, model, prompt)
        client = claude if route == "messages" else oai
        for turn in ("cold", "warm"):
            rid = uuid.uuid4().hex
            ids[rid] = (name, turn)
            figures = ask(client, model, prompt, rid)
            reported.setdefault(name, []).append(figures)
            total, reads, writes = figures
            assert total == size, (name, turn)  # Anthropic: input + reads + writes
            expected = 0 if turn == "cold" else warm_hit(size, vllm_block)
            assert reads == expected, (name, turn)
            assert writes is not None and reads + writes <= size, (name, turn)
    metrics_after = clients.scrape(vllm_server)

    # The sum still holds: every read reported equals vLLM's own counter delta (n = 1).
    reads_sum = sum(reads for figures in reported.values() for _, reads, _ in figures)
    assert reads_sum == metric_value(metrics_after, VLLM_CACHED) - metric_value(metrics_before, VLLM_CACHED)

    for route in ("messages", "responses"):
        moved = (metric_value(metrics_after, "cachetally_requests_total", route=route)
                 - metric_value(metrics_before, "cachetally_requests_total", route=route))
        assert moved == 4, route

    found = records_for(vllm_usage_dir, set(ids))
    assert {rid: len(found.get(rid, [])) for rid in ids} == dict.fromkeys(ids, 1)
    for rid, (name, turn) in ids.items():
        record = found[rid][0]
        total, reads, writes = reported[name][0 if turn == "cold" else 1]
        assert (record["route"], record["outcome"]) == (PATHS[name][0], "completed")
        assert (record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) == (
            total, reads, writes), (name, turn)
        assert record["completion_tokens"] > 0


def test_responses_reads_match_chat_for_the_same_prompt(vllm_server: str, model: str, oai: openai.OpenAI) -> None:
    """vLLM's Responses route writes its own ``cached_tokens``: cachetally keeps it only
    because it equals the engine's, which the chat route reports for the same prompt."""
    prompt = fresh_prompt()
    before = metric_value(clients.scrape(vllm_server), "cachetally_cached_tokens_mismatch_total")
    clients.ask(oai, "chat", False, prompt, model=model, max_tokens=1, temperature=0)
    chat = clients.ask(oai, "chat", False, prompt, model=model, max_tokens=1, temperature=0)
    response = oai.responses.create(model=model, input=prompt, max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens == chat.prompt_tokens
    assert response.usage.input_tokens_details.cached_tokens == chat.prompt_tokens_details.cached_tokens > 0
    after = metric_value(clients.scrape(vllm_server), "cachetally_cached_tokens_mismatch_total")
    assert after == before  # vLLM's own figure was the engine's


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/chat/completions/batch"])
def test_unmetered_engine_routes_are_refused_and_counted(vllm_server: str, model: str, path: str) -> None:
    before = metric_value(clients.scrape(vllm_server), "cachetally_refused_unmetered_total", route=path)
    answer = httpx.post(f"{vllm_server}{path}", json={"model": model, "token_ids": [1, 2, 3],
                                                      "sampling_params": {"max_tokens": 2}})
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == 403
    after = metric_value(clients.scrape(vllm_server), "cachetally_refused_unmetered_total", route=path)
    assert after - before == 1


@pytest.mark.parametrize("flag", [True, 1])  # vLLM (pydantic, lax) reads 1 as true
def test_background_responses_are_refused_while_billing(
    vllm_server: str, model: str, oai: openai.OpenAI, flag: object
) -> None:
    """Refused by cachetally (counted), whatever vLLM's own store settings would say."""
    name, route = "cachetally_refused_unmetered_total", "/v1/responses"
    before = metric_value(clients.scrape(vllm_server), name, route=route)
    with pytest.raises(openai.BadRequestError, match="not metered"):
        oai.responses.create(model=model, input="hello", max_output_tokens=2, store=True,
                             extra_body={"background": flag})
    assert metric_value(clients.scrape(vllm_server), name, route=route) - before == 1
