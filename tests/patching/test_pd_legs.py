"""Disaggregated prefill/decode, counted once across the fleet (proxy.patching.pd_leg).

Two real ``cachetally serve --engine sim`` instances on loopback, a prefill one and a decode
one, each with usage records, and in the test the two legs a P/D router sends for each
client request, as vllm-router does: the prefill leg (``max_tokens`` 1, not streamed,
``kv_transfer_params.do_remote_decode``) to the prefill instance, then the client's own
request with ``kv_transfer_params.do_remote_prefill`` to the decode instance, both under
the client's request id. What the fleet must show is what one server would have shown:
one count and one record per client request, the tenant's cached tokens equal to what
the responses reported. tests/real_vllm/test_pd_vllm.py runs the same through vllm-router and two
vLLM instances with NixlConnector.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from engine_adapter.sim.tokenizer import render_chat, tokenize
from tests.otlp_receiver import otlp_receiver
from tests.servers import metric_value, running_servers

pytestmark = pytest.mark.loopback

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@contextlib.contextmanager
def pd_fleet(tmp_path: Path, *, pd_legs: bool = True,
             max_request_bytes: int = 32 << 20) -> Iterator[tuple[str, str]]:
    """(prefill URL, decode URL); both stopped, their records drained, on exit."""
    specs = []
    for name in ("prefill", "decode"):
        args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning",
                "--usage-dir", str(tmp_path / name), "--usage-flush-interval", "0.2"]
        env = {"CACHETALLY_PD_LEGS": "true" if pd_legs else "false", "CACHETALLY_SIM_TOKEN_DELAY_S": "0.005",
               "CACHETALLY_MAX_REQUEST_BYTES": str(max_request_bytes)}
        specs.append((args, env, None))
    with running_servers(specs) as ((prefill, _), (decode, _)):
        yield prefill, decode


def records(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in sorted(tmp_path.glob("*/*.jsonl")) for line in path.read_bytes().splitlines()]


def body_for(route: str, prompt: str, **extra: Any) -> dict[str, Any]:
    key = {"chat": "messages", "completions": "prompt"}[route]
    value = [{"role": "user", "content": prompt}] if route == "chat" else prompt
    return {key: value, "max_tokens": 4, **extra}


def routed(http: httpx.Client, fleet: tuple[str, str], route: str, body: dict[str, Any], request_id: str) -> httpx.Response:
    """One client request as a P/D router sends it: the prefill leg, then the decode leg."""
    prefill, decode = fleet
    headers = {"x-request-id": request_id}
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    leg |= {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    prefilled = http.post(f"{prefill}{PATHS[route]}", json=leg, headers=headers)
    prefilled.raise_for_status()
    params = prefilled.json()["kv_transfer_params"]  # as the router copies it into the decode leg
    return http.post(f"{decode}{PATHS[route]}", json=body | {"kv_transfer_params": params}, headers=headers)


def reported_cached(response: httpx.Response) -> int:
    if response.headers["content-type"].startswith("text/event-stream"):
        usages = [orjson.loads(line[6:])["usage"] for line in response.text.splitlines()
                  if line.startswith("data: {") and '"usage":{' in line.replace(" ", "")]
        usage = usages[-1]
    else:
        usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def fleet_value(urls: tuple[str, str], name: str, **labels: str) -> float:
    return sum(metric_value(httpx.get(f"{url}/metrics").text, name, **labels) for url in urls)


def test_six_client_requests_through_both_legs_are_six_counts_and_six_records(tmp_path: Path) -> None:
    prompts = [f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(40 + 10 * d)) for d in range(3)]
    plan = [  # (route, prompt, streamed): each prompt cold, then warm
        ("chat", 0, False), ("completions", 1, True), ("chat", 2, True),
        ("chat", 0, True), ("completions", 1, False), ("chat", 2, False),
    ]
    reported = []
    with pd_fleet(tmp_path) as fleet, httpx.Client(timeout=30) as http:
        for i, (route, d, streamed) in enumerate(plan):
            extra = {"stream": True, "stream_options": {"include_usage": True}} if streamed else {}
            response = routed(http, fleet, route, body_for(route, prompts[d], **extra), f"client-{i}")
            response.raise_for_status()
            reported.append(reported_cached(response))
        requests = fleet_value(fleet, "cachetally_requests_total", tenant="default")
        cached = fleet_value(fleet, "cachetally_cached_tokens_total", tier="all", tenant="default")
        legs = [fleet_value(fleet, "cachetally_pd_legs_total", leg=leg, outcome="completed")
                for leg in ("prefill", "decode")]
    assert reported[:3] == [0, 0, 0] and all(reported[3:]), reported  # the decode instance's own cache
    assert requests == 6
    assert cached == sum(reported)
    assert legs == [6, 6]
    found = records(tmp_path)
    assert sorted(r["request_id"] for r in found) == [f"client-{i}" for i in range(6)]
    assert all(r["outcome"] == "completed" and r["completion_tokens"] == 4 for r in found)
    assert [r["cached_tokens"] for r in sorted(found, key=lambda r: r["request_id"])] == reported
    assert not any(path.read_bytes() for path in (tmp_path / "prefill").glob("*.jsonl"))


def test_a_decode_leg_that_fails_after_its_prefill_leaves_one_record_with_its_outcome(tmp_path: Path) -> None:
    """One record each; a decode refused before its engine ran bills what its prefill computed
    (a client cannot have prompts prefilled and cached for nothing)."""
    with pd_fleet(tmp_path) as fleet, httpx.Client(timeout=30) as http:
        # max_tokens 0: the router's prefill leg (max_tokens 1) succeeds, the decode refuses it.
        refused = routed(http, fleet, "chat", body_for("chat", "one prompt here", max_tokens=0), "refused")
        assert refused.status_code == 400
        prefilled = (fleet_value(fleet, "cachetally_pd_prompt_tokens_total", leg="prefill"),
                     fleet_value(fleet, "cachetally_pd_cached_tokens_total", leg="prefill", tier="all"))
        # The client hangs up during the decode leg's stream.
        prefill, decode = fleet
        headers = {"x-request-id": "left"}
        leg = body_for("completions", "another prompt", max_tokens=1)
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        http.post(f"{prefill}/v1/completions", json=leg, headers=headers).raise_for_status()
        stream = body_for("completions", "another prompt", max_tokens=2000, stream=True,
                          kv_transfer_params={"do_remote_prefill": True})
        with http.stream("POST", f"{decode}/v1/completions", json=stream, headers=headers) as response:
            next(response.iter_lines())
        requests = fleet_value(fleet, "cachetally_requests_total")
        decode_legs = {o: fleet_value(fleet, "cachetally_pd_legs_total", leg="decode", outcome=o)
                       for o in ("error", "disconnected")}
    by_id = {r["request_id"]: r for r in records(tmp_path)}
    assert sorted(by_id) == ["left", "refused"]
    assert (by_id["refused"]["outcome"], by_id["refused"]["status"]) == ("error", 400)
    # Its prefill was computed and cached: billed with the prefill instance's own figures.
    assert (by_id["refused"]["prompt_tokens"], by_id["refused"]["cached_tokens"]) == prefilled
    assert prefilled[0] > 0
    assert by_id["left"]["outcome"] == "disconnected" and by_id["left"]["completion_tokens"] > 0
    assert requests == 2  # the stream the engine served, and the refused request's prefill
    assert decode_legs == {"error": 1, "disconnected": 1}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_decode_leg_the_router_made_too_large_still_bills_its_prefill(tmp_path: Path, declared: bool) -> None:
    """The router's decode leg is the client's body plus the prefill's ``kv_transfer_params``
    (on /v1/responses, the client's ``stream_options`` too, which its prefill leg loses), so it
    can pass ``max_request_bytes`` where the prefill leg did not. Refused, it bills its prefill."""
    limit = 8192
    with pd_fleet(tmp_path, max_request_bytes=limit) as (prefill, decode), httpx.Client(timeout=30) as http:
        body = body_for("chat", f"{uuid.uuid4().hex} prefilled for nothing " * 20, user="")
        leg = body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        leg["user"] = "u" * (limit - len(orjson.dumps(leg)))  # the prefill leg is at the limit
        headers = {"x-request-id": "grown", "content-type": "application/json"}
        prefilled = http.post(f"{prefill}/v1/chat/completions", content=orjson.dumps(leg), headers=headers)
        prefilled.raise_for_status()
        grown = orjson.dumps(leg | {"max_tokens": 4, "kv_transfer_params": prefilled.json()["kv_transfer_params"]})
        content = grown if declared else iter([grown[i : i + 1000] for i in range(0, len(grown), 1000)])
        refused = http.post(f"{decode}/v1/chat/completions", content=content, headers=headers)
        computed = (fleet_value((prefill, decode), "cachetally_pd_prompt_tokens_total", leg="prefill"),
                    fleet_value((prefill, decode), "cachetally_pd_cached_tokens_total", leg="prefill", tier="all"))
        requests = fleet_value((prefill, decode), "cachetally_requests_total", tenant="default")
        decode_legs = fleet_value((prefill, decode), "cachetally_pd_legs_total", leg="decode", outcome="error")
    assert refused.status_code == 413 and refused.json()["error"]["code"] == 413
    [record] = records(tmp_path)
    assert (record["request_id"], record["outcome"], record["status"]) == ("grown", "error", 413)
    assert (record["prompt_tokens"], record["cached_tokens"]) == computed
    assert computed[0] > 0
    assert (requests, decode_legs) == (1, 1)


def test_a_too_large_leg_whose_transfer_params_no_parser_reads_is_refused_413_and_recorded(tmp_path: Path) -> None:
    """A ``kv_transfer_params`` only the standard library reads (a ``NaN``) and nested deeper
    than it recurses, in a body over the limit: the value's read raised ``RecursionError``
    out of the request (a 500, and no 413). It is no leg: refused as too large, recorded."""
    limit = 8192
    deep = b"[" * 3000 + b"]" * 3000
    body = (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"x":NaN,"d":'
            + deep + b'},"user":"' + b"u" * limit + b'"}')
    with pd_fleet(tmp_path, max_request_bytes=limit) as (_, decode), httpx.Client(timeout=30) as http:
        refused = http.post(f"{decode}/v1/chat/completions", content=body,
                            headers={"x-request-id": "deep", "content-type": "application/json"})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == 413
    [record] = records(tmp_path)
    assert (record["request_id"], record["outcome"], record["status"]) == ("deep", "error", 413)


def test_without_pd_legs_a_body_claiming_to_be_a_prefill_leg_is_billed(tmp_path: Path) -> None:
    """A client cannot go unbilled by marking its own request as a prefill leg."""
    with pd_fleet(tmp_path, pd_legs=False) as (server, _), httpx.Client(timeout=30) as http:
        body = body_for("chat", "free tokens please", max_tokens=8, kv_transfer_params={"do_remote_decode": True})
        http.post(f"{server}/v1/chat/completions", json=body, headers={"x-request-id": "sly"}).raise_for_status()
        requests = metric_value(httpx.get(f"{server}/metrics").text, "cachetally_requests_total", tenant="default")
    assert requests == 1
    [record] = records(tmp_path)
    assert (record["request_id"], record["completion_tokens"]) == ("sly", 8)


def test_upstream_mode_hands_the_prefills_believed_usage_to_a_refused_decode(tmp_path: Path) -> None:
    """In front of P/D instances that report their usage (upstream mode, ``--pd-legs``), the
    prefill instance hands over its upstream's believed figures: a refused decode bills them."""
    sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]
    with running_servers([(sim, None, None)]) as ((engine, _),):
        specs = [(["-m", "proxy.server.cli", "serve", "--upstream", engine, "--log-level", "warning",
                   "--usage-dir", str(tmp_path / name), "--usage-flush-interval", "0.2"],
                  {"CACHETALLY_PD_LEGS": "true"}, None) for name in ("prefill", "decode")]
        with running_servers(specs) as ((prefill, _), (decode, _)), httpx.Client(timeout=30) as http:
            body = body_for("chat", f"{uuid.uuid4().hex} refused after its prefill", max_tokens=0)
            refused = routed(http, (prefill, decode), "chat", body, "refused")
            assert refused.status_code == 400
    prompt = len(tokenize(render_chat(body["messages"])))  # what the engine prefilled
    [record] = records(tmp_path)
    assert (record["outcome"], record["source"], record["prompt_tokens"], record["cached_tokens"]) \
        == ("error", "upstream", prompt, 0)
    assert prompt > 0


