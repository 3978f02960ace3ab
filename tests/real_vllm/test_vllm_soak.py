"""The disconnect soak (tests/server/test_soak.py) on the shared vLLM server: after each
round no ledger slot is open and vLLM runs no request."""

from __future__ import annotations

import random

import httpx
import orjson
import psutil
import pytest

from tests.load import count, request_body
from tests.server.test_soak import SHARES, Server, soak_rounds
from tests.servers import Pace

pytestmark = pytest.mark.loopback

VLLM_REQUESTS = count(40, 1_000)
VLLM_CONCURRENCY = 8


@pytest.mark.vllm
@pytest.mark.asyncio
@pytest.mark.parametrize("share", SHARES)
async def test_vllm_mode_leaves_nothing_behind(vllm_server: str, vllm_pace: Pace, share: float) -> None:
    async with httpx.AsyncClient(timeout=vllm_pace.timeout()) as client:
        model = (await client.get(f"{vllm_server}/v1/models")).json()["data"][0]["id"]
    port = int(vllm_server.rsplit(":", 1)[1])
    pid = next(
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid
    )

    def body(rng: random.Random, route: str, stream: bool) -> bytes:
        payload = orjson.loads(request_body(rng, route, stream, max_tokens=8, words=60))
        return orjson.dumps({**payload, "model": model, "temperature": 0})

    # The shared server's log goes to pytest's stderr, so it is not grepped here
    # (test_engine_death runs its own vLLM server with a captured log).
    # A request may wait behind every other one in flight: the timeout scales with that.
    await soak_rounds(
        Server(vllm_server, pid, None, "vllm"), VLLM_REQUESTS, share,
        timeout_s=vllm_pace.timeout(VLLM_CONCURRENCY), body=body, concurrency=VLLM_CONCURRENCY,
    )
