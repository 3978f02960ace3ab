"""The embedded floor of ``cachetally bench proxy``: the sim's chat route called in process.

No sockets and no server: the route is called as an ASGI app with a request already in
memory, so what is left is the work of the layers in front of it. Three stacks, each
timed in five loops of ``requests`` calls (median):

- ``sim``: the sim's own app, as ``python -m engine_adapter.sim`` serves it;
- ``passthrough``: the same app behind a middleware that wraps ``receive`` and ``send``
  and does nothing else, the least any response-patching ASGI middleware costs;
- ``cachetally``: ``CachetallyApp`` with the sim engine, as ``cachetally serve --engine
  sim`` serves it (ledger, request id, body options, JSON patch, metrics).

Beside them, ``least_work_us``: what patching cannot skip, timed alone (parse the request
body for its options, parse the response, write ``cached_tokens``, serialize it again).
The ratios say how far 0.97 (the embedded target, :data:`proxy.bench.report.TARGETS`) is
from what pure ASGI allows: 0.97 leaves 3% of ``sim_us`` for everything in front of the
route.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.sim import SimConfig, SimEngine
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings

_BODY = orjson.dumps({"model": "sim-model", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "How many of these prompt tokens were cached?"}]})
_SCOPE: Scope = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "root_path": "",
    "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "method": "POST",
    "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
    "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(_BODY))],
}


class PassThrough:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped_receive() -> Message:
            return await receive()

        async def wrapped_send(message: Message) -> None:
            await send(message)

        await self.app(scope, wrapped_receive, wrapped_send)


async def _call(app: ASGIApp) -> int:
    """One request; the response status."""
    return await call(app, dict(_SCOPE), _BODY)


async def call(app: ASGIApp, scope: Scope, body: bytes) -> int:
    """One request with ``body``, whose client stays to the end; the response status."""
    status = 0
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def _per_request_us(app: ASGIApp, requests: int) -> float:
    assert await _call(app) == 200, "the in-process route did not answer 200"
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(requests):
            await _call(app)
        timings.append((time.perf_counter() - start) / requests * 1e6)
    return statistics.median(timings)


def _least_work_us(requests: int, response: bytes) -> float:
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(requests):
            orjson.loads(_BODY)
            payload = orjson.loads(response)
            payload["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
            orjson.dumps(payload)
        timings.append((time.perf_counter() - start) / requests * 1e6)
    return statistics.median(timings)


async def _response(app: ASGIApp) -> bytes:
    body = bytearray()

    async def receive() -> Message:
        return {"type": "http.request", "body": _BODY, "more_body": False}

    async def send(message: Message) -> None:
        body.extend(message.get("body", b""))

    await app(dict(_SCOPE), receive, send)
    return bytes(body)


async def _measure(requests: int) -> dict[str, Any]:
    sim = SimEngine(config=SimConfig())
    bare = await sim.start()
    try:
        app = CachetallyApp(Settings(engine="sim").validate())
        async with app.running():
            sim_us = await _per_request_us(bare, requests)
            passthrough_us = await _per_request_us(PassThrough(bare), requests)
            cachetally_us = await _per_request_us(app, requests)
        response = await _response(bare)
    finally:
        await sim.stop()
    return {
        "least_work_us": _least_work_us(requests, response),
        "sim_us": sim_us,
        "passthrough_us": passthrough_us,
        "cachetally_us": cachetally_us,
        "ratio_passthrough": sim_us / passthrough_us,
        "ratio_cachetally": sim_us / cachetally_us,
    }


def embedded_floor(requests: int) -> dict[str, Any]:
    """µs per request of each stack and their throughput ratios to the sim alone."""
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    return run(_measure(requests))
