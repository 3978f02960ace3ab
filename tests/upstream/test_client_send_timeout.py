"""A client that opens a stream and never reads it (``client_send_timeout_s``).

Found by review: the pool's read timeout rests while reading is paused for a slow client,
and nothing bounded how long cachetally waited to write to one, so each such client held
its upstream connection (and the upstream its request) for as long as it stayed; with a
pool of 3, three of them got every other request a 503 "pool exhausted".

Through real HTTP: the upstream is a Starlette app in uvicorn that streams without end and
notes when its stream is ended; cachetally runs in uvicorn with the protocol ``cachetally
serve`` uses, a pool of one connection and a send timeout of 0.5 s; the client that never
reads is a raw socket with a 4 KiB receive buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.server.app import CachetallyApp
from proxy.server.client_bounds import with_client_bounds
from proxy.server.settings import Settings
from proxy.upstream.client import Origin
from proxy.upstream.engine import UpstreamEngine
from proxy.upstream.pool import Http1Pool
from tests.servers import metric_value, serving_in_thread
from tests.upstream.test_upstream_reports import FAIR, completion, records

pytestmark = pytest.mark.loopback

SECRET = "a prompt no log may hold"
_CHUNK = b"data: " + orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"content": "x" * 8192}, "finish_reason": None}]}) + b"\n\n"


class Upstream:
    """Streams without end to ``endless``, answers ``fair`` in JSON; notes the client port of
    each request and of each stream the upstream saw ended."""

    def __init__(self) -> None:
        self.ports: dict[str, int] = {}
        self.ended: list[int] = []

    async def answer(self, request: Request) -> Response:
        case = (await request.json())["messages"][0]["content"]
        assert request.client is not None
        self.ports[case] = request.client.port
        if case == "fair":
            return Response(completion(FAIR), media_type="application/json")
        return StreamingResponse(self._endless(request.client.port), media_type="text/event-stream")

    async def _endless(self, port: int) -> AsyncIterator[bytes]:
        try:
            while True:
                yield _CHUNK
                await asyncio.sleep(0)
        finally:
            self.ended.append(port)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + ("\nTraceback" if record.exc_info else ""))


@contextlib.contextmanager
def logged(*names: str) -> Iterator[Lines]:
    handler = Lines()
    loggers = [logging.getLogger(name) for name in names]
    for log in loggers:
        log.addHandler(handler)
    try:
        yield handler
    finally:
        for log in loggers:
            log.removeHandler(handler)


def test_a_client_that_never_reads_frees_its_upstream_connection_after_the_send_timeout(tmp_path: Path) -> None:
    upstream = Upstream()
    app_routes = [Route("/v1/chat/completions", upstream.answer, methods=["POST"])]
    pools: list[Http1Pool] = []

    def pool_of_one(origin: Origin) -> Http1Pool:
        pools.append(Http1Pool(origin, max_connections=1, keepalive_s=4.0, connect_timeout_s=5.0,
                               read_timeout_s=2.0))
        return pools[-1]

    with serving_in_thread(Starlette(routes=app_routes), "upstream") as upstream_url:
        settings = Settings(engine="upstream", upstream=upstream_url, model="m", usage_dir=str(tmp_path),
                            usage_flush_interval_s=0.05, client_send_timeout_s=0.5).validate()
        app = CachetallyApp(settings, engine_factory=lambda sink: UpstreamEngine(settings, client=pool_of_one))
        with serving_in_thread(app, "cachetally", http=with_client_bounds(settings.client_send_timeout_s, settings.client_receive_timeout_s)) as url, \
                logged("cachetally", "uvicorn") as log:
            port = int(url.rsplit(":", 1)[1])
            body = orjson.dumps({"model": "m", "stream": True, "messages": [
                {"role": "user", "content": "endless"}, {"role": "user", "content": SECRET}]})
            with socket.socket() as held:
                held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                held.connect(("127.0.0.1", port))
                held.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: held\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                # It never reads. The one upstream connection is its own until the send timeout:
                # a request made now waits for it (up to connect_timeout_s, then 503).
                with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
                    fair = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "fair"}], extra_headers={"X-Request-Id": "fair"})
                assert fair.choices[0].message.content == "Hello"
                assert fair.usage is not None and fair.usage.prompt_tokens_details is not None
                assert fair.usage.prompt_tokens_details.cached_tokens == 4
                metrics = httpx.get(f"{url}/metrics", timeout=10).text
            by_id = {record["request_id"]: record for record in records(tmp_path, 2)}
    # The held stream's upstream connection was closed, never reused: the upstream saw that
    # request end (as on a disconnect), and the fair one came on a connection of its own.
    assert upstream.ended == [upstream.ports["endless"]]
    assert upstream.ports["fair"] != upstream.ports["endless"]
    assert metric_value(metrics, "cachetally_upstream_connections_checked_out") == 0
    assert (by_id["held"]["outcome"], by_id["fair"]["outcome"]) == ("disconnected", "completed")
    said = [line for line in log.lines if "client_send_timeout_s" in line]
    assert len(said) == 1, log.lines
    assert not [line for line in log.lines if "Traceback" in line or "ASGI callable" in line], log.lines
    assert not [line for line in log.lines if SECRET in line or "xxxx" in line], log.lines
