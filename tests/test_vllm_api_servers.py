"""vLLM's own server with the middleware and ``--api-server-count 2``, on this CPU.

Two API server processes share one listening socket and one engine core; each builds its
own app, middleware and engine tap. vLLM then sets ``PROMETHEUS_MULTIPROC_DIR`` and its
``/metrics`` sums every process's files. The checks are the issue's acceptance: all four
paths exact (0 cold, the engine's value warm), continuous-usage chunks carrying
``cached_tokens``, and over a mixed run three equal sums: what responses reported,
vLLM's ``vllm:prompt_tokens_cached_total`` delta and ``cachetally_cached_tokens_total``'s.
``/stats`` agrees with ``/metrics`` whichever process answers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests import clients
from tests.clients import VLLM_CPU_BLOCK, fresh_prompt
from tests.servers import Pace, measure_pace, metric_value, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

VLLM_CACHED = "vllm:prompt_tokens_cached_total"
OURS = "cachetally_cached_tokens_total"


@dataclass
class Server:
    url: str
    log: Path
    pace: Pace
    model: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("api-servers") / "serve.log"
    args = ["-m", "proxy.cli", "serve", "--log-level", "debug", "--", "--api-server-count", "2"]
    with running_server(args, timeout_s=600, log_path=log) as (url, proc):
        children = psutil.Process(proc.pid).children(recursive=True)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield Server(url, log, measure_pace(url, model), model)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"processes left behind: {alive}"
    assert "Traceback" not in log.read_text(errors="replace"), f"a traceback in {log}"


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=server.pace.timeout(4)) as c:
        yield c


def ask(client: openai.OpenAI, server: Server, route: str, stream: bool, prompt: str):
    return clients.ask(client, route, stream, prompt, model=server.model, max_tokens=2, temperature=0)


def test_two_api_server_processes_each_tapped(server: Server) -> None:
    ready = re.findall(r"cachetally ready on .*API server pid (\d+) of 2", server.log.read_text(errors="replace"))
    assert len(set(ready)) == 2, ready


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_cold_zero_then_warm_equals_vllm_scheduler(client, server: Server, route: str, stream: bool) -> None:
    prompt = fresh_prompt()
    before = metric_value(clients.scrape(server.url), VLLM_CACHED)
    cold = ask(client, server, route, stream, prompt)
    middle = metric_value(clients.scrape(server.url), VLLM_CACHED)
    warm = ask(client, server, route, stream, prompt)
    after = metric_value(clients.scrape(server.url), VLLM_CACHED)
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert middle == before
    assert warm.prompt_tokens_details.cached_tokens == after - middle
    assert warm.prompt_tokens_details.cached_tokens == ((warm.prompt_tokens - 1) // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK


def test_continuous_usage_chunks_carry_cached_tokens(client, server: Server) -> None:
    prompt = fresh_prompt()
    ask(client, server, "chat", False, prompt)
    for route in ("chat", "completions"):
        kwargs = dict(model=server.model, max_tokens=4, stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
        if route == "chat":
            result = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
        else:
            result = client.completions.create(prompt=prompt, **kwargs)
        usages = [chunk.usage for chunk in result]
        assert len(usages) >= 3 and all(u is not None and u.prompt_tokens_details is not None for u in usages)
        if route == "chat":
            expected = ((usages[0].prompt_tokens - 1) // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK
            assert {u.prompt_tokens_details.cached_tokens for u in usages} == {expected}
        else:  # no chat template: a different prefix, cold
            assert {u.prompt_tokens_details.cached_tokens for u in usages} == {0}


def test_mixed_run_three_sums_equal_and_stats_agree_with_metrics(client, server: Server) -> None:
    shared = fresh_prompt(300)
    prompts = [fresh_prompt(), shared, shared + " and then more", shared, fresh_prompt(200), shared]
    jobs = [(route, i % 2 == 1, prompt) for i, prompt in enumerate(prompts) for route in ("chat", "completions")]
    before = clients.scrape(server.url)
    stats_before = httpx.get(f"{server.url}/stats").json()
    with ThreadPoolExecutor(4) as pool:  # several connections, so both processes answer
        usages = list(pool.map(lambda job: ask(client, server, *job), jobs))
    after = clients.scrape(server.url)
    reported = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert reported > 0
    assert reported == metric_value(after, VLLM_CACHED) - metric_value(before, VLLM_CACHED)
    assert reported == metric_value(after, OURS, tier="all") - metric_value(before, OURS, tier="all")
    # /stats: the same totals as /metrics, from whichever process answers each call.
    for _ in range(8):
        with httpx.Client() as fresh:  # a new connection each time
            stats = fresh.get(f"{server.url}/stats").json()
        assert stats["total_cached_tokens"] == metric_value(after, OURS, tier="all")
        assert stats["total_cached_tokens"] - stats_before["total_cached_tokens"] == reported
        assert stats["total_prompt_tokens"] - stats_before["total_prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    pids = set(re.findall(r"prefix cache stats: .* pid=(\d+)$", server.log.read_text(errors="replace"), re.M))
    assert len(pids) == 2, f"one process served every request: {pids}"
