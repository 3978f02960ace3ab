"""Clients that send most of a large body and stop cannot make the server hold more than
``max_request_bytes_held`` of them (proxy.patching.body_budget), over real HTTP, in sim and
upstream modes, with the server's memory read from /proc.

Twenty clients each announce an 8 MiB body and send 7 MiB of it. Before the budget, the server
held all of them (140 MiB more; 580 MiB for twenty 29 MiB bodies); now it holds what fits in
16 MiB and answers the rest 503 with ``Retry-After``, in OpenAI's error JSON, each counted in
``cachetally_request_bodies_refused_total``. Once the holders are done, bodies that fill the
budget exactly are served: nothing was kept for the refused ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.servers import metric_value, running_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MIB = 1 << 20
LIMIT, HELD = 8 * MIB, 16 * MIB
SENT = 7 * MIB
CLIENTS = 20
SIM = ["-m", "engine_adapter.sim", "--log-level", "warning"]
ENV = {"CACHETALLY_MAX_REQUEST_BYTES": str(LIMIT), "CACHETALLY_MAX_REQUEST_BYTES_HELD": str(HELD)}


def body_of(size: int) -> bytes:
    """A completions body of exactly ``size`` bytes, most of it JSON whitespace."""
    head = b'{"prompt": "hello", "max_tokens": 2'
    return head + b" " * (size - len(head) - 1) + b"}"


@pytest.fixture(scope="module", params=["sim", "upstream"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    serve = ["-m", "proxy.server.cli", "serve", "--log-level", "warning"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with contextlib.ExitStack() as stack:
        if request.param == "sim":
            args = [*serve, "--engine", "sim"]
        else:
            upstream, _ = stack.enter_context(running_server(SIM))
            args = [*serve, "--upstream", upstream]
        url, proc = stack.enter_context(running_server(args, env=ENV, log_path=log))
        yield url, proc.pid, log


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Uploader:
    """One client: a request head announcing ``LIMIT`` bytes, then ``SENT`` of them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.answer = b""

    async def start(self, port: int) -> bool:
        """Whether the server took the body (True) or answered at once."""
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % LIMIT)
        with contextlib.suppress(TimeoutError):
            self.answer = await asyncio.wait_for(self.read_answer(), 2)
            return False
        self.writer.write(body_of(LIMIT)[:SENT])
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self.writer.drain(), 30)
        return True

    async def finish(self) -> bytes:
        self.writer.write(body_of(LIMIT)[SENT:])
        await self.writer.drain()
        return await asyncio.wait_for(self.read_answer(), 30)

    async def read_answer(self) -> bytes:
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        return head + await self.reader.readexactly(length)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.loopback
@pytest.mark.asyncio
async def test_bodies_still_arriving_are_held_only_up_to_the_budget(server: tuple[str, int, Path]) -> None:
    url, pid, log = server
    port = int(url.rsplit(":", 1)[1])
    before_refused = metric_value(httpx.get(f"{url}/metrics").text, "cachetally_request_bodies_refused_total")
    rss_before = rss_mib(pid)
    clients = [Uploader(*await asyncio.open_connection("127.0.0.1", port)) for _ in range(CLIENTS)]
    try:
        took = [await c.start(port) for c in clients]  # one after the other: each sees the others' bodies
        grown = rss_mib(pid) - rss_before
        holders = [c for c, t in zip(clients, took, strict=True) if t]
        refused = [c for c, t in zip(clients, took, strict=True) if not t]

        assert len(holders) * SENT <= HELD and refused, (len(holders), grown)
        assert grown < 64, f"{grown:.0f} MiB more for {len(holders)} bodies held of {CLIENTS} sent"
        for c in refused:
            head, _, body = c.answer.partition(b"\r\n\r\n")
            assert status_of(head) == 503 and b"\r\nretry-after: 1" in head.lower()
            assert orjson.loads(body)["error"]["type"] == "ServiceUnavailableError"
        text = httpx.get(f"{url}/metrics").text
        assert metric_value(text, "cachetally_request_bodies_refused_total") - before_refused == len(refused)
        assert "request bodies refused (503)" in log.read_text()  # the operator is told, not only counted
        # The bodies the server took are served once they are whole.
        for c in holders:
            assert status_of(await c.finish()) == 200
    finally:
        for c in clients:
            c.writer.close()

    # Nothing is held for any of them now: two bodies that fill the budget exactly, at once.
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        full = await asyncio.gather(*(client.post("/v1/completions", content=body_of(LIMIT),
                                                  headers={"content-type": "application/json"}) for _ in range(2)))
    assert [r.status_code for r in full] == [200, 200], [r.text[:200] for r in full]


def leg_of(size: int) -> bytes:
    """A P/D decode leg of ``size`` bytes, over ``LIMIT``: most of it a ``kv_transfer_params``
    value of ``SENT`` bytes, which ``pd_legs`` keeps while the rest arrives."""
    head = b'{"prompt": "hello", "max_tokens": 2, "kv_transfer_params": {"x": "'
    value = head + b"a" * (SENT - len(head)) + b'"}, "pad": "'
    return value + b" " * (size - len(value) - 2) + b'"}'


@pytest.mark.loopback
@pytest.mark.asyncio
async def test_oversized_legs_hold_their_transfer_params_only_within_the_budget() -> None:
    """With ``pd_legs``, a leg over ``max_request_bytes`` is read to its end for its
    ``kv_transfer_params``, and that value is held while the rest arrives: ten legs that
    each sent a 7 MiB value and stopped held 74 MiB of a server with an 8 MiB budget, refused none."""
    body = leg_of(LIMIT + MIB)
    serve = ["-m", "proxy.server.cli", "serve", "--log-level", "warning", "--engine", "sim"]
    with running_server(serve, env={**ENV, "CACHETALLY_PD_LEGS": "1"}) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        rss_before = rss_mib(proc.pid)
        clients = [Uploader(*await asyncio.open_connection("127.0.0.1", port)) for _ in range(CLIENTS)]
        try:
            for c in clients:
                c.writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
                c.writer.write(body[:SENT + 4])
                await asyncio.wait_for(c.writer.drain(), 30)
            await asyncio.sleep(1)  # the server reads what was sent
            grown = rss_mib(proc.pid) - rss_before
            statuses = []
            for c in clients:  # the rest: a leg still held is read to its end and refused as too large
                c.writer.write(body[SENT + 4:])
                with contextlib.suppress(ConnectionError):
                    await c.writer.drain()
                statuses.append(status_of(await asyncio.wait_for(c.read_answer(), 30)))
        finally:
            for c in clients:
                c.writer.close()
        refused = statuses.count(503)
        assert statuses.count(413) * SENT <= HELD and refused, statuses
        assert grown < 64, f"{grown:.0f} MiB more for {CLIENTS} legs sent"
        text = httpx.get(f"{url}/metrics").text
        assert metric_value(text, "cachetally_request_bodies_refused_total") == refused


def test_a_max_request_bytes_above_the_default_budget_still_starts_and_serves() -> None:
    """A ``max_request_bytes`` above 1 GiB started the server before the budget; with the
    budget's default fixed at 1 GiB, ``cachetally serve`` (and ``vllm serve --middleware``)
    refused to start on that configuration. Unset, the budget is one such body at least."""
    env = {"CACHETALLY_MAX_REQUEST_BYTES": str(2 << 30)}
    serve = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(serve, env=env) as (url, _):
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 2
