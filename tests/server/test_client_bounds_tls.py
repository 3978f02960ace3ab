"""The client bounds over TLS (vLLM's ``--ssl-keyfile``): uvicorn's protocol under asyncio's
and uvloop's SSL transports, on loopback, certificate from ``trustme``.

A TLS connection can be ended two ways: a close sends the client a close_notify, then waits
for the client's (asyncio's and uvloop's ``ssl_shutdown_timeout``, 30 s) before it lets the
socket go; an abort lets it go at once. The clients here drive TLS by hand (``ssl.MemoryBIO``)
so that they can read the TCP connection's end apart from TLS's, and never answer a
close_notify, as a client that went silent never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trustme

from proxy.server.client_bounds import with_client_bounds
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

BOUND_S = 0.3
STREAM_LEFT = threading.Event()  # the stream's request saw its client leave


async def disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def echo_length(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The body's length; on ``/stream``, 64 KiB chunks until the client is gone."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        left = asyncio.ensure_future(disconnect(receive))
        while not left.done():
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)  # a send that does not wait never yields: let `left` finish
        STREAM_LEFT.set()
        return
    body = b""
    while (message := await receive())["type"] == "http.request":
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = b"%d" % len(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])  # uvicorn's "auto" takes uvloop where installed
def tls_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, ssl.SSLContext]]:
    ca, folder = trustme.CA(), tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    with serving_in_thread(echo_length, loop=request.param, http=with_client_bounds(BOUND_S, BOUND_S),
                           ssl_keyfile=str(folder / "key.pem"), ssl_certfile=str(folder / "cert.pem")) as url:
        yield int(url.rsplit(":", 1)[1]), client_context


def assert_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing at ERROR, no traceback (asyncio's SSL transports report theirs to the loop's
    exception handler, which logs at ERROR)."""
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


class SilentTlsClient:
    """TLS over a raw socket: what it reads is the server's, record by record, and it never
    sends a close_notify of its own."""

    def __init__(self, port: int, context: ssl.SSLContext, receive_buffer: int | None = None) -> None:
        self.sock = socket.socket()
        if receive_buffer:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(10)  # under asyncio's 30 s close_notify wait: a socket held fails the test
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                self.incoming.write(self.sock.recv(1 << 16))
        self.sock.sendall(self.outgoing.read())

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self.sock.sendall(self.outgoing.read())

    def let_go(self) -> bool:
        """Whether the server ended the TCP connection (an end or a reset), not only TLS."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True


@pytest.mark.parametrize("sent", [b"", b"POST / HTTP/1.1\r\nHo", b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nhalf"],
                         ids=["nothing", "half a header", "half a body"])
def test_a_silent_client_past_the_receive_bound_has_its_socket_let_go_over_tls(
        tls_server: tuple[int, ssl.SSLContext], sent: bytes, caplog: pytest.LogCaptureFixture) -> None:
    client = SilentTlsClient(*tls_server)
    with client.sock:
        client.send(sent)
        assert client.let_go()
    assert_no_error(caplog)


def test_a_client_over_tls_within_the_bounds_is_served(tls_server: tuple[int, ssl.SSLContext]) -> None:
    client = SilentTlsClient(*tls_server)
    with client.sock:
        client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        answer = b""
        while not answer.endswith(b"\r\n\r\n5"):  # the head and the body: a TLS record each
            client.incoming.write(client.sock.recv(1 << 16))
            with contextlib.suppress(ssl.SSLWantReadError):
                while chunk := client.tls.read(1 << 16):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_stream_whose_client_takes_nothing_is_reset_over_tls(
        tls_server: tuple[int, ssl.SSLContext], caplog: pytest.LogCaptureFixture) -> None:
    STREAM_LEFT.clear()
    client = SilentTlsClient(*tls_server, receive_buffer=4096)
    with client.sock:
        client.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert STREAM_LEFT.wait(10)  # the app saw a disconnect while the client read nothing
        with pytest.raises(ConnectionResetError):  # not megabytes, then an end
            while client.sock.recv(1 << 20):
                pass
    assert_no_error(caplog)
