"""A client that sends its body too slowly (``client_receive_timeout_s``), in upstream mode.

A route cachetally does not meter streams its body upstream as the client sends it, on a
pooled connection. A client that stopped halfway held that connection, and the upstream its
request, with nothing to bound it but the upstream read timeout (600 s by default): a few
hundred such clients took the whole pool. The bound is the client's, never the server's: a
body the upstream is slow to take (cachetally's reading paused by flow control) is not cut.

Through real HTTP: the upstream and cachetally each in a real uvicorn, cachetally with the
protocol ``cachetally serve`` uses and a pool of one connection; the slow client is a raw socket.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from proxy.server.app import CachetallyApp
from proxy.server.client_bounds import with_client_bounds
from proxy.server.settings import Settings
from proxy.upstream.client import Origin
from proxy.upstream.engine import UpstreamEngine
from proxy.upstream.pool import Http1Pool
from tests.servers import metric_value, serving_in_thread
from tests.upstream.test_client_send_timeout import logged

pytestmark = pytest.mark.loopback

BOUND_S = 0.5
SECRET = "an input no log may hold"


class Upstream:
    """Embeddings: reads the whole body (after ``delay_s``), notes what it got and who left."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.got: list[int] = []
        self.left = threading.Event()

    async def embed(self, request: Request) -> Response:
        await asyncio.sleep(self.delay_s)  # meanwhile its server stops reading: cachetally waits
        try:
            body = await request.body()
        except ClientDisconnect:
            self.left.set()
            return Response(status_code=499)  # to nobody
        self.got.append(len(body))
        return JSONResponse({"object": "list", "data": [], "usage": {"prompt_tokens": 1, "total_tokens": 1}})


def serving(upstream: Upstream):  # type: ignore[no-untyped-def]
    def pool_of_one(origin: Origin) -> Http1Pool:  # a request waits for the one connection up to 5 s
        return Http1Pool(origin, max_connections=1, keepalive_s=4.0, connect_timeout_s=5.0, read_timeout_s=60.0)

    upstream_app = Starlette(routes=[Route("/v1/embeddings", upstream.embed, methods=["POST"])])
    # No usage records: with billing on, a route that runs the engine unmetered is refused.
    settings = Settings(engine="upstream", upstream="http://127.0.0.1:1", model="m",
                        client_receive_timeout_s=BOUND_S)

    class Both:
        def __enter__(self) -> str:
            self._upstream = serving_in_thread(upstream_app, "upstream")
            settings.upstream = self._upstream.__enter__()
            settings.validate()
            app = CachetallyApp(settings, engine_factory=lambda sink: UpstreamEngine(settings, client=pool_of_one))
            self._proxy = serving_in_thread(app, "cachetally", http=with_client_bounds(
                settings.client_send_timeout_s, settings.client_receive_timeout_s))
            return self._proxy.__enter__()

        def __exit__(self, *exc: object) -> None:
            try:
                self._proxy.__exit__(*exc)
            finally:
                self._upstream.__exit__(*exc)

    return Both()


def test_a_client_that_stops_its_body_halfway_frees_its_upstream_connection() -> None:
    upstream = Upstream()
    with serving(upstream) as url, logged("cachetally", "uvicorn") as log:
        body = orjson.dumps({"model": "m", "input": SECRET})
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as stalled:
            stalled.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
            # The one upstream connection carries its upload until the bound lets the client go.
            fair = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": "fair"}, timeout=20)
            assert fair.status_code == 200, fair.text
            assert upstream.left.wait(10)  # the upstream saw the stalled request end, as a disconnect
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert upstream.got == [len(b'{"model":"m","input":"fair"}')]
    assert metric_value(metrics, "cachetally_upstream_connections_checked_out") == 0
    said = [line for line in log.lines if "client_receive_timeout_s" in line]
    assert len(said) == 1, log.lines
    assert not [line for line in log.lines if "Traceback" in line or SECRET in line], log.lines


def test_a_body_the_upstream_is_slow_to_take_is_not_cut() -> None:
    """The client sends 8 MiB at once; the upstream takes none of it for 6 bounds. cachetally's
    reading pauses (flow control) meanwhile: that wait is the server's, not the client's."""
    upstream = Upstream(delay_s=6 * BOUND_S)
    with serving(upstream) as url, logged("cachetally", "uvicorn") as log:
        body = orjson.dumps({"model": "m", "input": "x" * (8 << 20)})
        answer = httpx.post(f"{url}/v1/embeddings", content=body, headers={"content-type": "application/json"},
                            timeout=30)
    assert answer.status_code == 200, answer.text
    assert upstream.got == [len(body)]
    assert not [line for line in log.lines if "client_receive_timeout_s" in line], log.lines


def test_a_websocket_is_not_timed_as_a_request() -> None:
    """Once a connection is a WebSocket (vLLM's /v1/realtime), uvicorn's WebSocket protocol
    owns it: a quiet one is not closed as a request whose body stalled."""
    from websockets.sync.client import connect

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        while True:
            await websocket.send_text(await websocket.receive_text())

    app = Starlette(routes=[WebSocketRoute("/ws", echo)])
    with serving_in_thread(app, "ws", http=with_client_bounds(60.0, BOUND_S)) as url:
        with connect(url.replace("http://", "ws://") + "/ws") as websocket:
            time.sleep(4 * BOUND_S)
            websocket.send("still here")
            assert websocket.recv(timeout=10) == "still here"
