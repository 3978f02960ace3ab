"""Normalization of each engine's own cached-token report (``source=upstream``).

The response shapes come from each engine's serving code; the fixture files name the
sources (``tests/fixtures/upstream/<engine>.json``). Every case is checked three ways:
what the readers see, what :class:`~proxy.patching.usage.UsagePatch` writes, and what a client
gets from cachetally in upstream mode in front of a fake upstream sending those bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from starlette.requests import Request
from starlette.responses import Response

from proxy.patching.usage import ResponseUsage, UsagePatch
from proxy.patching.vendor_usage import reported_cached_tokens
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from proxy.upstream.engine import UpstreamEngine
from tests.servers import metric_value
from tests.upstream_fakes import AsgiClient

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "upstream"
ENGINES = ("vllm", "sglang", "llama_cpp", "trtllm", "lmdeploy", "ollama")


def load(engine: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{engine}.json").read_text())
    return data


CASES = [
    pytest.param(engine, case, id=f"{engine}: {case['name']}")
    for engine in ENGINES
    for case in load(engine)["cases"]
]


def payloads(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of the JSON objects of a case: its body, or its SSE events (not ``[DONE]``)."""
    objects = [case["json"]] if "json" in case else case["sse"]
    return [copy.deepcopy(o) for o in objects if isinstance(o, dict)]


def sse_bytes(events: list[Any]) -> bytes:
    return b"".join(
        b"data: " + (event.encode() if isinstance(event, str) else orjson.dumps(event)) + b"\n\n"
        for event in events
    )


def with_usage(objects: list[Any]) -> list[dict[str, Any]]:
    return [o for o in objects if isinstance(o, dict) and isinstance(o.get("usage"), dict)]


def test_one_fixture_per_engine_with_sources() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(ENGINES)
    for engine in ENGINES:
        data = load(engine)
        assert data["engine"] == engine
        assert data["sources"] and all(isinstance(s, str) and s for s in data["sources"])
        assert data["cases"]


@pytest.mark.parametrize(("engine", "case"), CASES)
def test_readers_see_the_engines_own_number(engine: str, case: dict[str, Any]) -> None:
    seen = [reported_cached_tokens(p) for p in with_usage(payloads(case))]
    assert seen == case["reported"]


@pytest.mark.parametrize(("engine", "case"), CASES)
def test_patch_writes_the_standard_field(engine: str, case: dict[str, Any]) -> None:
    seen = ResponseUsage()
    objects = with_usage(payloads(case))
    for payload in objects:
        UsagePatch(engine=None, missing="zero").apply(payload, seen)
    final = objects[-1]["usage"]
    assert final["prompt_tokens_details"]["cached_tokens"] == case["cached_tokens"]
    assert type(final["prompt_tokens_details"]["cached_tokens"]) is int
    assert seen.source == case["source"]
    assert seen.cached_tokens == case["cached_tokens"]


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_omit_leaves_unreported_bodies_alone(engine: str) -> None:
    for case in load(engine)["cases"]:
        if case["source"] is not None or "json" not in case:
            continue
        body = copy.deepcopy(case["json"])
        assert UsagePatch(engine=None, missing="omit").apply(body, ResponseUsage()) is None
        assert body == case["json"]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}, None),
        ({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}, None),
        ({"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}}, None),
        ({"usage": {"prompt_tokens_details": {"cached_tokens": 1.0}}}, None),
        ({"usage": {"prompt_tokens_details": []}}, None),
        ({"usage": None, "timings": {"cache_n": 7}}, 7),
        # The standard field wins over vendor fields when both are present.
        ({"usage": {"prompt_tokens_details": {"cached_tokens": 10}}, "timings": {"cache_n": 20}}, 10),
        (
            {"usage": {}, "sglext": {"cached_tokens_details": {"device": 3, "host": 4}}, "timings": {"cache_n": 1}},
            7,
        ),
        # A malformed tier makes the whole SGLang breakdown unusable, never a partial sum.
        ({"usage": {}, "sglext": {"cached_tokens_details": {"device": 3}}}, None),
        ({"usage": {}, "sglext": {"cached_tokens_details": {"device": 3, "host": 1, "storage": -2}}}, None),
        ({"usage": {}, "sglext": {"routed_experts": "AAAA"}}, None),
        ({"usage": {}, "timings": {"cache_n": False}}, None),
        ({"usage": {}, "timings": [1, 2]}, None),
    ],
)
def test_reader_edge_cases(payload: dict[str, Any], expected: int | None) -> None:
    assert reported_cached_tokens(payload) == expected


# -- the same fixtures through cachetally in upstream mode, in process -------------------


def fake_upstream(case: dict[str, Any]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        await request.body()
        if "json" in case:
            response = Response(orjson.dumps(case["json"]), media_type="application/json")
        else:
            response = Response(sse_bytes(case["sse"]), media_type="text/event-stream")
        await response(scope, receive, send)

    return app


@pytest_asyncio.fixture
async def proxied() -> AsyncIterator[Any]:
    """Start cachetally in upstream mode in front of a fake upstream; yield a client factory."""
    started: list[Any] = []

    async def make(case: dict[str, Any]) -> tuple[httpx.AsyncClient, CachetallyApp]:
        settings = Settings(engine="upstream", upstream="http://fake-upstream:9").validate()
        upstream = fake_upstream(case)
        app = CachetallyApp(settings, engine_factory=lambda sink: UpstreamEngine(settings, lambda origin: AsgiClient(upstream, origin)))
        running = app.running()
        await running.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cachetally")
        started.append((running, client))
        return client, app

    yield make
    for running, client in started:
        await client.aclose()
        await running.__aexit__(None, None, None)


@pytest.mark.asyncio
@pytest.mark.parametrize(("engine", "case"), CASES)
async def test_client_gets_the_normalized_value_through_the_proxy(
    proxied: Any, engine: str, case: dict[str, Any]
) -> None:
    client, app = await proxied(case)
    stream = "sse" in case
    body: dict[str, Any] = {"model": "m", "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["messages" if case["route"].endswith("chat/completions") else "prompt"] = (
        [{"role": "user", "content": "hi"}] if case["route"].endswith("chat/completions") else "hi"
    )
    resp = await client.post(case["route"], json=body)
    assert resp.status_code == 200
    if stream:
        objects = [
            orjson.loads(line[len(b"data: ") :])
            for line in resp.content.split(b"\n\n")
            if line.startswith(b"data: {")
        ]
        assert resp.content.endswith(b"data: [DONE]\n\n")
    else:
        objects = [resp.json()]
    final = with_usage(objects)[-1]["usage"]
    assert final["prompt_tokens_details"]["cached_tokens"] == case["cached_tokens"]
    metrics = app.metrics.exposition().decode()
    outcome = "unknown" if case["source"] is None else ("hit" if case["cached_tokens"] else "miss")
    assert f'cache="{outcome}"' in metrics, metrics
    if case["source"] == "upstream" and case["cached_tokens"]:
        cached = metric_value(metrics, "cachetally_cached_tokens_total", source="upstream", tier="all")
        assert cached == case["cached_tokens"]
