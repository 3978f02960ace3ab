"""``cachetally serve --client-receive-timeout``: a client that sends too slowly, or nothing, is let go.

uvicorn times nothing a client sends: a socket that sends no byte, part of a header, or part
of a body was held for good, each with a file descriptor (and a request's task and its
buffered body). Through the real command, sim engine, with a bound of 1 s; the clients are
raw sockets. nginx's rules: a header is timed as a whole from the connection's start, a
body between two reads (upstream mode, where the server itself can be the one waiting:
tests/upstream/test_client_receive_timeout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import uvicorn

from proxy.server.client_bounds import H11_MAX_HEADER_BYTES, with_client_bounds
from proxy.server.settings import Settings
from proxy.vllm_middleware import _bound_vllms_server
from tests.servers import free_port, running_server, serving_in_thread
from tests.upstream.test_upstream_reports import records

pytestmark = pytest.mark.loopback

SECRET = "a prompt no log may hold"
BOUND_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    usage = tmp_path_factory.mktemp("usage")
    log = usage.parent / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--usage-dir", str(usage),
            "--usage-flush-interval", "0.05", "--client-receive-timeout", str(BOUND_S)]
    with running_server(args, log_path=log) as (url, _):
        yield url, usage, log


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = socket.create_connection((host, int(port)))
    client.settimeout(30)  # a server that holds it on fails the test, never hangs it
    return client


def let_go(client: socket.socket) -> bool:
    """Whether the server ended the connection (an end or a reset) with nothing sent back."""
    try:
        return client.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def head(body: bytes, request_id: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (request_id, len(body)))


def closed(client: socket.socket) -> bool:
    """Whether the server has ended the connection, without waiting."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def test_a_connection_that_sends_no_whole_header_in_the_bound_is_closed(server: tuple[str, Path, Path]) -> None:
    url, _, _ = server
    with connect(url) as silent, connect(url) as partial, connect(url) as trickled:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        # One header byte every 0.1 s, each well inside the bound: a header is timed whole.
        trickled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        padding = b"X-Pad: " + b"a" * 300
        for sent, byte in enumerate(padding):
            try:
                trickled.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
            if closed(trickled):
                break
        assert sent < len(padding) - 1, "the header's trickle was never cut"
        assert let_go(silent) and let_go(partial)


def test_a_body_is_timed_between_two_reads(server: tuple[str, Path, Path]) -> None:
    """A body sent in pieces over longer than the bound, each inside it, is served; one that
    stops halfway is let go: one warning, no traceback, no prompt text, and its one record
    says so, with no tokens to bill (it never reached the engine)."""
    url, usage, log = server
    body = orjson.dumps({"model": "sim-model", "prompt": SECRET, "max_tokens": 3})
    with connect(url) as slow, connect(url) as stalled:
        stalled.sendall(head(body, b"stalled") + body[: len(body) // 2])
        slow.sendall(head(body, b"slow"))
        pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
        for piece in pieces:
            time.sleep(2 * BOUND_S / len(pieces))  # 2 s in all
            slow.sendall(piece)
        answer = b""
        while b'"usage"' not in answer:
            answer += slow.recv(1 << 16)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert let_go(stalled)
    by_id = {r["request_id"]: r for r in records(usage, 2)}
    assert (by_id["slow"]["outcome"], by_id["stalled"]["outcome"]) == ("completed", "disconnected")
    assert by_id["slow"]["prompt_tokens"] > 0
    assert (by_id["stalled"]["prompt_tokens"], by_id["stalled"]["completion_tokens"]) == (None, 0)
    text = log.read_text()
    assert text.count("client_receive_timeout_s") == 1, text[-3000:]
    assert "Traceback" not in text and "ASGI callable" not in text and SECRET not in text, text[-3000:]


def test_a_kept_alive_connection_is_timed_again_for_its_next_request(server: tuple[str, Path, Path]) -> None:
    url, _, _ = server
    body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 1})
    with connect(url) as client:
        client.sendall(head(body, b"first") + body)
        answer = b""
        while b'"usage"' not in answer:
            answer += client.recv(1 << 16)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")  # the next one stops in its header
        assert let_go(client)


