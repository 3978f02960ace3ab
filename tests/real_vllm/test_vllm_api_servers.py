"""vLLM's own server with the middleware and ``--api-server-count 2``, on this CPU.

The shared ``vllm_server`` (tests/conftest.py) runs that way, so tests/real_vllm/test_vllm.py's
checks (all four paths exact, 0 cold and the engine's value warm, n > 1, request ids,
the sum against vLLM's counter) already run across two API server processes. Here is what
only several processes can get wrong: that each process tapped its own engine client and
answered requests, continuous-usage chunks on both routes, the three sums over a mixed
concurrent run (what responses reported, vLLM's ``vllm:prompt_tokens_cached_total`` delta,
``cachetally_cached_tokens_total``'s, the last two summed by prometheus_client's
multiprocess mode), and ``/stats`` agreeing with ``/metrics`` whichever process answers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests import clients
from tests.clients import fresh_prompt, warm_hit
from tests.servers import Pace, metric_value

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

VLLM_CACHED = "vllm:prompt_tokens_cached_total"
OURS = "cachetally_cached_tokens_total"


@pytest.fixture
def client(vllm_server: str, vllm_pace: Pace) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0,
                       timeout=vllm_pace.timeout(4)) as c:
        yield c


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(client: openai.OpenAI, route: str, stream: bool, prompt: str):
    return clients.ask(client, route, stream, prompt, model=model_id(client), max_tokens=2, temperature=0)


def stats_line_pids(log: Path) -> set[str]:
    return set(re.findall(r"prefix cache stats: .* pid=(\d+)$", log.read_text(errors="replace"), re.M))


def test_each_api_server_process_tapped_its_own_engine_client(vllm_server: str, vllm_server_log: Path) -> None:
    # /health answers once one process serves the shared socket; the other may still be
    # starting (its lifespan taps its engine client), so its ready line may come later.
    deadline = time.monotonic() + 120
    while True:
        text = vllm_server_log.read_text(errors="replace")
        ready = set(re.findall(r"cachetally ready on .*API server pid (\d+) of 2", text))
        if len(ready) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(ready) == 2, ready


def test_continuous_usage_chunks_carry_cached_tokens(client, vllm_block: int) -> None:
    prompt = fresh_prompt()
    ask(client, "chat", False, prompt)
    for route in ("chat", "completions"):
        kwargs = dict(model=model_id(client), max_tokens=4, stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
        if route == "chat":
            result = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
        else:
            result = client.completions.create(prompt=prompt, **kwargs)
        usages = [chunk.usage for chunk in result]
        assert len(usages) >= 3 and all(u is not None and u.prompt_tokens_details is not None for u in usages)
        if route == "chat":
            expected = warm_hit(usages[0].prompt_tokens, vllm_block)
            assert {u.prompt_tokens_details.cached_tokens for u in usages} == {expected}
        else:  # no chat template: a different prefix, cold
            assert {u.prompt_tokens_details.cached_tokens for u in usages} == {0}


def test_mixed_run_three_sums_equal_and_stats_agree_with_metrics(client, vllm_server: str, vllm_server_log: Path) -> None:
    shared = fresh_prompt(200)
    prompts = [fresh_prompt(), shared, shared + " and then more", shared, fresh_prompt(120), shared]
    jobs = [(route, i % 2 == 1, prompt) for i, prompt in enumerate(prompts) for route in ("chat", "completions")]
    before = clients.scrape(vllm_server)
    stats_before = httpx.get(f"{vllm_server}/stats").json()
    with ThreadPoolExecutor(4) as pool:  # several connections, so both processes answer
        usages = list(pool.map(lambda job: ask(client, *job), jobs))
    after = clients.scrape(vllm_server)
    reported = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert reported > 0
    assert reported == metric_value(after, VLLM_CACHED) - metric_value(before, VLLM_CACHED)
    assert reported == metric_value(after, OURS, tier="all") - metric_value(before, OURS, tier="all")
    # /stats: the same totals as /metrics, from whichever process answers each call.
    for _ in range(8):
        with httpx.Client() as fresh:  # a new connection each time
            stats = fresh.get(f"{vllm_server}/stats").json()
        assert stats["total_cached_tokens"] == metric_value(after, OURS, tier="all")
        assert stats["total_cached_tokens"] - stats_before["total_cached_tokens"] == reported
        assert stats["total_prompt_tokens"] - stats_before["total_prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert len(stats_line_pids(vllm_server_log)) == 2, "one process served every request"
