"""Abrupt client disconnects at every point of a request leave no ledger slot behind.

500 mixed requests (chat/completions x stream/non-stream) against `cachetally serve
--engine sim` on loopback; about 30% of the clients drop: halfway through sending the
body, right after sending it, after the response headers, mid-stream, between the last
token and the usage chunk, and after [DONE]. Afterwards `/metrics` shows
`cachetally_ledger_open_slots 0` within 2 s and `/health` answers 200.

A slot the size cap evicts while its request runs keeps its key: another tenant's request
reusing that `X-Request-Id` is given a key of its own, and each is billed its own figures.

The client and the request mix live in ``tests.load`` (shared with ``test_soak``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.sim import SimEngine
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.load import DROP_POINTS, gauge_reader, run_mix, settle
from tests.servers import metric_value, running_server, serving_in_thread

pytestmark = pytest.mark.loopback

REQUESTS = 500
DROP_SHARE = 0.3


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args, env={"CACHETALLY_SIM_TOKEN_DELAY_S": "0.002"}) as (url, _):
        yield url


@pytest.mark.asyncio
async def test_500_requests_with_30_percent_drops_leave_no_slot(server: str) -> None:
    result = await run_mix(server, REQUESTS, DROP_SHARE, seed=20261122)
    assert set(result.statuses) == {200}
    assert sum(result.drops.values()) > REQUESTS * DROP_SHARE * 0.8
    assert set(result.drops) == {point.name for point in DROP_POINTS}
    assert await settle(gauge_reader(server, "cachetally_ledger_open_slots"), 0, timeout_s=2.0) == 0
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{server}/health")).status_code == 200


@pytest.mark.asyncio
async def test_the_gauge_counts_a_stream_while_it_runs_and_not_after(server: str) -> None:
    read_gauge = gauge_reader(server, "cachetally_ledger_open_slots")
    assert await settle(read_gauge, 0) == 0
    body = {"max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "count"}]}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{server}/v1/chat/completions", json=body) as response:
            chunks = response.aiter_bytes()
            await anext(chunks)  # the stream has begun; 400 tokens at 2 ms each are still to come
            assert await read_gauge() == 1
            async for _ in chunks:
                pass
    assert await settle(read_gauge, 0, timeout_s=2.0) == 0



class GatedSim(SimEngine):
    """The sim, holding the answer of a request sent with ``x-gate: NAME`` (its figures
    already in the ledger) until the test opens that gate."""

    async def start(self) -> ASGIApp:
        app = await super().start()
        self.loop = asyncio.get_running_loop()
        self.gates = {name: asyncio.Event() for name in ("acme", "globex")}

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            gate = self.gates.get(dict(scope["headers"]).get(b"x-gate", b"").decode())

            async def held(message: Message) -> None:
                if gate is not None and message["type"] == "http.response.start":
                    await gate.wait()
                await send(message)

            await app(scope, receive, held)

        return gated

    def open_gate(self, name: str) -> None:
        self.loop.call_soon_threadsafe(self.gates[name].set)


def test_a_slot_the_cap_evicted_keeps_its_key_from_another_tenants_request(tmp_path: Path) -> None:
    """The size cap evicts a live slot, counted; its key stays its request's until that ends.
    Given out again, the evicted request's end closed the newcomer's slot: acme was billed
    globex's prompt and cache hits, and globex was told and billed none."""
    keys = tmp_path / "keys.toml"
    keys.write_text('"sk-acme" = "acme"\n"sk-globex" = "globex"\n')
    keys.chmod(0o600)
    usage = tmp_path / "usage"
    settings = Settings(engine="sim", ledger_max_slots=1, api_keys_file=str(keys), usage_dir=str(usage),
                        usage_flush_interval_s=0.05).validate()
    app = CachetallyApp(settings, engine_factory=GatedSim)
    engine = app.engine
    assert isinstance(engine, GatedSim)
    shared = "a prompt globex has sent before " * 8

    def chat(client: httpx.Client, key: str, request_id: str, prompt: str, gate: str = "") -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        headers = {"authorization": f"Bearer {key}", "x-request-id": request_id, "x-gate": gate}
        return client.post("/v1/chat/completions", json=body, headers=headers).json()["usage"]

    def one_slot_open(client: httpx.Client) -> None:
        deadline = time.monotonic() + 5
        while metric_value(client.get("/metrics").text, "cachetally_ledger_open_slots") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with serving_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client, ThreadPoolExecutor(2) as pool:
        chat(client, "sk-globex", "warm", shared)
        acme = pool.submit(chat, client, "sk-acme", "x", "acme's own prompt", "acme")
        one_slot_open(client)  # acme's figures are in its slot
        chat(client, "sk-globex", "z", "another")  # its slot evicts acme's
        globex = pool.submit(chat, client, "sk-globex", "x", shared, "globex")  # acme's id, while acme runs
        one_slot_open(client)
        engine.open_gate("acme")
        told = {"acme": acme.result()}
        engine.open_gate("globex")
        told["globex"] = globex.result()
        metrics = client.get("/metrics").text
    records = [orjson.loads(line) for f in usage.glob("*.jsonl") for line in f.read_bytes().splitlines()]
    assert metric_value(metrics, "cachetally_ledger_evicted_total", reason="cap") == 1
    billed = {r["tenant"]: (r["prompt_tokens"], r["cached_tokens"]) for r in records
              if r["request_id"] not in ("warm", "z")}
    told_figures = {t: (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for t, u in told.items()}
    # Acme's figures went with its slot: its prompt as its response said, its hits unknown; never globex's.
    assert billed["acme"] == (told_figures["acme"][0], None)
    assert told_figures["globex"][1] > 0  # globex's hit, told to globex
    assert billed["globex"] == told_figures["globex"]
    for tenant in told:
        cached = sum(r["cached_tokens"] or 0 for r in records if r["tenant"] == tenant)
        assert cached == metric_value(metrics, "cachetally_cached_tokens_total", tenant=tenant, tier="all")
