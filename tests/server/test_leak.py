"""Abrupt client disconnects at every point of a request leave no ledger slot behind.

500 mixed requests (chat/completions x stream/non-stream) against `cachetally serve
--engine sim` on loopback; about 30% of the clients drop: halfway through sending the
body, right after sending it, after the response headers, mid-stream, between the last
token and the usage chunk, and after [DONE]. Afterwards `/metrics` shows
`cachetally_ledger_open_slots 0` within 2 s and `/health` answers 200.

The client and the request mix live in ``tests.load`` (shared with ``test_soak``).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.load import DROP_POINTS, gauge_reader, run_mix, settle
from tests.servers import running_server

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
