"""A routed fleet, as vLLM's users run one: two replicas of stock ``vllm serve`` with the
cachetally middleware, behind ``vllm-router`` (vLLM's Rust router, ``--policy cache_aware``).

Every response that comes back through the router must carry the exact ``cached_tokens``
of the replica that served it: 0 for a prompt no replica has seen, and for a repeat the
whole blocks that replica's scheduler found, in its own prefix cache or through the KV
connector below (cache_aware is a heuristic, the count is not).
Requests go one at a time (but for one pair), and both replicas' ``/metrics`` are read
directly around each, so the test knows which replica served it (its ``vllm:prompt_tokens_total`` moved by the response's ``prompt_tokens``)
and what that replica's scheduler counted. Over the whole run, the reported sum equals
the sum of both replicas' ``vllm:prompt_tokens_cached_total`` deltas, and the sum of
their ``cachetally_cached_tokens_total{tier="all"}`` deltas.

OpenAI Responses requests go through the router too (vllm-router 0.1.17 has no route for
Anthropic Messages), checked the same way against the replica that served each.

vllm-router 0.1.17 forwards ``stream_options`` with ``include_usage`` alone: through it,
a stream that asked for ``continuous_usage_stats`` gets the final usage chunk only. The
test therefore also sends such streams straight to a replica, where every chunk carries
the exact value.

With sequential requests and idle replicas, cache_aware sends a prompt it has no match
for to the first replica in its list; the test sends two cold prompts at once so that
both replicas serve.

The replicas start at once, each engine's OpenMP threads bound to a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` would bind both to the same core).

Both replicas share a KV store on disk (vLLM's ``ExampleConnector``, the reference KV
connector, which runs on CPU), as a fleet shares LMCache or an offload tier: a prompt one
replica computed is a KV connector hit on the other, vLLM's ``external`` tier. So a repeat
the router sends to the replica that never saw the prompt is not necessarily 0: that
replica's scheduler counts the connector's tokens as cached, and so does the test. The last
test checks the tiers themselves: cold, a connector hit and a local hit, against each
replica's own counters, in the response, on ``/metrics`` and in the usage records.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import psutil
import pytest

from engine_adapter.vllm.cpu import machine_flags
from engine_adapter.vllm.model_store import ensure_default_model
from engine_adapter.vllm.serve import SHUTDOWN_TIMEOUT_S
from tests import clients
from tests.clients import fresh_prompt
from tests.load import report
from tests.real_vllm.test_vllm_apis import responses_json, responses_sse
from tests.servers import (
    ENGINE_KV_FLAGS,
    TWO_ENGINES_FLAGS,
    Pace,
    assert_no_traceback_in_vllm_log,
    free_port,
    measure_pace,
    metric_value,
    running_servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

MODEL = "SmolLM2-135M-Instruct"
MIDDLEWARE = "proxy.vllm_middleware.CachetallyMiddleware"
VLLM_CACHED = "vllm:prompt_tokens_cached_total"
VLLM_PROMPT = "vllm:prompt_tokens_total"
OURS = "cachetally_cached_tokens_total"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def core_binds() -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each replica: half of this process's cores each."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None, None]  # one core: vLLM's own choice for both
    half = len(cores) // 2
    return [",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))]


@dataclass(frozen=True)
class Fleet:
    router: str
    replicas: tuple[str, str]
    pace: Pace
    usage: tuple[Path, Path]  # each replica's usage records
    block: int  # the replicas' prefix-cache block size, as their engines report it


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet")
    shared_kv = tmp_path_factory.mktemp("fleet-kv")
    usage = (tmp_path_factory.mktemp("fleet-usage-0"), tmp_path_factory.mktemp("fleet-usage-1"))
    # What an operator types: `vllm serve MODEL --middleware ...` with a KV connector, plus
    # the CPU flags, the tests' KV cache size and each replica's share of one GPU.
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(shared_kv)}}
    replica = [
        "-m", "engine_adapter.vllm.serve", str(ensure_default_model()), "--served-model-name", MODEL,
        "--middleware", MIDDLEWARE, "--enable-prefix-caching", "--host", "127.0.0.1",
        "--kv-transfer-config", orjson.dumps(connector).decode(),
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "warning",
        *ENGINE_KV_FLAGS, *TWO_ENGINES_FLAGS, *machine_flags(ENGINE_KV_FLAGS),
    ]
    specs = [
        (replica, {"CACHETALLY_USAGE_DIR": str(usage[i]), "CACHETALLY_USAGE_FLUSH_INTERVAL_S": "0.2"}
         | ({"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}), logs / f"replica-{i}.log")
        for i, bind in enumerate(core_binds())
    ]
    began = time.monotonic()
    with running_servers(specs, timeout_s=600) as replicas:
        report("fleet-start", replicas_healthy_s=round(time.monotonic() - began, 1))
        engines = [psutil.Process(proc.pid).children(recursive=True) for _, proc in replicas]
        assert all(engines), "each replica's engine core runs in a child process"
        urls = tuple(url for url, _ in replicas)
        router = [
            "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--policy", "cache_aware",
            "--worker-urls", *urls, "--worker-startup-check-interval", "1", "--disable-retries",
            "--prometheus-port", str(free_port()), "--log-level", "warning",
        ]
        with running_servers([(router, None, logs / "router.log")], timeout_s=120) as ((router_url, _),):
            pace = measure_pace(router_url, MODEL)
            report("fleet-pace", request_s=round(pace.request_s, 3))
            (block,) = {clients.engine_block_size(url) for url in urls}  # one flag set: one size
            yield Fleet(router_url, urls, pace, usage, block)  # type: ignore[arg-type]
    for log in logs.glob("replica-*.log"):  # the whole run, the stop included
        assert_no_traceback_in_vllm_log(log)
    for (_, proc), children in zip(replicas, engines, strict=True):
        assert proc.returncode in (0, -signal.SIGTERM), f"unclean exit {proc.returncode}"
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"engine processes left behind: {alive}"


def counters(url: str) -> tuple[float, float, float]:
    text = clients.scrape(url)
    return metric_value(text, VLLM_PROMPT), metric_value(text, VLLM_CACHED), metric_value(text, OURS, tier="all")


def sse_usages(text: str) -> list[dict]:
    """Every ``usage`` object of an SSE body, in order (the last is the final chunk's)."""
    usages = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            usage = orjson.loads(line[6:]).get("usage")
            if usage is not None:
                usages.append(usage)
    return usages


class Workload:
    """Sends requests through the router and checks each against both replicas' counters."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.client = openai.OpenAI(
            base_url=f"{fleet.router}/v1", api_key="unused", max_retries=0, timeout=fleet.pace.timeout(4)
        )
        self.http = httpx.Client(timeout=fleet.pace.timeout(4))
        self.reported = 0
        self.served_by: list[int] = []

    def send(self, how: str, route: str, prompt: str, *, cold: bool, via: str | None = None) -> int:
        """One request through the router (or straight to the replica ``via``), checked."""
        before = self._counters()
        usage = self._ask(how, route, prompt, via or self.fleet.router)
        (cached,) = self._check([usage], before, cold=cold, where=(how, route))
        return cached

    def send_cold_pair(self, route: str, first: str, second: str) -> None:
        """Two cold prompts, the second sent while the first still streams: vllm-router's
        cache_aware sends a prompt no replica has to the least loaded replica (the first
        in its list when all are idle), so the pair lands on both replicas."""
        before = self._counters()
        body = self._body(route, first) | {"max_tokens": 32, "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}}
        with self.http.stream("POST", f"{self.fleet.router}{PATHS[route]}", json=body) as response:
            response.raise_for_status()
            lines = response.iter_lines()
            head = [next(lines)]  # the replica has scheduled it: the router counts it as load
            other = self._ask("json", route, second, self.fleet.router)
            text = "\n".join([*head, *lines])
        usages = [sse_usages(text)[-1], other]
        self._check(usages, before, cold=True, where=("pair", route))
        assert len(set(self.served_by[-2:])) == 2, "the pair went to one replica"

    def _counters(self) -> list[tuple[float, float, float]]:
        return [counters(url) for url in self.fleet.replicas]

    def _check(self, usages: list[dict], before: list, *, cold: bool, where: tuple) -> list[int]:
        """Each response's cached_tokens is exactly what its replica's scheduler found."""
        after = self._counters()
        moved = [(a[0] - b[0], a[1] - b[1], a[2] - b[2]) for a, b in zip(after, before, strict=True)]
        where = (*where, moved)
        cached = []
        for usage in usages:
            prompt_tokens, value = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
            # Which replica served it: the one whose prompt-token counter moved by its size.
            (served,) = [i for i, (p, _, _) in enumerate(moved) if p == prompt_tokens]
            assert moved[served][1] == value == moved[served][2], (value, where)
            assert value % self.fleet.block == 0 and value < prompt_tokens, (value, where)
            if cold:
                assert value == 0, where
            moved[served] = (0, 0, 0)
            self.served_by.append(served)
            self.reported += value
            cached.append(value)
        assert moved == [(0, 0, 0)] * len(moved), where  # nothing else ran on either replica
        return cached

    @staticmethod
    def _body(route: str, prompt: str) -> dict:
        body: dict = {"model": MODEL, "max_tokens": 3, "temperature": 0}
        return body | ({"messages": [{"role": "user", "content": prompt}]} if route == "chat" else {"prompt": prompt})

    def _ask(self, how: str, route: str, prompt: str, base_url: str) -> dict:
        if route == "responses":  # the official client only; its usage in the chat shape
            ask = responses_sse if how == "openai-sse" else responses_json
            client = self.client.with_options(base_url=f"{base_url}/v1")
            size, cached, _ = ask(client, MODEL, prompt, uuid.uuid4().hex)
            return {"prompt_tokens": size, "prompt_tokens_details": {"cached_tokens": cached}}
        if how in ("openai", "openai-sse"):
            client = self.client.with_options(base_url=f"{base_url}/v1")
            usage = clients.ask(client, route, how == "openai-sse", prompt, model=MODEL, max_tokens=2, temperature=0)
            return usage.model_dump()
        body = self._body(route, prompt)
        if how == "json":
            response = self.http.post(f"{base_url}{PATHS[route]}", json=body)
            response.raise_for_status()
            return response.json()["usage"]
        continuous = how == "sse-continuous"
        body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
        response = self.http.post(f"{base_url}{PATHS[route]}", json=body)
        response.raise_for_status()
        usages = sse_usages(response.text)
        # vllm-router 0.1.17 forwards stream_options with include_usage only (its
        # StreamOptions has that one field), so through it a stream has one usage chunk.
        # Straight to a replica, every chunk carries one, each with the same exact value.
        if continuous and base_url != self.fleet.router:
            assert len(usages) >= 3, usages
        else:
            assert len(usages) == 1, usages
        assert len({u["prompt_tokens_details"]["cached_tokens"] for u in usages}) == 1, usages
        return usages[-1]

    def close(self) -> None:
        self.client.close()
        self.http.close()


def test_every_response_through_the_router_is_exact_and_sums_to_both_replicas(fleet: Fleet) -> None:
    before = [counters(url) for url in fleet.replicas]
    work = Workload(fleet)
    try:
        hows = ["openai", "openai-sse", "json", "sse", "sse-continuous"]
        documents = [fresh_prompt(100), fresh_prompt(120), fresh_prompt(90)]  # three lengths: the pair is told apart
        work.send_cold_pair("completions", documents[0], documents[1])
        work.send("sse", "chat", documents[2], cold=True)
        warm = []
        for d, document in enumerate(documents):
            route = ("completions", "completions", "chat")[d]
            # The same document again, then with a new question after it. Wherever the
            # router sends them, the number is what that replica found: the whole blocks
            # where the document was served before, 0 where it never was.
            warm.append(work.send(hows[d % len(hows)], route, document, cold=False))
            warm.append(work.send(hows[(d + 2) % len(hows)], route, f"{document} and then, item{d}?", cold=False))
        for i in range(4):  # distinct cold prompts, every shape
            work.send(hows[(i + 1) % len(hows)], ("chat", "completions")[i % 2], fresh_prompt(60 + 10 * i), cold=True)
        # Straight to each replica, the way a client inside the cluster may: continuous
        # usage chunks, all exact; the replica that has the document serves it warm.
        for d in (0, 1):
            hit = work.send("sse-continuous", "completions", documents[d], cold=False,
                            via=fleet.replicas[work.served_by[d]])
            assert hit > 0
    finally:
        work.close()
    after = [counters(url) for url in fleet.replicas]

    assert sum(warm) > 0, warm  # repeats found their blocks
    assert {0, 1} <= set(work.served_by)  # and both replicas served
    report("fleet", requests=len(work.served_by), per_replica=[work.served_by.count(i) for i in (0, 1)],
           warm=warm, cached_tokens=work.reported)
    vllm_total = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ours_total = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
    assert work.reported > 0
    assert work.reported == vllm_total == ours_total


def test_a_responses_request_through_the_router_is_exact(fleet: Fleet) -> None:
    """vllm-router 0.1.17 routes OpenAI's Responses API too (it has no route for Anthropic's
    Messages): cold 0, then, JSON and streamed, what the replica that served each repeat found."""
    work = Workload(fleet)
    try:
        document = fresh_prompt(100)
        work.send("openai", "responses", document, cold=True)
        warm = [work.send(how, "responses", document, cold=False) for how in ("openai-sse", "openai")]
    finally:
        work.close()
    # cache_aware sends a repeat where the document was served: the router's own promise,
    # checked here so that a warm 0 is known to be the router's choice, not a lost count.
    assert work.served_by[1:] == work.served_by[:1] * 2 and all(warm), (work.served_by, warm)


TIER_COUNTERS = {  # vLLM's own count of each tier, and cachetally's
    "local": ("vllm:prefix_cache_hits_total", {}), "external": ("vllm:external_prefix_cache_hits_total", {}),
    "ours_local": (OURS, {"tier": "local"}), "ours_external": (OURS, {"tier": "external"}),
    "ours_all": (OURS, {"tier": "all"}),
}


def tier_counters(url: str) -> dict[str, float]:
    text = clients.scrape(url)
    return {key: metric_value(text, name, **labels) for key, (name, labels) in TIER_COUNTERS.items()}


def recorded(usage: Path, response_id: str, timeout_s: float) -> dict:
    """The usage record of the response ``response_id``, once its replica has flushed it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for path in usage.glob("*.jsonl"):
            for line in path.read_bytes().splitlines():
                record = orjson.loads(line)
                if record.get("response_id") == response_id:
                    return record
        assert time.monotonic() < deadline, f"no record of {response_id}"
        time.sleep(0.1)