def test_figures_a_decode_leg_claims_never_replace_its_engines(tmp_path: Path) -> None:
    """A decode leg whose engine ran bills the engine's figures, whatever prefill figures its
    body carries; claims that are no counts are not read even when it did not run."""
    from proxy.patching.pd_leg import handed

    with pd_fleet(tmp_path) as (_, decode), httpx.Client(timeout=30) as http:
        params = {"do_remote_prefill": True,
                  "cachetally_prefill": {"prompt_tokens": 1, "cached_tokens": 1, "source": "engine"}}
        body = body_for("chat", "a claim of one token " * 8) | {"kv_transfer_params": params}
        http.post(f"{decode}/v1/chat/completions", json=body, headers={"x-request-id": "claims"}).raise_for_status()
    [record] = records(tmp_path)
    assert record["prompt_tokens"] > 40 and record["cached_tokens"] == 0
    for claim in ({"prompt_tokens": 5, "cached_tokens": 6}, {"prompt_tokens": -1, "cached_tokens": 0},
                  {"prompt_tokens": True, "cached_tokens": 0}, {"prompt_tokens": 5.0, "cached_tokens": 0},
                  {"prompt_tokens": 5, "cached_tokens": 0, "source": "client"},
                  {"prompt_tokens": 5, "cached_tokens": 0}, [5, 0], None):
        assert handed({"kv_transfer_params": {"do_remote_prefill": True, "cachetally_prefill": claim}}) is None


