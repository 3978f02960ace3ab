"""Billing soak: a request mix with 50% abrupt disconnects, spread over three configured
tenants, unknown header values and no header at all, in sim and upstream mode (cachetally
in front of the standalone sim, which reports cached tokens), with JSONL usage records and
an OTLP collector on loopback, under an environment whose sampler samples nothing.

Hostile in the mix: half the requests carry an unsampled ``traceparent`` (flags ``00``),
one in five reuses an earlier request's ``X-Request-Id`` (some while it is still in
flight), a third write ``stream`` and ``include_usage`` as vLLM's lax booleans
(``"true"``, ``1``, ``"off"``...), and the clients that hang up before the headers hang up
during the sim's prefill time (its prompt announced, not yet scheduled). Each request has a
trace id of its own, which is how the oracle finds its record: a reused request id cannot
tell two requests apart.

After the run and a graceful stop:

- each request cut during the prefill is recorded ``disconnected`` with its cache unknown
  (``null``) and, in sim mode, the prompt the sim counts for its body (upstream mode: the
  upstream never answered, so ``null``); there are some in each mode;
- no ``record_id`` twice, in the files or at the collector; each request's record found
  exactly once in each, with the ``stream`` the lax value meant, the client's request id
  (a reused one suffixed only while the earlier is in flight), and the tenant its header
  asked for (unknown values: ``other``; none: ``default``);
- the records' prompt, cached and completion tokens per tenant, in the files and in the
  spans, equal the ``cachetally_*`` counters per tenant, scraped before the stop, but for
  the prompts whose cache is unknown, which the counters keep out of the token counters and
  count in ``cachetally_requests_total{cache="unknown"}`` (docs/ACCOUNTING.md);
- the counters' tenant labels stay within the configured three, ``other`` and ``default``;
- ``cachetally report --json`` on the records prints the same totals, and ``--plot``
  writes a PNG.

CI runs a few hundred requests per mode; ``CACHETALLY_SOAK=1`` runs 10,000
(docs/RELIABILITY.md has the command and the figures).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.sim import apis
from engine_adapter.sim.protocol import parse_request
from tests.load import DROP_POINTS, count, gauge_reader, log_failures, prepend, report, request_body, run_mix, settle
from tests.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.servers import ROOT, metric_value, running_server

pytestmark = pytest.mark.loopback

REQUESTS = count(300, 10_000)
TENANTS = ("alpha", "beta", "gamma")
LABELS = {*TENANTS, "other", "default"}
TOKEN_DELAY = "0.002"
#: Long beside the moment a client takes to hang up after its body (the "before-headers" point),
#: short enough to leave the run's length about as it was.
PREFILL_DELAY = "0.02"
ACCOUNTING = ["--tenant-header", "x-tenant", "--tenants", ",".join(TENANTS), "--usage-flush-interval", "0.2"]


PREAMBLES = [" ".join(f"p{k}w{j}" for j in range(40)) for k in range(4)]


#: What vLLM's pydantic models read as true and as false, besides JSON's own booleans.
LAX = {True: ["true", "True", "1", 1, "on", "yes", "t", "Y"], False: ["false", "0", 0, "off", "no", "F"]}


def body(rng: random.Random, route: str, stream: bool) -> bytes:
    """The load mix's request, behind one of a few shared preambles (the cache gets hits);
    one in three writes its booleans as lax values."""
    payload = orjson.loads(request_body(rng, route, stream))
    if rng.random() < 1 / 3:
        payload["stream"] = rng.choice(LAX[stream])
        if "stream_options" in payload:
            options = payload["stream_options"]
            options["include_usage"] = rng.choice(LAX[options["include_usage"]])
    prepend(payload, route, rng.choice(PREAMBLES))
    return orjson.dumps(payload)


def tenant_header(i: int) -> str | None:
    """Per request: a configured tenant, an unknown value, or no header (one in six)."""
    kind = i % 6
    if kind < 3:
        return TENANTS[kind]
    if kind < 5:
        return f"intruder-{i % 97}"
    return None


def expected_tenant(i: int) -> str:
    value = tenant_header(i)
    return "default" if value is None else value if value in TENANTS else "other"


def request_id(i: int) -> str:
    """Request ``i``'s ``X-Request-Id``: its own, or (one in five) an earlier request's, the
    one four before (often still in flight) or one far back."""
    if i % 10 == 4:
        return request_id(i - 4)
    if i % 10 == 9:
        return request_id(i // 2)
    return f"soak-{i}"


def trace_id(i: int) -> str:
    return f"{i + 1:032x}"


def traceparent(i: int) -> str:
    """Half unsampled (flags ``00``): billing data is not sampled away."""
    return f"00-{trace_id(i)}-{i + 1:016x}-{'00' if i % 2 == 0 else '01'}"


def stream_meant(raw: bytes) -> bool:
    value = orjson.loads(raw)["stream"]
    return value in LAX[True] or value is True


@contextlib.contextmanager
def accounting_server(mode: str, usage: Path, logs: Path, otlp: str) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        args = ["-m", "proxy.server.cli", "serve", "--log-level", "warning", "--usage-dir", str(usage),
                "--otlp-endpoint", otlp, *ACCOUNTING]
        env = {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}
        if mode == "sim":
            args += ["--engine", "sim"]
            env |= {"CACHETALLY_SIM_TOKEN_DELAY_S": TOKEN_DELAY, "CACHETALLY_SIM_PREFILL_DELAY_S": PREFILL_DELAY}
        else:
            # An upstream that reports cached_tokens, as vLLM with --enable-prompt-tokens-details:
            # without a number from anywhere a request's cache is unknown, and its prompt
            # tokens stay out of the counters (the hit rate is not diluted) but not out of
            # its record.
            sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--token-delay-s", TOKEN_DELAY,
                   "--prefill-delay-s", PREFILL_DELAY, "--report-cached-tokens"]
            sim_url, _ = stack.enter_context(running_server(sim, log_path=logs / "upstream-sim.log"))
            args += ["--upstream", sim_url]
        url, _ = stack.enter_context(running_server(args, env=env, log_path=logs / f"{mode}.log", timeout_s=30))
        yield url


#: Upstream mode: the routes whose streams cut before their usage have their prompt counted by
#: the upstream's /tokenize (docs/ACCOUNTING.md, "Usage records").
COUNTED_ROUTES = ("chat", "completions", "responses")


def sim_prompt_tokens(route: str, raw: bytes) -> int:
    """The prompt tokens the sim counts for a body (every prompt of it), by its own parser."""
    if route in ("responses", "messages"):
        return len(apis.parse(raw, route, "sim-model", 16).prompt)
    request = parse_request(raw, "chat" if route == "chat" else "completion", "sim-model", 16)
    return sum(len(prompt) for prompt in request.prompts)


def per_tenant(metrics: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names = {
        "cachetally_prompt_tokens_total": "prompt_tokens",
        "cachetally_cached_tokens_total": "cached_tokens",
        "cachetally_completion_tokens_total": "completion_tokens",
        "cachetally_requests_total": "requests",
    }
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name in names and s.labels.get("tier", "all") == "all":
                out[s.labels["tenant"]][names[s.name]] += s.value
            if s.name == "cachetally_requests_total" and s.labels["cache"] == "unknown":
                out[s.labels["tenant"]]["unknown_cache_requests"] += s.value
    return out


def one_per_request(found: list[tuple[str, str]]) -> dict[int, int]:
    """``(record_id, trace id)`` pairs, asserted to hold no record id twice and exactly one
    record per request; returns each request's position in ``found``."""
    record_ids = Counter(record_id for record_id, _ in found)
    assert [r for r, n in record_ids.items() if n > 1] == []
    by_request = Counter(trace for _, trace in found)
    assert sorted(by_request) == sorted(trace_id(i) for i in range(REQUESTS))
    assert set(by_request.values()) == {1}
    index = {trace_id(i): i for i in range(REQUESTS)}
    return {index[trace]: position for position, (_, trace) in enumerate(found)}