def test_a_prompt_one_replica_computed_is_a_kv_connector_hit_on_the_other(fleet: Fleet) -> None:
    """Cold on replica 0, then on replica 1 from the shared KV store (external), then from
    replica 1's own prefix cache (local): the response, its tiers, ``/metrics`` and the
    record each say what that replica's scheduler counted, tier by tier."""
    # Token ids: a length whose whole blocks the reference connector finds (it looks up
    # the prompt less its last token, so a length of k blocks + 1 would find nothing).
    size = 300
    prompt = random.Random(uuid.uuid4().int).sample(range(1000, 40000), size)
    blocks = clients.warm_hit(size, fleet.block)
    seen = []
    for step, replica in (("cold", 0), ("external", 1), ("local", 1)):
        url = fleet.replicas[replica]
        before = tier_counters(url)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=fleet.pace.timeout(2)) as client:
            response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                                 extra_body={"return_cached_tokens_details": True})
        after = tier_counters(url)
        moved = {key: after[key] - before[key] for key in after}
        cached = response.usage.prompt_tokens_details.cached_tokens
        details = response.model_extra["cached_tokens_details"]
        record = recorded(fleet.usage[replica], response.id, fleet.pace.timeout())
        where = (step, cached, details, moved)
        assert response.usage.prompt_tokens == size, where
        expected = {"cold": (0, 0), "external": (0, blocks), "local": (blocks, 0)}[step]
        assert (details["local"], details["external"]) == expected, where
        assert (moved["local"], moved["external"]) == expected, where  # what vLLM counted
        assert (moved["ours_local"], moved["ours_external"]) == expected, where
        assert cached == sum(expected) == moved["ours_all"], where
        assert (record["cached_tokens"], record["local_cached_tokens"], record["external_cached_tokens"]) == (
            cached, *expected), (where, record)
        assert details["created"] == record["cache_creation_tokens"], (where, record)
        seen.append(details["created"])
    # The cold prefill wrote its whole blocks; the hits wrote nothing.
    assert seen == [blocks, 0, 0], seen