def test_a_decode_legs_claim_no_record_can_hold_loses_no_record(tmp_path: Path) -> None:
    """A refused decode leg whose body claims a prefill of 2**63 tokens: no OTLP span holds
    that, and one such record would fail the export of its whole batch. It is no count: the
    record has no prompt, and it and the request beside it both reach the collector."""
    claim = {"prompt_tokens": 1 << 63, "cached_tokens": 0, "source": "engine"}
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning",
            "--usage-dir", str(tmp_path / "decode"), "--usage-flush-interval", "0.2"]
    with otlp_receiver() as collector:
        with running_servers([([*args, "--otlp-endpoint", collector.url], {"CACHETALLY_PD_LEGS": "true"}, None)]) \
                as ((decode, _),), httpx.Client(timeout=30) as http:
            body = body_for("chat", "a huge claim", max_tokens=0) | {
                "kv_transfer_params": {"do_remote_prefill": True, "cachetally_prefill": claim}}
            refused = http.post(f"{decode}/v1/chat/completions", json=body, headers={"x-request-id": "huge"})
            assert refused.status_code == 400
            http.post(f"{decode}/v1/chat/completions", json=body_for("chat", "a fair one"),
                      headers={"x-request-id": "fair"}).raise_for_status()
        spans = collector.snapshot()
    by_id = {r["request_id"]: r for r in records(tmp_path)}
    assert (by_id["huge"]["outcome"], by_id["huge"]["prompt_tokens"]) == ("error", None)
    assert by_id["fair"]["prompt_tokens"] > 0
    assert sorted(span.attributes["cachetally.record_id"] for span in spans) == sorted(
        r["record_id"] for r in by_id.values())