class SlowToRead:
    """An app that takes 3 bounds before it reads a request's body and answers with its size."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(3 * IN_THREAD_BOUND_S)
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(str(size)))]})
        await send({"type": "http.response.body", "body": str(size).encode()})


IN_THREAD_BOUND_S = 0.5


def test_the_time_the_server_makes_a_client_wait_is_not_the_clients() -> None:
    """Two waits that are the server's: a client that asked for ``100 Continue`` sends its body
    only once the app asks for it; a pipelined request's header, sent in part, is finished by
    a client that first waits for the answer to the request before it."""
    with serving_in_thread(SlowToRead(), "slow", http=with_client_bounds(60.0, IN_THREAD_BOUND_S)) as url:
        with connect(url) as polite:
            polite.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            assert polite.recv(1 << 16) == b"HTTP/1.1 100 Continue\r\n\r\n"
            polite.sendall(b"hello")
            assert polite.recv(1 << 16).endswith(b"\r\n\r\n5")
        with connect(url) as pipelining:
            pipelining.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiPOST /b HTT")
            assert pipelining.recv(1 << 16).endswith(b"\r\n\r\n2")
            pipelining.sendall(b"P/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            assert pipelining.recv(1 << 16).endswith(b"\r\n\r\n3")


class AsksLate:
    """An app that asks for a request's body 0.8 bounds after its header (the 100 Continue goes
    then), and answers with the body's size; ``/early`` answers 404 at once, reading nothing."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size, more = 0, scope["path"] != "/early"
        if more:
            await asyncio.sleep(0.8 * WHOLE_BOUND_S)
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        answer = str(size).encode()
        await send({"type": "http.response.start", "status": 404 if scope["path"] == "/early" else 200,
                    "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


WHOLE_BOUND_S = 1.0


def test_a_client_has_a_whole_bound_from_its_100_continue() -> None:
    """The server's wait began and ended between two of the timer's looks: the client that
    waited for its ``100 Continue`` still has a whole bound from it to send its body."""
    with serving_in_thread(AsksLate(), "asks-late", http=with_client_bounds(60.0, WHOLE_BOUND_S)) as url:
        with connect(url) as polite:
            polite.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            assert polite.recv(1 << 16) == b"HTTP/1.1 100 Continue\r\n\r\n"
            time.sleep(0.5 * WHOLE_BOUND_S)
            polite.sendall(b"hello")
            assert polite.recv(1 << 16).endswith(b"\r\n\r\n5")


def test_blank_lines_between_requests_do_not_hold_a_kept_alive_connection() -> None:
    """uvicorn's keep-alive timer stops at any byte; a blank line (which its parser skips
    before a request) now and then held a kept-alive connection for good."""
    with serving_in_thread(AsksLate(), "blank-lines", http=with_client_bounds(60.0, IN_THREAD_BOUND_S),
                           timeout_keep_alive=2 * IN_THREAD_BOUND_S) as url:
        with connect(url) as client:
            client.sendall(b"GET /early HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(1 << 16).endswith(b"\r\n\r\n0")
            for _ in range(int(8 / 0.1)):  # a blank line each 0.1 s, for 16 bounds
                try:
                    client.send(b"\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    break
                time.sleep(0.1)
                if closed(client):
                    break
            else:
                raise AssertionError("blank lines held the connection for 16 bounds")


def test_a_body_sent_after_its_answer_leaves_the_connection_to_the_keep_alive_timer() -> None:
    """An answer sent before the request's body ended (a 404 that reads nothing): the rest of
    the body stopped uvicorn's keep-alive timer, and then nothing was owed, so nothing timed
    the idle connection: it was held for good."""
    with serving_in_thread(AsksLate(), "early", http=with_client_bounds(60.0, IN_THREAD_BOUND_S),
                           timeout_keep_alive=IN_THREAD_BOUND_S) as url:
        with connect(url) as client:
            client.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
            assert client.recv(1 << 16).startswith(b"HTTP/1.1 404 ")
            client.sendall(b"world")
            client.settimeout(20 * IN_THREAD_BOUND_S)
            assert let_go(client)


def test_a_request_in_the_read_that_ends_an_answered_body_is_not_closed_by_the_keep_alive_timer() -> None:
    """The end of a body sent after its answer re-arms uvicorn's keep-alive timer; a request
    that begins in that same read must stand it down, or the timer closed the connection
    under that request's running response."""
    with serving_in_thread(AsksLate(), "early-then-next", http=with_client_bounds(60.0, IN_THREAD_BOUND_S),
                           timeout_keep_alive=0.2 * IN_THREAD_BOUND_S) as url:
        with connect(url) as client:
            client.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
            assert client.recv(1 << 16).startswith(b"HTTP/1.1 404 ")
            # The app takes 0.8 s before it answers: eight keep-alives.
            client.sendall(b"world" + b"POST /next HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            assert client.recv(1 << 16).endswith(b"\r\n\r\n3")


def test_a_pipelined_header_begun_is_not_closed_by_the_keep_alive_timer() -> None:
    """uvicorn arms its keep-alive timer when a response ends with no request queued, even
    with the next one's header begun: it closed that connection after the keep-alive's
    seconds, though the client has a whole bound from the answer to finish its header."""
    with serving_in_thread(SlowToRead(), "pipelined", http=with_client_bounds(60.0, IN_THREAD_BOUND_S),
                           timeout_keep_alive=0.2 * IN_THREAD_BOUND_S) as url:
        with connect(url) as pipelining:
            pipelining.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiPOST /b HTT")
            assert pipelining.recv(1 << 16).endswith(b"\r\n\r\n2")
            time.sleep(0.6 * IN_THREAD_BOUND_S)  # three keep-alives, well inside the bound
            pipelining.sendall(b"P/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            assert pipelining.recv(1 << 16).endswith(b"\r\n\r\n3")


class VllmsApp:
    """vLLM's app as the middleware finds it at its lifespan's startup: served by a uvicorn
    whose config is loaded and whose listener is not open yet (``app.state.server``)."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(server=None)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                _bound_vllms_server(self, Settings(client_receive_timeout_s=IN_THREAD_BOUND_S))
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})


@contextlib.contextmanager
def serving(config: uvicorn.Config) -> Iterator[str]:
    """``config``'s server (its attributes set as vLLM sets them) in a thread; its base URL."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_vllms_server_gets_the_receive_bound_where_it_runs_httptools_and_says_so_where_not(
        http: str, caplog: pytest.LogCaptureFixture) -> None:
    app = VllmsApp()
    app.state.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), http=http,
                                                     lifespan="on", log_level="warning"))
    with caplog.at_level(logging.WARNING, "cachetally"), serving(app.state.server.config) as url:
        if http == "httptools":
            with connect(url) as partial:
                partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
                assert let_go(partial)
    warned = [r.getMessage() for r in caplog.records if "client_receive_timeout_s are not applied" in r.getMessage()]
    assert len(warned) == (http == "h11")


def test_vllms_bound_on_a_headers_fields_is_kept_under_httptools() -> None:
    """vLLM bounds a header's fields for uvicorn's h11 protocol (``h11_max_header_count``),
    which httptools ignored: one field too many, in one read, is refused with a 431."""
    config = uvicorn.Config(SlowToRead(), host="127.0.0.1", port=free_port(), http=with_client_bounds(60.0, 60.0),
                            lifespan="off", log_level="warning")
    config.h11_max_header_count = 8
    fields = b"".join(b"X-Field-%d: v\r\n" % i for i in range(6))  # with Host and Connection: 8
    with serving(config) as url:
        for extra, status in ((b"", b"200"), (b"X-One-More: v\r\n", b"431")):
            with connect(url) as client:
                client.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n" + fields + extra + b"Connection: close\r\n\r\n")
                assert client.recv(1 << 16).startswith(b"HTTP/1.1 " + status)


@pytest.mark.parametrize("configured", [None, 2 * H11_MAX_HEADER_BYTES])
def test_a_header_still_arriving_may_hold_the_bound_exactly_and_not_a_byte_more(configured: int | None) -> None:
    """uvicorn's h11 bound, h11's default or the config's (vLLM sets 4 MiB): a header still
    arriving with that many bytes, first or next on a kept-alive connection, is the client's to
    finish (let go at the receive bound, unanswered); with one byte more it is refused with a 431."""
    bound = configured or H11_MAX_HEADER_BYTES
    start = b"GET /a HTTP/1.1\r\nHost: x\r\nX-Pad: "
    with serving_in_thread(SlowToRead(), "header-bound", http=with_client_bounds(60.0, IN_THREAD_BOUND_S),
                           h11_max_incomplete_event_size=configured) as url:
        with connect(url) as whole, connect(url) as over, connect(url) as kept_alive:
            kept_alive.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            whole.sendall(start + b"p" * (bound - len(start)))
            over.sendall(start + b"p" * (bound + 1 - len(start)))
            assert over.recv(1 << 16).startswith(b"HTTP/1.1 431 ")
            assert let_go(whole)
            assert kept_alive.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
            kept_alive.sendall(start + b"p" * (bound - len(start)))  # the next header: the same bound
            assert let_go(kept_alive)


def test_a_header_too_large_behind_a_running_response_resets_and_never_answers_in_its_place() -> None:
    """The response running owns the connection's bytes: a 431 for the pipelined request
    behind it would reach the client as the answer to the first."""
    config = uvicorn.Config(SlowToRead(), host="127.0.0.1", port=free_port(), http=with_client_bounds(60.0, 60.0),
                            lifespan="off", log_level="warning")
    with serving(config) as url, connect(url) as client:
        client.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        # Past the bound by more than one read (what may arrive with the request before it is not counted).
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            client.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"h" * (1 << 20))
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(1 << 16):
                received += chunk
    assert b" 431 " not in received


class ReadsOnceLate:
    """An app that takes its request's first body message 0.8 bounds after the header, then
    answers 0.6 bounds later without asking for more: by then a client silent since that
    first part is past its bound."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(0.8 * WHOLE_BOUND_S)
        message = await receive()
        await asyncio.sleep(0.6 * WHOLE_BOUND_S)
        answer = str(len(message.get("body", b""))).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


def test_a_body_is_timed_from_the_clients_last_read_not_from_the_apps_receive() -> None:
    """The app's own delay in reading a body is not the client's: a client that stopped
    halfway is let go a bound after its last byte, though the app took that byte later."""
    with serving_in_thread(ReadsOnceLate(), "reads-late", http=with_client_bounds(60.0, WHOLE_BOUND_S)) as url:
        with connect(url) as stalled:
            stalled.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
            assert let_go(stalled)


def test_a_header_past_its_fields_while_still_arriving_is_refused_at_once() -> None:
    """A header that never ends, its fields past vLLM's bound already: a 431, not a hold
    until the receive bound lets it go unanswered."""
    config = uvicorn.Config(SlowToRead(), host="127.0.0.1", port=free_port(), http=with_client_bounds(60.0, 5.0),
                            lifespan="off", log_level="warning")
    config.h11_max_header_count = 8
    with serving(config) as url, connect(url) as client:
        client.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Field-%d: v\r\n" % i for i in range(12)))
        assert client.recv(1 << 16).startswith(b"HTTP/1.1 431 ")



class AsksAgainLate:
    """An app that takes a body's first part at once (its ``100 Continue``), asks for more
    0.8 bounds later, for a tenth of a bound, and answers 1.4 bounds after the first part."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await asyncio.sleep(0.8 * WHOLE_BOUND_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(receive(), 0.1 * WHOLE_BOUND_S)
        await asyncio.sleep(0.5 * WHOLE_BOUND_S)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def test_a_body_after_its_100_continue_is_timed_from_the_clients_reads_not_the_apps_asking() -> None:
    """Once the server's wait (the ``100 Continue``) is over, the client's bound runs from its
    own last byte: the app asking again later gives it no more time."""
    with serving_in_thread(AsksAgainLate(), "asks-again", http=with_client_bounds(60.0, WHOLE_BOUND_S)) as url:
        with connect(url) as stalled:
            stalled.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n")
            assert stalled.recv(1 << 16) == b"HTTP/1.1 100 Continue\r\n\r\n"
            stalled.sendall(b"hello")
            assert let_go(stalled)
