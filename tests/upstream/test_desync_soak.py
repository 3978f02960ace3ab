"""Desync soak: through the real proxy, no request's bytes reach the upstream inside another's.

``cachetally serve --upstream`` (a subprocess) fronts the h11 upstream of
``tests.h11_upstream``. 30% of the requests are partial uploads to ``/v1/files`` (a
pass-through route) that the upstream answers at once with 413, without reading the
body, and whose clients then abort. The rest are chat requests, interleaved with them,
each carrying a unique marker that the upstream echoes. Every chat request must get
exactly its own marker back, h11 must parse every chat request as a request of its own
and never fail to parse, and no upload may reach the upstream complete.

CI runs 300 requests; ``CACHETALLY_SOAK=1`` runs 10,000 (docs/RELIABILITY.md has the
figures; ``CACHETALLY_FIGURES=FILE`` appends them to ``FILE``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path

import httpx
import orjson
import pytest

from tests.h11_upstream import H11Upstream
from tests.load import count, gauge_reader, log_failures, report, settle
from tests.servers import running_server_beside

pytestmark = pytest.mark.loopback

REQUESTS = count(300, 10_000)
UPLOAD_SHARE = 0.3
CONCURRENCY = 32


async def partial_upload(port: int, rng: random.Random) -> int | None:
    """Declare 64 KiB, send a part, wait for the early answer or not, then abort. The status seen, if any."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        declared = 65536
        head = (
            b"POST /v1/files HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/octet-stream\r\n"
            b"content-length: %d\r\n\r\n" % declared
        )
        # The part sent looks like a request of its own: if it ever became one, h11 would say so.
        part = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" * rng.randrange(1, 40)
        writer.write(head + part[: declared - 1])
        await writer.drain()
        if rng.random() < 0.5:
            try:  # the early answer's status line
                line = await asyncio.wait_for(reader.readline(), 5)
            except TimeoutError:
                return -1
            return int(line.split()[1]) if line else None
        return None
    finally:
        writer.transport.abort()  # leave mid-upload, without a goodbye


async def chat(client: httpx.AsyncClient, marker: str) -> str:
    """'own', 'other' (another request's marker came back) or 'lost' (no answer with a marker)."""
    body = {"model": "echo", "messages": [{"role": "user", "content": marker}]}
    try:
        response = await client.post("/v1/chat/completions", content=orjson.dumps(body),
                                      headers={"content-type": "application/json"})
        content = response.json()["choices"][0]["message"]["content"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "lost"
    return "own" if content == marker else "other"


@pytest.mark.asyncio
async def test_chat_requests_get_their_own_marker_among_aborted_early_answered_uploads(tmp_path: Path) -> None:
    upstream = H11Upstream()
    log = tmp_path / "proxy.log"
    rng = random.Random(12)
    plan = ["upload" if rng.random() < UPLOAD_SHARE else "chat" for _ in range(REQUESTS)]
    outcomes: dict[str, int] = {}
    early_seen: dict[str, int] = {}
    async with upstream.serving() as upstream_port:
        args = ["-m", "proxy.server.cli", "serve", "--upstream", f"http://127.0.0.1:{upstream_port}",
                "--log-level", "warning"]
        async with running_server_beside(args, log_path=log) as (url, _):
            port = int(url.rsplit(":", 1)[1])
            limit = asyncio.Semaphore(CONCURRENCY)
            limits = httpx.Limits(max_connections=CONCURRENCY, keepalive_expiry=1.0)
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

                async def one(kind: str) -> None:
                    async with limit:
                        if kind == "upload":
                            status = await partial_upload(port, rng)
                            key = {None: "left before it", -1: "no answer in 5 s"}.get(status, str(status))
                            early_seen[key] = early_seen.get(key, 0) + 1
                        else:
                            result = await chat(client, f"marker-{uuid.uuid4().hex}")
                            outcomes[result] = outcomes.get(result, 0) + 1

                await asyncio.gather(*(one(kind) for kind in plan))
            elapsed = time.monotonic() - started
            checked_out = await settle(gauge_reader(url, "cachetally_upstream_connections_checked_out"), 0)
    chats = plan.count("chat")
    # cachetally's own GET /v1/models (proxy.patching.served_models) is no client's request.
    forwarded = [r for r in upstream.requests if r.target != b"/v1/models"]
    parsed_chats = sum(1 for r in forwarded if r.target == b"/v1/chat/completions")
    figures = dict(
        requests=REQUESTS, chats=chats, uploads=REQUESTS - chats, chat_outcomes=outcomes,
        upload_answers=early_seen, upstream_parse_errors=len(upstream.errors),
        upstream_chat_requests=parsed_chats, upstream_complete_uploads=len(forwarded) - parsed_chats,
        upstream_connections=upstream.connections, checked_out_after=checked_out, seconds=round(elapsed, 1),
    )
    report("desync-soak", **figures)
    assert outcomes == {"own": chats}, figures
    assert upstream.errors == [], upstream.errors[:5]
    assert parsed_chats == chats and len(forwarded) == chats, figures
    assert set(early_seen) <= {"413", "left before it"}, early_seen
    assert checked_out == 0
    assert not log_failures(log), log_failures(log)[:5]
