"""The Responses and Messages shapes on loopback, with the official ``anthropic`` and
``openai`` SDKs: ``cachetally serve --engine sim`` with usage records on (billing on), and
upstream mode in front of the sim.

Embedded: the engine's figures in every path (JSON and SSE), 0 reads cold, the full
blocks warm, writes = the blocks the cold request cached; Anthropic's three input figures
add up to the prompt; one record per request under its route. Upstream in front of an
engine that reports the right figures: every stream and body goes through byte for byte.
Refused while billing is on: engine routes that are not metered, background responses."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from engine_adapter.sim.tokenizer import render_chat, tokenize
from tests.real_vllm import test_vllm_apis as apis
from tests.servers import metric_value, running_server
from tests.real_vllm.test_vllm_records import records_for

pytestmark = pytest.mark.loopback

BLOCK = 16  # the sim's block size
MODEL = "sim-model"


@pytest.fixture(scope="module")
def usage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def billed(usage_dir: Path) -> Iterator[str]:
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning",
            "--usage-dir", str(usage_dir), "--usage-flush-interval", "0.2"]
    with running_server(args) as (url, _):
        yield url


def prompt_size(prompt: str) -> int:
    return len(tokenize(render_chat([{"role": "user", "content": prompt}])))


def sdk(base: str, route: str) -> anthropic.Anthropic | openai.OpenAI:
    if route == "messages":
        return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=30)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def fresh_prompt() -> str:
    return " ".join([uuid.uuid4().hex, *(f"w{i}" for i in range(60))])


@pytest.mark.parametrize("path", list(apis.PATHS))
def test_embedded_figures_records_and_counters(billed: str, usage_dir: Path, path: str) -> None:
    route, ask = apis.PATHS[path]
    prompt = fresh_prompt()
    size = prompt_size(prompt)
    before = httpx.get(f"{billed}/metrics").text
    ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    with sdk(billed, route) as client:
        cold = ask(client, MODEL, prompt, ids[0])
        warm = ask(client, MODEL, prompt, ids[1])
    assert cold == (size, 0, (size // BLOCK) * BLOCK)
    assert warm == (size, ((size - 1) // BLOCK) * BLOCK, 0)
    after = httpx.get(f"{billed}/metrics").text
    moved = metric_value(after, "cachetally_requests_total", route=route) - metric_value(
        before, "cachetally_requests_total", route=route)
    assert moved == 2
    written = metric_value(after, "cachetally_cache_write_tokens_total") - metric_value(
        before, "cachetally_cache_write_tokens_total")
    assert written == cold[2] + warm[2]
    found = records_for(usage_dir, set(ids))
    for rid, figures in zip(ids, (cold, warm), strict=True):
        [record] = found[rid]
        assert record["route"] == route
        assert (record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) == figures


@pytest.mark.parametrize("path", ["/v1/embeddings", "/inference/v1/generate", "/v1/chat/completions/batch"])
def test_unmetered_engine_routes_are_refused_while_billing(billed: str, path: str) -> None:
    before = metric_value(httpx.get(f"{billed}/metrics").text, "cachetally_refused_unmetered_total", route=path)
    answer = httpx.post(f"{billed}{path}", json={"model": MODEL, "input": "hello"})
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == 403
    after = metric_value(httpx.get(f"{billed}/metrics").text, "cachetally_refused_unmetered_total", route=path)
    assert after - before == 1


def test_background_responses_are_refused_while_billing(billed: str) -> None:
    with openai.OpenAI(base_url=f"{billed}/v1", api_key="unused", max_retries=0) as client, \
            pytest.raises(openai.BadRequestError, match="not metered"):
        client.responses.create(model=MODEL, input="hello", background=True)


def test_without_billing_unmetered_routes_pass_through() -> None:
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args) as (url, _):
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "hello"}).status_code == 404  # the sim's own


@pytest.fixture(scope="module")
def upstream_pair() -> Iterator[tuple[str, str]]:
    """(the sim alone, reporting its figures; cachetally --upstream in front of it)."""
    sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]
    with running_server(sim) as (engine, _):
        proxy = ["-m", "proxy.server.cli", "serve", "--upstream", engine, "--log-level", "warning"]
        with running_server(proxy) as (front, _):
            yield engine, front


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_upstream_passes_right_figures_byte_for_byte(upstream_pair: tuple[str, str], api: str, stream: bool) -> None:
    engine, front = upstream_pair
    prompt = fresh_prompt()
    if api == "responses":
        path, body = "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": 3}
    else:
        path, body = "/v1/messages", {"model": MODEL, "max_tokens": 3,
                                      "messages": [{"role": "user", "content": prompt}]}
    body["stream"] = stream
    httpx.post(f"{engine}{path}", json=body)  # warm, so the figures are not all 0
    direct = httpx.post(f"{engine}{path}", json=body).content
    proxied = httpx.post(f"{front}{path}", json=body).content
    assert masked(proxied) == masked(direct)
    assert (b'"cache_read_input_tokens":' if api == "messages" else b'"cached_tokens":') in proxied


def masked(raw: bytes) -> bytes:
    raw = re.sub(rb'"(resp|msg)_[0-9a-f]{32}"', b'"X"', raw)
    return re.sub(rb'"created_at":\d+', b'"created_at":0', raw)


@pytest.mark.asyncio
@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_cut_stream_counts_only_its_token_events(api: str) -> None:
    """A stream cut before its final usage is billed for the tokens it delivered: in these
    shapes the framing events (``message_start``, ``response.created``, ...) are no tokens."""
    from engine_adapter.sim import apis as sim_apis
    from proxy.accounting.records.notes import RequestNotes

    req = sim_apis.ApiRequest(api, MODEL, list(range(40)), 7, True, True)
    stream = sim_apis.messages_stream if api == "messages" else sim_apis.responses_stream

    async def step() -> None:
        return None

    events = [event async for event in stream(req, "x", (0, 32), step)]
    cut = events[:5]  # a few tokens in, long before the final usage
    notes = RequestNotes(api)
    for event in cut:
        notes.sse_events(event)
    delivered = sum(b"delta" in event.split(b"\n", 1)[0] and b"text" in event for event in cut)
    assert notes.completion(stream=True) == (delivered, "stream")
    assert 0 < delivered < 7
