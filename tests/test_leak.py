"""Abrupt client disconnects at every point of a request leave no ledger slot behind.

500 mixed requests (chat/completions x stream/non-stream) against `cachetally serve
--engine sim` on loopback; about 30% of the clients drop: halfway through sending the
body, right after sending it, after the response headers, mid-stream, between the last
token and the usage chunk, and after [DONE]. Afterwards `/metrics` shows
`cachetally_ledger_open_slots 0` within 2 s and `/health` answers 200.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.servers import metric_value, running_server

pytestmark = pytest.mark.loopback

REQUESTS = 500
DROP_SHARE = 0.3
# Where a dropping client hangs up: (name, bytes to wait for before closing, send half the body)
DROP_POINTS = [
    ("half-body", None, True),
    ("after-request", None, False),
    ("after-headers", b"\r\n\r\n", False),
    ("mid-stream", b"tok2", False),
    ("before-usage", b'"finish_reason":"length"', False),
    ("after-done", b"[DONE]", False),
]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    args = ["-m", "proxy.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args, env={"CACHETALLY_SIM_TOKEN_DELAY_S": "0.002"}) as (url, _):
        yield url


def request_body(rng: random.Random, route: str, stream: bool) -> bytes:
    prompt = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(20, 300)))
    body: dict = {"max_tokens": 12, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": rng.random() < 0.7}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return orjson.dumps(body)


async def dropping_client(port: int, path: str, body: bytes, wait_for: bytes | None, half: bool) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        writer.write(head + (body[: len(body) // 2] if half else body))
        await writer.drain()
        seen = b""
        while wait_for is not None and wait_for not in seen:
            chunk = await reader.read(65536)
            if not chunk:
                break
            seen += chunk
    finally:
        writer.transport.abort()  # hang up without a goodbye


@pytest.mark.asyncio
async def test_500_requests_with_30_percent_drops_leave_no_slot(server: str) -> None:
    rng = random.Random(20261122)
    port = int(server.rsplit(":", 1)[1])
    limit = asyncio.Semaphore(32)
    statuses: list[int] = []
    drops: dict[str, int] = {}

    async with httpx.AsyncClient(base_url=server, timeout=30) as client:

        async def one(i: int) -> None:
            route = rng.choice(["chat", "completions"])
            stream = rng.random() < 0.5
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            body = request_body(rng, route, stream)
            drop = DROP_POINTS[rng.randrange(len(DROP_POINTS))] if rng.random() < DROP_SHARE else None
            async with limit:
                if drop is not None:
                    drops[drop[0]] = drops.get(drop[0], 0) + 1
                    await dropping_client(port, path, body, drop[1], drop[2])
                    return
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
                statuses.append(response.status_code)

        await asyncio.gather(*(one(i) for i in range(REQUESTS)))

        assert set(statuses) == {200}
        assert sum(drops.values()) > REQUESTS * DROP_SHARE * 0.8
        assert set(drops) == {name for name, _, _ in DROP_POINTS}

        deadline = time.monotonic() + 2.0
        while True:
            open_slots = metric_value((await client.get("/metrics")).text, "cachetally_ledger_open_slots")
            if open_slots == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert open_slots == 0
        assert (await client.get("/health")).status_code == 200
