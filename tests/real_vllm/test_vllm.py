"""The main job, for real: `cachetally serve` with embedded vLLM (CPU build in CI) and the
default model, driven over loopback by the official openai client and raw httpx.

One engine for the whole module (it takes ~40 s to start); the fixture always stops it,
with SIGTERM, and checks the engine core process went with it. vLLM's
--enable-prompt-tokens-details stays off, so every cached_tokens below comes from the tap.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests import clients
from tests.clients import fresh_prompt, warm_hit
from tests.servers import Pace, metric_value

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

VLLM_CACHED = "vllm:prompt_tokens_cached_total"
VLLM_RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def server(vllm_server: str) -> str:
    return vllm_server


@pytest.fixture(scope="module")
def block(vllm_block: int) -> int:
    return vllm_block


@pytest.fixture(scope="module")
def pace(vllm_pace: Pace) -> Pace:
    return vllm_pace


@pytest.fixture
def client(server: str, pace: Pace) -> Iterator[openai.OpenAI]:
    # n=2 and ~600-token prompts: a few times the measured request.
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=pace.timeout(4)) as c:
        yield c


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(client: openai.OpenAI, route: str, stream: bool, prompt: str | list[str], **extra):
    return clients.ask(client, route, stream, prompt, model=model_id(client), max_tokens=2, temperature=0, **extra)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cold_zero_then_warm_equals_vllm_scheduler(client, server, route, stream, block) -> None:
    prompt = fresh_prompt()
    before = metric_value(clients.scrape(server), VLLM_CACHED)
    cold = ask(client, route, stream, prompt)
    middle = metric_value(clients.scrape(server), VLLM_CACHED)
    warm = ask(client, route, stream, prompt)
    after = metric_value(clients.scrape(server), VLLM_CACHED)

    assert cold.prompt_tokens > 2 * block
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert middle - before == 0
    assert warm.prompt_tokens_details.cached_tokens > 0
    assert warm.prompt_tokens_details.cached_tokens == after - middle
    assert warm.prompt_tokens_details.cached_tokens == warm_hit(warm.prompt_tokens, block)


def test_sum_of_reported_cached_tokens_equals_vllm_counter(client, server) -> None:
    shared = fresh_prompt(200)
    prompts = [fresh_prompt(), shared, shared + " and then more", shared, fresh_prompt(120)]
    before_text = clients.scrape(server)
    reported = 0
    for i, prompt in enumerate(prompts):
        for route in ("chat", "completions"):
            reported += ask(client, route, i % 2 == 1, prompt).prompt_tokens_details.cached_tokens
    after_text = clients.scrape(server)
    assert reported > 0
    assert reported == metric_value(after_text, VLLM_CACHED) - metric_value(before_text, VLLM_CACHED)
    # ... and cachetally's own counter says the tap (source=engine) supplied all of it.
    ours = "cachetally_cached_tokens_total"
    assert reported == metric_value(after_text, ours, source="engine", tier="all") - metric_value(
        before_text, ours, source="engine", tier="all"
    )


def test_continuous_usage_chunks_all_carry_cached_tokens(client, block) -> None:
    prompt = fresh_prompt()
    ask(client, "chat", False, prompt)
    result = client.chat.completions.create(
        model=model_id(client),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    usages = [chunk.usage for chunk in result]
    assert len(usages) >= 3 and all(u is not None for u in usages)
    values = {u.prompt_tokens_details.cached_tokens for u in usages}
    assert len(values) == 1 and values.pop() == warm_hit(usages[0].prompt_tokens, block)


def test_batch_of_two_prompts_and_n2_are_aggregated_like_prompt_tokens(client, block) -> None:
    a, b = fresh_prompt(), fresh_prompt()
    ask(client, "completions", False, a)
    ask(client, "completions", False, b)
    batch = client.completions.create(model=model_id(client), prompt=[a, b], max_tokens=2)
    per_prompt = [warm_hit(n, block) for n in (ask(client, "completions", False, p).prompt_tokens for p in (a, b))]
    assert batch.usage.prompt_tokens_details.cached_tokens == sum(per_prompt)

    c = fresh_prompt()
    single = ask(client, "chat", False, c)
    n2 = client.chat.completions.create(
        model=model_id(client), messages=[{"role": "user", "content": c}], max_tokens=2, n=2
    )
    assert len(n2.choices) == 2
    assert n2.usage.prompt_tokens == single.prompt_tokens  # the prompt counted once
    assert n2.usage.prompt_tokens_details.cached_tokens == warm_hit(single.prompt_tokens, block)


@pytest.mark.parametrize("n", [1, 2])
def test_per_prompt_usage_chunks_of_same_length_prompts_carry_each_prompts_own_hits(client, n, block) -> None:
    """Completions over two prompts of one length, one warm and one cold, streamed with
    continuous usage: vLLM sends each choice's usage for its own prompt, and each carries
    that prompt's hits. Matched by length alone, the two read 0."""
    rng = random.Random()
    warm, cold = ([rng.randrange(1000, 40000) for _ in range(300)] for _ in range(2))
    client.completions.create(model=model_id(client), prompt=warm, max_tokens=1)
    stream = client.completions.create(
        model=model_id(client), prompt=[warm, cold], max_tokens=3, n=n, temperature=1.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    warm_hits = warm_hit(300, block)
    per_prompt: dict[int, set[int]] = {0: set(), 1: set()}
    for chunk in stream:
        if chunk.choices:
            assert chunk.usage is not None and chunk.usage.prompt_tokens == 300
            per_prompt[chunk.choices[0].index // n].add(chunk.usage.prompt_tokens_details.cached_tokens)
        else:  # the final usage: both prompts
            assert (chunk.usage.prompt_tokens, chunk.usage.prompt_tokens_details.cached_tokens) == (600, warm_hits)
    assert per_prompt == {0: {warm_hits}, 1: {0}}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n2_reports_the_first_copy_the_same_streamed_or_not(client, server, route, block) -> None:
    """Each prompt counts once, with what its first copy found: 0 cold, the full blocks warm.

    vLLM's own counter counts every copy, so the second copy's hits show there only.
    """
    def ask_n2(stream: bool, prompt: str):  # vLLM refuses n > 1 with greedy sampling
        return clients.ask(client, route, stream, prompt, model=model_id(client), max_tokens=2, n=2, temperature=1.0)

    for stream in (False, True):
        prompt = fresh_prompt()
        before = metric_value(clients.scrape(server), VLLM_CACHED)
        cold = ask_n2(stream, prompt)
        middle = metric_value(clients.scrape(server), VLLM_CACHED)
        warm = ask_n2(stream, prompt)
        after = metric_value(clients.scrape(server), VLLM_CACHED)

        full_blocks = warm_hit(cold.prompt_tokens, block)
        assert (stream, cold.prompt_tokens_details.cached_tokens) == (stream, 0)
        assert (stream, warm.prompt_tokens_details.cached_tokens) == (stream, full_blocks)
        assert after - middle == 2 * full_blocks  # vLLM: both copies hit
        assert middle - before in (0, full_blocks)  # vLLM: the second cold copy may hit the first


def _embeddings(rows: int) -> str:
    """``rows`` random embeddings for the default model (576 wide), as vLLM reads
    ``prompt_embeds``: a ``torch.save``d tensor in base64. Random, so no block is cached yet."""
    import torch  # vLLM's dependency: imported where the real engine runs

    buffer = io.BytesIO()
    torch.save(torch.randn(rows, 576) * 0.02, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_prompt_embeds_are_billed_like_token_ids(client, server, stream, block) -> None:
    """``prompt_embeds`` reach the prefill with no token ids, one token per row: billed there as
    a text prompt is, so ``n = 2`` reports its first copy, 0 cold, streamed or not (vLLM's JSON
    output carries the copy that finished last: the second's hit on the first's blocks)."""
    rows = 300
    embeds = _embeddings(rows)

    def ask_embeds(n: int):
        return clients.ask(client, "completions", stream, None, model=model_id(client), max_tokens=2, n=n,
                           temperature=1.0, extra_body={"prompt_embeds": embeds})

    cold = ask_embeds(2)
    middle = clients.scrape(server)
    warm = ask_embeds(1)
    after = clients.scrape(server)

    full_blocks = warm_hit(rows, block)
    assert (cold.prompt_tokens, warm.prompt_tokens) == (rows, rows)
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens_details.cached_tokens == full_blocks
    assert metric_value(after, VLLM_CACHED) - metric_value(middle, VLLM_CACHED) == full_blocks
    assert metric_value(after, "vllm:prompt_tokens_total") - metric_value(middle, "vllm:prompt_tokens_total") == rows


def test_client_dropping_mid_stream_aborts_the_engine_request(server, client, pace) -> None:
    async def drop() -> None:
        body = {
            "model": model_id(client),
            "messages": [{"role": "user", "content": fresh_prompt()}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=server, timeout=pace.timeout()) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    break  # first chunk in, then hang up

    asyncio.run(drop())
    deadline = time.monotonic() + pace.timeout()  # vLLM sees the abort at its next step
    while metric_value(text := clients.scrape(server), VLLM_RUNNING) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(text, VLLM_RUNNING) == 0, "vLLM still runs the abandoned request"
    assert metric_value(text, "cachetally_ledger_open_slots") == 0


def test_request_id_traces_response_and_engine(server, client, pace, block) -> None:
    prompt = fresh_prompt()
    ask(client, "chat", False, prompt)

    async def both() -> list[httpx.Response]:
        body = {"model": model_id(client), "messages": [{"role": "user", "content": prompt}], "max_tokens": 24}
        async with httpx.AsyncClient(base_url=server, timeout=pace.timeout(2)) as http:
            return await asyncio.gather(
                *(http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7"}) for _ in range(2))
            )

    responses = asyncio.run(both())
    for response in responses:
        assert response.headers["x-request-id"] == "trace-7"
        payload = orjson.loads(response.content)
        assert payload["id"].startswith("chatcmpl-trace-7")
        prompt_tokens = payload["usage"]["prompt_tokens"]
        # Same client id, two engine requests: each still gets its own exact value.
        assert payload["usage"]["prompt_tokens_details"]["cached_tokens"] == warm_hit(prompt_tokens, block)
    assert responses[0].json()["id"] != responses[1].json()["id"]


def test_metrics_and_stats_equal_what_responses_reported(server, client) -> None:
    before_text, before_stats = clients.scrape(server), httpx.get(f"{server}/stats").json()
    prompt = fresh_prompt()
    usages = [ask(client, route, stream, prompt) for route in ("chat", "completions") for stream in (False, True)]
    after_text, after_stats = clients.scrape(server), httpx.get(f"{server}/stats").json()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after_text, name, **labels) - metric_value(before_text, name, **labels)

    prompt_sum = sum(u.prompt_tokens for u in usages)
    cached_sum = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    hits = sum(u.prompt_tokens_details.cached_tokens > 0 for u in usages)
    assert delta("cachetally_prompt_tokens_total") == prompt_sum
    assert delta("cachetally_cached_tokens_total", source="engine", tier="all") == cached_sum
    # vLLM's scheduler split: everything came from the local (device) prefix cache here.
    assert delta("cachetally_cached_tokens_total", source="engine", tier="local") == cached_sum
    assert delta("cachetally_requests_total") == len(usages)
    assert delta("cachetally_requests_total", cache="hit") == hits
    assert delta("cachetally_request_cached_tokens_count") == len(usages)
    assert delta("cachetally_request_cached_tokens_sum") == cached_sum
    assert after_stats["total_requests"] - before_stats["total_requests"] == len(usages)
    assert after_stats["total_cached_tokens"] - before_stats["total_cached_tokens"] == cached_sum
    assert after_stats["total_prompt_tokens"] - before_stats["total_prompt_tokens"] == prompt_sum


def test_tier_details_on_request(server, client, pace) -> None:
    prompt = fresh_prompt()
    ask(client, "completions", False, prompt)
    body = {"model": model_id(client), "prompt": prompt, "max_tokens": 2, "return_cached_tokens_details": True}
    payload = httpx.post(f"{server}/v1/completions", json=body, timeout=pace.timeout()).json()
    cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert payload["cached_tokens_details"] == {"local": cached, "external": 0, "created": 0, "source": "engine"}


def test_bench_cache_against_the_embedded_engine(server, pace) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "proxy.server.cli", "bench", "cache", "--url", server, "--repeats", "2",
         "--prompt-tokens", "512", "--json"],
        capture_output=True,
        check=True,
        timeout=pace.timeout(20),  # six 512-token requests and a warm-up
    )
    report = orjson.loads(out.stdout)
    warm = [r for r in report["requests"] if r["kind"] == "warm"]
    assert len(warm) == 2 and all(r["cached_tokens"] > 0 for r in warm)
    assert report["summary"]["token_hit_rate"] > 0
    assert report["summary"]["ttft_warm_over_cold"] is not None  # the ratio itself is a benchmark, not a test


def test_vllm_routes_keep_working(server) -> None:
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"]
    tokens = httpx.post(f"{server}/tokenize", json={"model": models["data"][0]["id"], "prompt": "hello world"})
    assert tokens.status_code == 200 and tokens.json()["count"] >= 2
    assert httpx.get(f"{server}/health").status_code == 200
    text = clients.scrape(server)
    assert "cachetally_ledger_open_slots" in text and VLLM_CACHED.removesuffix("_total") in text
