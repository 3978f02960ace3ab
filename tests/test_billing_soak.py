"""Billing soak: a request mix with 50% abrupt disconnects, spread over three configured
tenants, unknown header values and no header at all, in sim and upstream mode (cachetally
in front of the standalone sim, which reports cached tokens), with JSONL usage records on.

After the run and a graceful stop:

- exactly one record per request sent, none twice (matched by ``X-Request-Id``), each
  with the tenant its header asked for (unknown values: ``other``; none: ``default``);
- the records' prompt, cached and completion tokens per tenant equal the
  ``cachetally_*`` counters per tenant, scraped before the stop;
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
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.accounting.records.report import PriceList
from tests.load import DROP_POINTS, count, gauge_reader, log_failures, prepend, report, request_body, run_mix, settle
from tests.servers import ROOT, metric_value, running_server

pytestmark = pytest.mark.loopback

REQUESTS = count(300, 10_000)
TENANTS = ("alpha", "beta", "gamma")
LABELS = {*TENANTS, "other", "default"}
TOKEN_DELAY = "0.002"
ACCOUNTING = ["--tenant-header", "x-tenant", "--tenants", ",".join(TENANTS), "--usage-flush-interval", "0.2"]


PREAMBLES = [" ".join(f"p{k}w{j}" for j in range(40)) for k in range(4)]


def body(rng: random.Random, route: str, stream: bool) -> bytes:
    """The load mix's request, behind one of a few shared preambles: the cache gets hits."""
    payload = orjson.loads(request_body(rng, route, stream))
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


@contextlib.contextmanager
def accounting_server(mode: str, usage: Path, logs: Path) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        args = ["-m", "proxy.server.cli", "serve", "--log-level", "warning", "--usage-dir", str(usage), *ACCOUNTING]
        env = {}
        if mode == "sim":
            args += ["--engine", "sim"]
            env["CACHETALLY_SIM_TOKEN_DELAY_S"] = TOKEN_DELAY
        else:
            # An upstream that reports cached_tokens, as vLLM with --enable-prompt-tokens-details:
            # without a number from anywhere a request's cache is unknown, and its prompt
            # tokens stay out of the counters (the hit rate is not diluted) but not out of
            # its record.
            sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--token-delay-s", TOKEN_DELAY,
                   "--report-cached-tokens"]
            sim_url, _ = stack.enter_context(running_server(sim, log_path=logs / "upstream-sim.log"))
            args += ["--upstream", sim_url]
        url, _ = stack.enter_context(running_server(args, env=env, log_path=logs / f"{mode}.log", timeout_s=30))
        yield url


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
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["sim", "upstream"])
async def test_one_record_per_request_and_records_equal_the_counters(tmp_path: Path, mode: str) -> None:
    usage = tmp_path / "usage"
    ids = [uuid.uuid4().hex for _ in range(REQUESTS)]

    def headers_for(i: int) -> dict[str, str]:
        value = tenant_header(i)
        return {"x-request-id": ids[i], **({"x-tenant": value} if value is not None else {})}

    with accounting_server(mode, usage, tmp_path) as url:
        result = await run_mix(url, REQUESTS, 0.5, seed=1414, body=body, headers_for=headers_for)
        assert await settle(gauge_reader(url, "cachetally_ledger_open_slots"), 0) == 0
        async with httpx.AsyncClient(timeout=10) as client:
            metrics = (await client.get(f"{url}/metrics")).text
    assert not log_failures(tmp_path / f"{mode}.log")
    assert set(result.statuses) == {200}
    if REQUESTS >= 100:
        assert set(result.drops) == {point.name for point in DROP_POINTS}

    records = [orjson.loads(line) for path in sorted(usage.glob("*.jsonl")) for line in path.read_bytes().splitlines()]
    seen = [r["request_id"] for r in records]
    assert len(seen) == len(set(seen)) == REQUESTS  # exactly one record per request
    assert set(seen) == set(ids)
    index = {rid: i for i, rid in enumerate(ids)}
    assert all(r["tenant"] == expected_tenant(index[r["request_id"]]) for r in records)

    counters = per_tenant(metrics)
    assert set(counters) <= LABELS and set(counters) >= set(TENANTS)
    # Scraped before the stop: the 0.2 s flushes had written all but the last few.
    assert 0 < metric_value(metrics, "cachetally_usage_records_written_total", sink="jsonl") <= REQUESTS
    assert metric_value(metrics, "cachetally_usage_records_dropped_total") == 0
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            sums[r["tenant"]][field] += r[field] or 0
    for tenant in LABELS:
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert sums[tenant][field] == counters[tenant][field], (tenant, field, dict(sums[tenant]), dict(counters[tenant]))
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
    price = PriceList.load(prices).default
    assert price is not None
    for tenant, totals in printed["tenants"].items():
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert totals[field] == counters[tenant][field], (tenant, field)
        c = counters[tenant]
        from_counters = (
            (c["prompt_tokens"] - c["cached_tokens"]) * price.input
            + c["cached_tokens"] * price.cached_input
            + c["completion_tokens"] * price.output
        ) / 1e6
        assert totals["cost"] == pytest.approx(from_counters, abs=1e-6)
    assert printed["records"] == REQUESTS and printed["skipped_lines"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report(
        f"billing-soak-{mode}",
        requests=REQUESTS,
        records=len(records),
        outcomes=dict(outcomes),
        drops=sum(result.drops.values()),
        tenants={t: {k: int(v) for k, v in counters[t].items()} for t in sorted(counters)},
        total=printed["total"],
    )