@pytest.mark.parametrize(
    ("params", "leg"),
    [
        ({"do_remote_decode": True}, "prefill"),
        ({"do_remote_prefill": True, "remote_block_ids": []}, "decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, None),
        ({"do_remote_decode": "true"}, None),
        # vLLM reads the other marker by truthiness: these are decodes (or both) to it, never a free prefill
        ({"do_remote_decode": True, "do_remote_prefill": 1}, None),
        ({"do_remote_decode": True, "do_remote_prefill": "no"}, None),
        ({"do_remote_prefill": True, "do_remote_decode": [0]}, None),
        ({"do_remote_decode": True, "do_remote_prefill": 0}, "prefill"),
        ({}, None),
        ([], None),
    ],
)
def test_the_leg_is_read_from_kv_transfer_params_only(params: Any, leg: str | None) -> None:
    from proxy.patching.pd_leg import leg_of

    assert leg_of({"max_tokens": 1, "kv_transfer_params": params}) == leg
    assert leg_of({"max_tokens": 1}) is None


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("False", False), ("", False)])
def test_pd_legs_from_the_environment(value: str, expected: bool) -> None:
    from proxy.server.settings import Settings, load_settings, settings_environment

    settings = load_settings(env={"CACHETALLY_PD_LEGS": value})
    assert settings.pd_legs is expected
    # What `cachetally serve` hands vLLM's API server processes reads back the same.
    assert load_settings(env=settings_environment(settings)) == settings
    assert Settings().pd_legs is False


def test_a_pd_legs_value_that_is_no_boolean_is_refused() -> None:
    from proxy.server.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="pd_legs"):
        load_settings(env={"CACHETALLY_PD_LEGS": "prefill"})


@pytest.mark.parametrize("copies", [1, 2], ids=["n=1", "n=2"])
def test_a_decode_legs_transfer_and_own_hits_reach_their_counters(copies: int) -> None:
    """A disaggregated decode's ``cached_tokens`` are the prefill instance's hits; what it
    pulled over the connector is a transfer and what it found itself is its own local hits,
    each on its own ``cachetally_pd_*`` counter, for a one-copy request as for ``n > 1``."""
    from prometheus_client import CollectorRegistry

    from engine_adapter.events import Scheduled
    from proxy.patching.ledger import UsageLedger
    from proxy.patching.pd_leg import DECODE, LegMetrics

    registry, ledger = CollectorRegistry(), UsageLedger()
    ledger.open("k")
    for _ in range(copies):
        ledger.publish(Scheduled("k", 100, 60, transferred_tokens=80, decode_local_tokens=20))
    LegMetrics(registry).count(DECODE, "completed", ledger.close("k"))
    value = registry.get_sample_value
    assert value("cachetally_pd_transferred_tokens_total") == 80 * copies
    assert value("cachetally_pd_cached_tokens_total", {"leg": "decode", "tier": "local"}) == 20 * copies
    assert value("cachetally_pd_prompt_tokens_total", {"leg": "decode"}) == 100 * copies
    assert value("cachetally_pd_legs_total", {"leg": "decode", "outcome": "completed"}) == 1
