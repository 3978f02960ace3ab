"""The load generator of ``cachetally bench proxy``: a worker process driven by JSON lines.

It must not be the bottleneck it measures, so it is a plain asyncio ``Protocol`` per
keep-alive connection, uvloop when installed, with pre-built request bytes and httptools
parsing the responses (no client library, no per-request objects beyond a few floats).
SSE events are counted by their blank lines, without parsing them.

Run as ``python -m proxy.bench.loadgen``; each line on stdin is one job, answered by one
JSON line on stdout:

- ``{"op": "run", "port", "path", "body", "conns", "per_conn"}``: ``conns`` connections
  each send ``per_conn`` requests one after another. Answers ``wall_s``, per request
  ``latency_ms`` and ``ttfb_ms`` (time to the first body byte), ``events`` (SSE blank
  lines), ``errors``.
- ``{"op": "hold", ...same..., "conns"}``: opens ``conns`` streams, answers ``ready``
  once each has a body byte, then waits for a ``release`` line, closes them all and
  answers ``released``.
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import httptools


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "parser", "waiter", "first", "events", "status", "_tail")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.first: asyncio.Future[float] | None = None
        self.events = 0
        self.status = 0
        self._tail = b""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("connection closed"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.first is not None and not self.first.done():
            self.first.set_result(time.perf_counter())
        self.events += body.count(b"\n\n") + (self._tail == b"\n" and body[:1] == b"\n")
        self._tail = body[-1:]

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        for future in (self.waiter, self.first):
            if future is not None and not future.done():
                future.set_exception(exc)

    def send(self, raw: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.waiter, self.first = loop.create_future(), loop.create_future()
        self.events, self.status, self._tail = 0, 0, b""
        assert self.transport is not None
        self.transport.write(raw)


def _raw_request(job: dict[str, Any]) -> bytes:
    body = job["body"].encode()
    head = (
        f"POST {job['path']} HTTP/1.1\r\nHost: 127.0.0.1:{job['port']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connect(port: int) -> _Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
    return conn


async def _run(job: dict[str, Any]) -> dict[str, Any]:
    raw = _raw_request(job)
    conns = [await _connect(job["port"]) for _ in range(job["conns"])]
    latency: list[float] = []
    ttfb: list[float] = []
    counts = {"events": 0, "errors": 0}

    async def drive(conn: _Conn) -> None:
        for _ in range(job["per_conn"]):
            start = time.perf_counter()
            conn.send(raw)
            assert conn.first is not None and conn.waiter is not None
            try:
                first = await conn.first
                await conn.waiter
            except (OSError, httptools.HttpParserError):
                counts["errors"] += 1
                return
            end = time.perf_counter()
            if conn.status != 200:
                counts["errors"] += 1
            latency.append((end - start) * 1e3)
            ttfb.append((first - start) * 1e3)
            counts["events"] += conn.events

    start = time.perf_counter()
    try:
        await asyncio.gather(*(drive(conn) for conn in conns))
        wall = time.perf_counter() - start
    finally:
        for conn in conns:
            assert conn.transport is not None
            conn.transport.close()
    return {"wall_s": wall, "latency_ms": latency, "ttfb_ms": ttfb, **counts}


async def _hold(job: dict[str, Any], lines: asyncio.Queue[str]) -> None:
    raw = _raw_request(job)
    conns: list[_Conn] = []
    try:
        for _ in range(job["conns"]):
            conn = await _connect(job["port"])
            conns.append(conn)
            conn.send(raw)
        await asyncio.wait_for(asyncio.gather(*(conn.first for conn in conns if conn.first)), job["timeout_s"])
        _answer({"ready": len(conns)})
        await lines.get()  # release
    finally:
        for conn in conns:
            if conn.transport is not None:
                conn.transport.abort()
        for conn in conns:
            for future in (conn.waiter, conn.first):
                if future is not None and future.done() and not future.cancelled():
                    future.exception()  # retrieved: no "never retrieved" noise
    await asyncio.sleep(0.2)  # let the closes reach the server before it is measured
    _answer({"released": len(conns)})


def _answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main() -> None:
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()

    def reader() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, '{"op": "exit"}')

    threading.Thread(target=reader, daemon=True).start()
    while True:
        job = json.loads(await lines.get())
        if job["op"] == "exit":
            return
        if job["op"] == "run":
            _answer(await _run(job))
        elif job["op"] == "hold":
            await _hold(job, lines)


def main() -> None:
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(_main())
    # The stdin reader thread may still block on readline: leave without joining it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
