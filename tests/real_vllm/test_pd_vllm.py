"""Disaggregated prefill/decode as vLLM's users run it, on CPU: two ``vllm serve`` instances
with the cachetally middleware and ``NixlConnector`` (KV moved over NIXL's UCX backend in
host memory), behind ``vllm-router --vllm-pd-disaggregation``; the official ``openai``
client in front; usage records on both instances.

The router sends every client request twice under its request id: a prefill leg
(``max_tokens`` 1, ``kv_transfer_params.do_remote_decode``) to the prefill instance, then
the client's request with ``do_remote_prefill`` and the prefill's block ids to the decode
instance, which pulls the KV instead of computing it. vLLM's decode reports the prefill's
hits as ``cached_tokens`` (``remote_prefill_cached_tokens``), while its own
``vllm:prompt_tokens_cached_total`` counts the whole transferred prompt. What must hold
(proxy.patching.pd_leg, docs/ACCOUNTING.md): every response reports exactly what the prefill
instance's scheduler found (0 cold), and across both instances cachetally counts and
records each client request once, with those figures.

Each engine's OpenMP threads are bound to a core of its own (tests/real_vllm/test_fleet.py): a
decode leg waits on a prefill engine, and with both engines on one core each slows the
other's every step.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from datetime import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tests.real_vllm.test_fleet import MIDDLEWARE, MODEL, core_binds, sse_usages

pytestmark = [pytest.mark.vllm, pytest.mark.loopback]

#: vLLM's recommended roles (``kv_both`` works too, and is deprecated).
NIXL = '{"kv_connector":"NixlConnector","kv_role":"%s","kv_buffer_device":"cpu"}'
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
VLLM_CACHED = "vllm:prompt_tokens_cached_total"


@dataclass(frozen=True)
class PD:
    router: str
    prefill: str
    decode: str
    usage: Path
    pace: Pace

    def records(self, since: float) -> list[dict[str, Any]]:
        """Both instances' usage records of requests that started at ``since`` or later.

        vllm-router gives both legs an id of its own (``___prefill_addr_...``), not the
        client's, so a test knows its records by when they started (tests run one at a time).
        """
        lines = [line for path in sorted(self.usage.glob("*/*.jsonl")) for line in path.read_bytes().splitlines()]
        return [r for r in map(orjson.loads, lines) if datetime.fromisoformat(r["start_time"]).timestamp() >= since]

    def settled_records(self, since: float, expected: int) -> list[dict[str, Any]]:
        """The records once ``expected`` have been written, and a few flushes more."""
        deadline = time.monotonic() + self.pace.timeout()
        while len(self.records(since)) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # five flush intervals: a record that should not exist has been written by now
        return self.records(since)


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    assert importlib.util.find_spec("nixl") is not None, "NIXL is missing: scripts/setup installs the extra cachetally[pd]"
    logs = tmp_path_factory.mktemp("pd")
    serve = [
        "-m", "engine_adapter.vllm.serve", str(ensure_default_model()), "--served-model-name", MODEL,
        "--middleware", MIDDLEWARE, "--enable-prefix-caching", "--host", "127.0.0.1",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "warning",
        *ENGINE_KV_FLAGS, *TWO_ENGINES_FLAGS, *machine_flags(ENGINE_KV_FLAGS),
    ]
    specs = []
    for role, bind in zip(("prefill", "decode"), core_binds(), strict=True):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "CACHETALLY_PD_LEGS": "true",
               "CACHETALLY_USAGE_DIR": str(logs / "usage" / role), "CACHETALLY_USAGE_FLUSH_INTERVAL_S": "0.2"}
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        specs.append(([*serve, "--kv-transfer-config", NIXL % ROLES[role]], env, logs / f"{role}.log"))
    began = time.monotonic()
    with running_servers(specs, timeout_s=600) as instances:
        report("pd-start", instances_healthy_s=round(time.monotonic() - began, 1))
        engines = [psutil.Process(proc.pid).children(recursive=True) for _, proc in instances]
        (prefill, _), (decode, _) = instances
        router = [
            "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--vllm-pd-disaggregation",
            "--prefill", prefill, "--decode", decode, "--policy", "round_robin",
            "--worker-startup-check-interval", "1", "--disable-retries",
            "--prometheus-port", str(free_port()), "--log-level", "warning",
        ]
        with running_servers([(router, None, logs / "router.log")], timeout_s=120) as ((router_url, _),):
            pace = measure_pace(router_url, MODEL)
            report("pd-pace", request_s=round(pace.request_s, 3))
            yield PD(router_url, prefill, decode, logs / "usage", pace)
    for role in ("prefill", "decode"):  # the whole run, the stop included
        log = logs / f"{role}.log"
        assert_no_traceback_in_vllm_log(log)
    for (_, proc), children in zip(instances, engines, strict=True):
        assert proc.returncode in (0, -signal.SIGTERM), f"unclean exit {proc.returncode}"
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"engine processes left behind: {alive}"


def fleet_counters(pd: PD) -> dict[str, float]:
    prefill, decode = clients.scrape(pd.prefill), clients.scrape(pd.decode)
    both = (prefill, decode)
    return {
        "prefill_vllm_cached": metric_value(prefill, VLLM_CACHED),
        "prefill_vllm_prompt": metric_value(prefill, "vllm:prompt_tokens_total"),
        "decode_vllm_cached": metric_value(decode, VLLM_CACHED),
        "requests": sum(metric_value(t, "cachetally_requests_total", tenant="default") for t in both),
        "cached": sum(metric_value(t, "cachetally_cached_tokens_total", tier="all", tenant="default") for t in both),
        "prefill_legs": sum(metric_value(t, "cachetally_pd_legs_total", leg="prefill") for t in both),
        "decode_legs": sum(metric_value(t, "cachetally_pd_legs_total", leg="decode") for t in both),
        # The legs' own tiers: the prefill's hits, and what the decode found or was sent.
        "prefill_all": metric_value(prefill, "cachetally_pd_cached_tokens_total", leg="prefill", tier="all"),
        "prefill_local": metric_value(prefill, "cachetally_pd_cached_tokens_total", leg="prefill", tier="local"),
        "prefill_external": metric_value(prefill, "cachetally_pd_cached_tokens_total", leg="prefill", tier="external"),
        "decode_local": metric_value(decode, "cachetally_pd_cached_tokens_total", leg="decode", tier="local"),
        "transferred": metric_value(decode, "cachetally_pd_transferred_tokens_total"),
    }


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


def test_each_client_request_reports_the_prefills_hits_and_is_counted_and_recorded_once(pd: PD) -> None:
    client = openai.OpenAI(base_url=f"{pd.router}/v1", api_key="unused", max_retries=0, timeout=pd.pace.timeout(4))
    http = httpx.Client(timeout=pd.pace.timeout(4))
    documents = [fresh_prompt(100), fresh_prompt(120), fresh_prompt(140)]
    plan = [  # (document, route, how): each cold, then warm; JSON and SSE, through the openai client and raw
        (0, "chat", "openai"), (1, "completions", "openai-sse"), (2, "chat", "raw-sse"),
        (0, "chat", "openai-sse"), (1, "completions", "openai"), (2, "chat", "raw-sse"),
    ]
    reported: list[int] = []
    since, start = time.time(), fleet_counters(pd)
    try:
        for i, (d, route, how) in enumerate(plan):
            before = fleet_counters(pd)
            if how == "raw-sse":
                body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": documents[d]}]}
                response = http.post(f"{pd.router}/v1/chat/completions", json=body)
                response.raise_for_status()
                (usage,) = sse_usages(response.text)
            else:
                usage = clients.ask(client, route, how == "openai-sse", documents[d], model=MODEL, max_tokens=3,
                                    temperature=0).model_dump()
            step = moved(before, fleet_counters(pd))
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            # Exactly what the prefill instance's scheduler found; 0 for a document never seen.
            assert cached == step["prefill_vllm_cached"], (i, usage, step)
            assert cached == 0 if i < 3 else cached > 0, (i, usage, step)
            # The decode pulled the prompt's KV; vLLM's own decode counter calls that a hit.
            assert step["decode_vllm_cached"] > cached, (i, usage, step)
            assert (step["requests"], step["cached"], step["prefill_legs"], step["decode_legs"]) == (1, cached, 1, 1)
            # Tiers: the prefill's hits by tier; on the decode, its own hits plus the transfer
            # are what vLLM's decode counter calls cached.
            assert step["prefill_all"] == step["prefill_local"] + step["prefill_external"] == cached, step
            assert step["decode_local"] + step["transferred"] == step["decode_vllm_cached"], step
            reported.append(cached)
    finally:
        client.close()
        http.close()
    total = moved(start, fleet_counters(pd))
    report("pd", reported=reported, prefill_vllm_cached=total["prefill_vllm_cached"],
           decode_vllm_cached=total["decode_vllm_cached"])
    assert sum(reported) == total["prefill_vllm_cached"] == total["cached"] > 0
    assert total["requests"] == 6
    records = pd.settled_records(since, 6)
    assert len(records) == 6 and len({r["request_id"] for r in records}) == 6, records
    assert all(r["outcome"] == "completed" and r["status"] == 200 for r in records)
    assert sorted(r["cached_tokens"] for r in records) == sorted(reported)


def test_a_decode_leg_that_fails_after_its_prefill_leaves_one_record_with_its_outcome(pd: PD) -> None:
    """``max_tokens`` past the context: the router's prefill leg (``max_tokens`` 1) is served,
    and the decode instance refuses the client's own request. The prefill was computed and
    cached, so the record bills it, with the prefill instance's figures (vLLM's own counters
    there say the same), and the request is counted once."""
    since, before = time.time(), fleet_counters(pd)
    with openai.OpenAI(base_url=f"{pd.router}/v1", api_key="unused", max_retries=0,
                       timeout=pd.pace.timeout(2)) as client, pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt=fresh_prompt(100), max_tokens=1_000_000)
    assert refused.value.status_code == 400
    step = moved(before, fleet_counters(pd))
    assert (step["prefill_legs"], step["decode_legs"], step["requests"]) == (1, 1, 1), step
    (record,) = pd.settled_records(since, 1)
    assert (record["outcome"], record["status"], record["completion_tokens"]) == ("error", 400, 0)
    assert (record["prompt_tokens"], record["cached_tokens"]) == (step["prefill_vllm_prompt"], step["prefill_vllm_cached"])
    assert record["prompt_tokens"] > 100
