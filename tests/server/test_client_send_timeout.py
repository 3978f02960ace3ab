"""``cachetally serve --client-send-timeout``: a client that never reads its stream is let go.

The sim engine, through the real command: its stream would otherwise wait on the client for
as long as it stays (upstream mode, with the pool: tests/upstream/test_client_send_timeout.py).
"""

from __future__ import annotations

import contextlib
import functools
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.server.client_bounds import ClientBoundsProtocol, with_client_bounds
from tests.servers import running_server, serving_in_thread
from tests.upstream.test_upstream_reports import records

pytestmark = pytest.mark.loopback

SECRET = "a prompt no log may hold"


@contextlib.contextmanager
def client_that_never_reads(url: str, body: bytes, header: bytes) -> Iterator[socket.socket]:
    """A completions request sent on a 4 KiB receive buffer, of which nothing is read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"%sContent-Length: %d\r\n\r\n%s" % (header, len(body), body))
        yield client


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: the protocol reaches processes uvicorn spawns
def test_serve_ends_a_stream_whose_client_takes_nothing_for_the_send_timeout_as_a_disconnect(
        tmp_path: Path, workers: str) -> None:
    usage, log = tmp_path / "usage", tmp_path / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--usage-dir", str(usage),
            "--usage-flush-interval", "0.05", "--client-send-timeout", "0.5", "--workers", workers]
    body = orjson.dumps({"model": "sim-model", "prompt": SECRET, "max_tokens": 10_000_000, "stream": True})
    with running_server(args, env={"CACHETALLY_SIM_TOKEN_DELAY_S": "0.0005"}, log_path=log) as (url, _):
        with client_that_never_reads(url, body, b"X-Request-Id: held\r\n") as client:
            # It never reads: the record comes only once the server has let it go.
            found = records(usage, 1, timeout_s=30.0)
            time.sleep(0.2)  # any line that would follow the record (a traceback) is in the log
            # Reset, not closed: a close leaves the server's kernel holding the unsent bytes
            # until this client takes them, and the client reading them all, then an end.
            with pytest.raises(ConnectionResetError):
                while client.recv(1 << 20):
                    pass
    # (with workers the id carries its process: "held.p<pid>")
    assert [(r["request_id"].split(".")[0], r["outcome"]) for r in found] == [("held", "disconnected")]
    assert found[0]["completion_tokens"] > 0  # counted up to the disconnect
    text = log.read_text()
    assert text.count("client_send_timeout_s") == 1, text[-3000:]
    assert "Traceback" not in text and "ASGI callable" not in text and SECRET not in text, text[-3000:]


def test_serve_resets_a_client_that_takes_none_of_a_whole_response_whose_connection_closes(tmp_path: Path) -> None:
    """Found by review: once the response was whole and its connection closing ("Connection:
    close" here; after a keep-alive's 5 s, before the 60 s bound, by default), the bound
    stood down, and close() waited for the unsent megabytes for as long as the client stayed."""
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--usage-dir", str(tmp_path),
            "--usage-flush-interval", "0.05", "--client-send-timeout", "0.5"]
    body = orjson.dumps({"model": "sim-model", "prompt": SECRET, "max_tokens": 500_000})
    with running_server(args) as (url, _):
        with client_that_never_reads(url, body, b"Connection: close\r\n") as client:
            found = records(tmp_path, 1, timeout_s=30.0)
            assert found[0]["outcome"] == "completed"  # its response was whole before the client was let go
            time.sleep(2.0)  # four times the bound, once the response is whole (no pass/fail on it)
            with pytest.raises(ConnectionResetError):  # not the megabytes, then an end
                while client.recv(1 << 20):
                    pass


class Streams:
    """An app that streams ``kib`` KiB in 64 KiB parts as fast as its client's connection takes
    them, counting in :attr:`handed` the bytes uvicorn took from it (its ``send`` returned)."""

    def __init__(self, kib: int) -> None:
        self.parts, self.handed = kib // 64, 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        part = b"x" * (64 << 10)
        for _ in range(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": True})
            self.handed += len(part)
        await send({"type": "http.response.body", "body": b""})


def asks(url: str, receive_buffer: int) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.connect((host, int(port)))
    client.settimeout(30)
    client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    return client


def test_a_client_that_takes_its_stream_slowly_but_steadily_is_never_cut() -> None:
    """The bound is on a stretch with no progress: a client slower than the app, which takes
    some of the bytes in every stretch, gets its whole stream, however long it takes. (As
    nginx's ``send_timeout``, progress is what the kernel takes of the connection's buffer: a
    client that takes less than its socket's buffers free in a bound is cut all the same.)"""
    app = Streams(16 << 10)
    with serving_in_thread(app, "steady", http=with_client_bounds(1.0, 60.0)) as url, \
            asks(url, 64 << 10) as client:
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            chunk = client.recv(64 << 10)
            assert chunk, "the server ended the stream before its end"
            got += chunk
            time.sleep(0.02)  # 3.2 MiB/s at most: some 5 s for the 16 MiB, past several bounds
    assert app.handed == 16 << 20


def test_a_client_that_takes_nothing_holds_no_more_of_its_stream_than_the_buffers() -> None:
    """The bound lets such a client go; until then uvicorn's flow control holds the app's
    ``send``: the server keeps what the buffers hold of the stream, not all of it."""
    app = Streams(256 << 10)
    with serving_in_thread(app, "takes-nothing", http=with_client_bounds(60.0, 60.0)) as url, \
            asks(url, 4096) as client:
        handed = -1
        while handed != app.handed:  # until the app's send waits
            handed = app.handed
            time.sleep(0.5)
        assert handed < 32 << 20, f"{handed >> 20} MiB of the stream held for a client that read none"
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class SmallSendBuffer(ClientBoundsProtocol):
    """The protocol on a socket whose kernel send buffer is small, so that what a client
    takes shows at once in the connection's own buffer, where the bound looks for progress."""

    def connection_made(self, transport: Any) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        super().connection_made(transport)


def test_a_client_that_takes_a_little_in_every_bound_keeps_its_connection_through_a_long_pause() -> None:
    """The connection's writes stay paused for many bounds (the client takes 4 KiB a tenth of
    a second, far below what the app writes), but each bound sees the client took some:
    progress, and the bound is timed again, never a reset."""
    app = Streams(192)
    protocol = functools.partial(SmallSendBuffer, send_timeout_s=0.6, receive_timeout_s=60.0)
    with serving_in_thread(app, "trickle", http=protocol) as url, asks(url, 4096) as client:
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            chunk = client.recv(4096)
            assert chunk, "the server ended the stream before its end"
            got += chunk
            time.sleep(0.1)  # 40 KiB/s: some 5 s for the 192 KiB, a pause of four bounds
    assert app.handed == 192 << 10


def test_a_client_that_takes_a_little_and_then_nothing_is_reset_a_bound_later() -> None:
    """Each stretch is timed as the first was, after writes resumed or a bound saw progress:
    the client took 512 KiB at once, then some bytes in a bound with the writes paused, then none."""
    protocol = functools.partial(SmallSendBuffer, send_timeout_s=0.6, receive_timeout_s=60.0)
    with serving_in_thread(Streams(2048), "stops", http=protocol) as url, asks(url, 4096) as client:
        taken = 0
        while taken < 512 << 10:  # first at once: the writes pause and resume, time and again
            taken += len(client.recv(64 << 10))
        for _ in range(8):  # 4 KiB a tenth of a second, across the first bound: far from draining
            assert client.recv(4096)
            time.sleep(0.1)
        time.sleep(3 * 0.6)  # then nothing, for three bounds (no pass/fail on it)
        with pytest.raises(ConnectionResetError):
            while client.recv(1 << 16):
                pass
