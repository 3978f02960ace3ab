"""``cachetally serve --client-send-timeout``: a client that never reads its stream is let go.

The sim engine, through the real command: its stream would otherwise wait on the client for
as long as it stays (upstream mode, with the pool: tests/upstream/test_client_send_timeout.py).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.servers import running_server
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