def span_sums(spans: list[ReceivedSpan]) -> dict[str, dict[str, float]]:
    names = {"gen_ai.usage.input_tokens": "prompt_tokens", "gen_ai.usage.cache_read.input_tokens": "cached_tokens",
             "gen_ai.usage.output_tokens": "completion_tokens"}
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for span in spans:
        for attribute, field in names.items():
            sums[span.attributes["cachetally.tenant"]][field] += span.attributes.get(attribute, 0)
    return sums


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["sim", "upstream"])
async def test_one_record_per_request_and_records_equal_the_counters(tmp_path: Path, mode: str) -> None:
    usage = tmp_path / "usage"
    sent: dict[int, bytes] = {}
    routes: dict[int, str] = {}

    def headers_for(i: int) -> dict[str, str]:
        value = tenant_header(i)
        return {"x-request-id": request_id(i), "traceparent": traceparent(i),
                **({"x-tenant": value} if value is not None else {})}

    def recording_body(rng: random.Random, route: str, stream: bool) -> bytes:
        routes[len(sent)] = route
        sent[len(sent)] = raw = body(rng, route, stream)  # run_mix draws the bodies in order
        return raw

    with otlp_receiver() as receiver:
        with accounting_server(mode, usage, tmp_path, receiver.url) as url:
            result = await run_mix(url, REQUESTS, 0.5, seed=1414, body=recording_body, headers_for=headers_for)
            assert await settle(gauge_reader(url, "cachetally_ledger_open_slots"), 0) == 0
            async with httpx.AsyncClient(timeout=10) as client:
                metrics = (await client.get(f"{url}/metrics")).text
        spans = receiver.snapshot()  # the graceful stop flushed the last batch
    assert not log_failures(tmp_path / f"{mode}.log")
    assert set(result.statuses) == {200}
    if REQUESTS >= 100:
        assert set(result.drops) == {point.name for point in DROP_POINTS}

    records = [orjson.loads(line) for path in sorted(usage.glob("*.jsonl")) for line in path.read_bytes().splitlines()]
    in_files = one_per_request([(r["record_id"], r["traceparent"].split("-")[1]) for r in records])
    cut_in_prefill = 0
    for i, position in in_files.items():
        record = records[position]
        assert record["traceparent"] == traceparent(i)
        assert record["tenant"] == expected_tenant(i)
        # A body cut in half was never read: nothing says it asked for a stream.
        half_body = result.dropped_at.get(i) == "half-body"
        assert record["stream"] == (False if half_body else stream_meant(sent[i])), (i, sent[i], record)
        # The client's id; a reused one gets a suffix only while another request holds it.
        assert record["request_id"] == request_id(i) or record["request_id"].startswith(f"{request_id(i)}.")
        if result.dropped_at.get(i) == "before-headers":
            # Gone during the prefill: announced, never scheduled, so the cache is unknown and
            # the prompt the sim's (upstream mode: nothing answered, so unknown, but for a chat,
            # completions or Responses stream the upstream started, whose prompt its /tokenize counts). A
            # server stalled past the prefill time sees it leave later: then its figures stand.
            unscheduled = record["cached_tokens"] is None
            prompt = None if unscheduled and mode == "upstream" else sim_prompt_tokens(routes[i], sent[i])
            if unscheduled and mode == "upstream" and record["source"] == "tokenize":
                # Asked only of a stream the upstream started; it may find the cap full (then unknown).
                assert record["status"] == 200 and routes[i] in COUNTED_ROUTES and stream_meant(sent[i]), (i, record)
                prompt = sim_prompt_tokens(routes[i], sent[i])
            # A client that stalls after its body for longer than its whole answer (a loaded
            # machine: seen once, ('completed', 126)) hangs up after the server sent the last
            # byte: it completed, with the sim's figures. Never one the engine did not schedule.
            outcome = "completed" if record["outcome"] == "completed" and not unscheduled else "disconnected"
            assert (record["outcome"], record["prompt_tokens"]) == (outcome, prompt), (i, record)
            cut_in_prefill += unscheduled
    assert cut_in_prefill > 0
    assert sum(r["request_id"] != request_id(i) for i, r in ((i, records[p]) for i, p in in_files.items())) < REQUESTS / 5
    at_collector = one_per_request([(s.attributes["cachetally.record_id"], s.trace_id) for s in spans])
    assert {s.attributes["cachetally.record_id"] for s in spans} == {r["record_id"] for r in records}
    for i, position in at_collector.items():
        span = spans[position]
        assert span.parent_span_id == f"{i + 1:016x}"
        assert span.attributes["cachetally.record_id"] == records[in_files[i]]["record_id"]

    counters = per_tenant(metrics)
    assert set(counters) <= LABELS and set(counters) >= set(TENANTS)
    # Scraped before the stop: the 0.2 s flushes had written all but the last few.
    assert 0 < metric_value(metrics, "cachetally_usage_records_written_total", sink="jsonl") <= REQUESTS
    assert 0 < metric_value(metrics, "cachetally_usage_records_written_total", sink="otlp") <= REQUESTS
    assert metric_value(metrics, "cachetally_usage_records_dropped_total") == 0
    from_spans = span_sums(spans)
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    # A prompt whose cache nobody knows is billed in its record, outside the token counters.
    unknown: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            known = field != "prompt_tokens" or r["cached_tokens"] is not None
            (sums if known else unknown)[r["tenant"]][field] += r[field] or 0
        unknown[r["tenant"]]["requests"] += r["cached_tokens"] is None and r["prompt_tokens"] is not None
    for tenant in LABELS:
        assert unknown[tenant]["requests"] == counters[tenant]["unknown_cache_requests"], tenant
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert sums[tenant][field] == counters[tenant][field], (tenant, field, dict(sums[tenant]), dict(counters[tenant]))
            in_spans = counters[tenant][field] + unknown[tenant][field]
            assert from_spans[tenant][field] == in_spans, (tenant, field)
    outcomes: dict[str, int] = defaultdict(int)
    for r in records:
        outcomes[r["outcome"]] += 1
    assert outcomes["disconnected"] > 0 and outcomes["completed"] >= sum(result.statuses.values())
    assert all(counters[t]["cached_tokens"] > 0 for t in TENANTS)

    # The report reads the same files back and agrees with the counters.
    png = tmp_path / f"usage-{mode}.png"
    prices = ROOT / "config" / "prices.example.toml"
    cli = [sys.executable, "-m", "proxy.server.cli", "report", str(usage), "--json", "--plot", str(png), "--prices", str(prices)]
    printed = json.loads(subprocess.run(cli, cwd=ROOT, capture_output=True, check=True, timeout=120).stdout)
    price = tomllib.loads(prices.read_text())["default"]  # read here, not by the report's own loader
    for tenant, totals in printed["tenants"].items():
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert totals[field] == counters[tenant][field] + unknown[tenant][field], (tenant, field)
        c = counters[tenant]
        from_counters = (  # a prompt whose cache is unknown: all of it uncached input
            (c["prompt_tokens"] + unknown[tenant]["prompt_tokens"] - c["cached_tokens"]) * price["input"]
            + c["cached_tokens"] * price["cached_input"]
            + c["completion_tokens"] * price["output"]
        ) / 1e6
        assert totals["cost"] == pytest.approx(from_counters, abs=1e-6)
    assert printed["records"] == REQUESTS and printed["skipped_lines"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report(
        f"billing-soak-{mode}",
        requests=REQUESTS,
        records=len(records),
        spans=len(spans),
        duplicates=len(records) - len({r["record_id"] for r in records}),
        reused_ids=sum(request_id(i) != f"soak-{i}" for i in range(REQUESTS)),
        suffixed=sum(records[p]["request_id"] != request_id(i) for i, p in in_files.items()),
        unsampled=sum(i % 2 == 0 for i in range(REQUESTS)),
        lax_stream=sum(not isinstance(orjson.loads(raw)["stream"], bool) for raw in sent.values()),
        outcomes=dict(outcomes),
        drops=sum(result.drops.values()),
        before_headers=sum(point == "before-headers" for point in result.dropped_at.values()),
        cut_in_prefill=cut_in_prefill,
        unknown_cache={t: int(unknown[t]["requests"]) for t in sorted(unknown)},
        tenants={t: {k: int(v) for k, v in counters[t].items()} for t in sorted(counters)},
        total=printed["total"],
    )
