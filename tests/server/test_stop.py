"""SIGTERM while chat and completions requests, JSON and streamed, are in flight, at a
moment Hypothesis draws: a real ``cachetally serve`` (sim engine, and in front of a sim
upstream), the official ``openai`` client.

Per request, what its client and the operator have after the stop: the whole answer, or
an OpenAI error (a 503 in error JSON while nothing was sent, an SSE ``error`` event that
ends a started stream), or, for one that came during the drain, no answer at all (a
refused or reset connection) and then no record, since it never ran; the record of every
request that ran in the files exactly once, or counted in the "usage records dropped" log
line; no prompt text and no traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2  # the openai client's HTTP library
import openai
import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from proxy.asgi.errors import STOPPED
from tests.servers import metric_value, running_server, serving_in_thread, wait_healthy

pytestmark = pytest.mark.loopback

TOKEN_DELAY = "0.05"
SHUTDOWN_TIMEOUT = "0.3"
#: (route, stream) of the four requests each example sends at once.
KINDS = [("chat", False), ("chat", True), ("completions", False), ("completions", True)]


@pytest.fixture(scope="module")
def upstream_sim() -> Iterator[str]:
    args = ["-m", "engine_adapter.sim", "--log-level", "warning", "--token-delay-s", TOKEN_DELAY,
            "--report-cached-tokens"]
    with running_server(args) as (url, _):
        yield url


def _ask(url: str, route: str, stream: bool, tokens: int, secret: str, rid: str) -> str:
    """What the client got: ``whole``, ``error`` (an OpenAI error it can read) or ``refused``."""
    extra = {"x-request-id": rid}
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            return _answer(client, route, stream, tokens, secret, extra)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503 and exc.response.headers["content-type"] == "application/json", exc
        assert orjson.loads(exc.response.content)["error"]["message"] == STOPPED
        return "error"
    except openai.APIConnectionError as exc:
        # No answer at all: refused, or closed by uvicorn before it read the request (a reset).
        # The test checks that no such request was run: it has no usage record.
        assert isinstance(exc.__cause__, (httpx2.ConnectError, httpx2.ReadError, httpx2.RemoteProtocolError)), exc
        return "refused"
    except openai.APIError as exc:  # the SSE error event of a started stream
        assert exc.message == STOPPED, exc
        return "error"


def _answer(client: openai.OpenAI, route: str, stream: bool, tokens: int, secret: str,
            extra: dict[str, str]) -> str:
    if route == "chat":
        messages = [{"role": "user", "content": secret}]
        answer = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=tokens,
                                                stream=stream, extra_headers=extra)
    else:
        answer = client.completions.create(model="sim-model", prompt=secret, max_tokens=tokens,
                                           stream=stream, extra_headers=extra)
    finished = [choice.finish_reason for chunk in answer for choice in chunk.choices] if stream \
        else [choice.finish_reason for choice in answer.choices]
    assert finished[-1] == "length", finished
    return "whole"


def _records(usage: Path) -> list[dict]:
    return [orjson.loads(line) for path in sorted(usage.glob("*.jsonl")) for line in path.read_bytes().splitlines()]


def _drops_logged(log: str) -> int:
    return sum(int(n) for line in re.findall(r"usage records dropped: (.*)", log)
               for n in re.findall(r"(\d+) \(jsonl: ", line))


@contextlib.contextmanager
def _serving(mode: str, tmp: Path, upstream_sim: str) -> Iterator[tuple[str, object, Path, Path]]:
    usage, log = tmp / "usage", tmp / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--usage-dir", str(usage), "--usage-flush-interval", "0.05"]
    args += ["--engine", "sim"] if mode == "sim" else ["--upstream", upstream_sim]
    env = {"CACHETALLY_SIM_TOKEN_DELAY_S": TOKEN_DELAY, "CACHETALLY_SHUTDOWN_TIMEOUT_S": SHUTDOWN_TIMEOUT}
    with running_server(args, env=env, log_path=log) as (url, proc):
        yield url, proc, usage, log


@pytest.mark.parametrize("mode", ["sim", "upstream"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(after_s=st.floats(0.0, 0.8), tokens=st.lists(st.integers(1, 30), min_size=4, max_size=4))
@example(after_s=0.5, tokens=[30, 30, 30, 30])  # all four still running when the drain ends
def test_sigterm_ends_each_request_in_flight_with_its_answer_or_an_openai_error_and_one_record(
    tmp_path_factory: pytest.TempPathFactory, upstream_sim: str, mode: str, after_s: float, tokens: list[int]
) -> None:
    tmp = tmp_path_factory.mktemp("stop")
    secret = f"secret-{uuid.uuid4().hex}"
    rids = [uuid.uuid4().hex for _ in KINDS]
    got: dict[str, str] = {}
    with _serving(mode, tmp, upstream_sim) as (url, proc, usage, log):
        def ask(i: int) -> None:
            route, stream = KINDS[i]
            try:
                got[rids[i]] = _ask(url, route, stream, tokens[i], secret, rids[i])
            except Exception as exc:  # noqa: BLE001 - a thread's failure is reported by the test
                got[rids[i]] = f"wrong: {exc!r}"

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(KINDS))]
        for client in clients:
            client.start()
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        # Arrives during the drain: refused, or served if uvicorn had not yet seen the signal.
        late = uuid.uuid4().hex
        got[late] = _ask(url, "chat", False, 1, secret, late)
        returncode = proc.wait(timeout=30)  # type: ignore[attr-defined]
        for client in clients:
            client.join(30)
    text = log.read_text()
    assert set(got) == {*rids, late} and set(got.values()) <= {"whole", "error", "refused"}, got
    assert returncode == 0  # a stop asked for and done
    assert secret not in text and "Traceback" not in text, text[-3000:]
    records = _records(usage)
    seen = [record["request_id"] for record in records]
    assert len(seen) == len(set(seen)), seen
    by_id = {record["request_id"]: record for record in records}
    missing = [rid for rid, outcome in got.items() if rid not in by_id and outcome != "refused"]
    assert len(missing) == _drops_logged(text), (missing, got)
    for rid, outcome in got.items():
        event(outcome)  # --hypothesis-show-statistics: how often each was seen
        if outcome == "refused":
            assert rid not in by_id, by_id[rid]
        elif rid in by_id:
            # A whole stream is completed though the sync openai client hangs up at [DONE],
            # before the upstream's end of the body reaches the proxy.
            assert by_id[rid]["outcome"] == ("completed" if outcome == "whole" else "error"), (by_id[rid], outcome)


def _hanging_upstream(arrived: threading.Event, first_chunk: bytes | None) -> object:
    """An upstream whose every route but ``/v1/models`` hangs, after ``first_chunk`` of a
    started response if one is given; ``arrived`` is set once such a request is in."""

    async def upstream(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":  # type: ignore[operator]
                await send({"type": "lifespan.startup.complete"})  # type: ignore[operator]
            await send({"type": "lifespan.shutdown.complete"})  # type: ignore[operator]
            return
        body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
        if scope["path"] != "/v1/models":
            if first_chunk is not None:
                await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                            "headers": [(b"content-type", b"text/plain")]})
                chunk = {"type": "http.response.body", "body": first_chunk, "more_body": True}
                await send(chunk)  # type: ignore[operator]
            arrived.set()
            await asyncio.sleep(60)  # never ends: its server cancels it when the test ends
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})  # type: ignore[operator]

    return upstream


@contextlib.contextmanager
def _stopped_once_arrived(tmp_path: Path, first_chunk: bytes | None) -> Iterator[tuple[str, Path]]:
    """``cachetally serve`` in front of :func:`_hanging_upstream`, SIGTERMed once a request
    hangs there; yields (base URL, log) and checks, after the body, that it exited 0."""
    arrived = threading.Event()
    log = tmp_path / "serve.log"
    env = {"CACHETALLY_SHUTDOWN_TIMEOUT_S": SHUTDOWN_TIMEOUT}
    with serving_in_thread(_hanging_upstream(arrived, first_chunk), "upstream") as upstream_url, \
            running_server(["-m", "proxy.server.cli", "serve", "--upstream", upstream_url], env=env,
                           log_path=log) as (url, proc):
        def stop_once_arrived() -> None:
            assert arrived.wait(30)
            proc.send_signal(signal.SIGTERM)

        stopper = threading.Thread(target=stop_once_arrived)
        stopper.start()
        try:
            yield url, log
        finally:
            stopper.join()
        assert proc.wait(timeout=30) == 0


def test_sigterm_ends_a_passed_through_request_still_running_with_a_503_in_openai_json(tmp_path: Path) -> None:
    """In upstream mode a route cachetally does not meter (here embeddings, billing off) is
    passed through; still running when the drain ends, it gets the same 503."""
    with _stopped_once_arrived(tmp_path, None) as (url, log), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client, \
            pytest.raises(openai.APIStatusError) as raised:
        client.embeddings.create(model="m", input="a secret text")
    assert raised.value.status_code == 503
    assert orjson.loads(raised.value.response.content)["error"]["message"] == STOPPED
    text = log.read_text()
    assert "a secret text" not in text and "Traceback" not in text, text[-3000:]


def test_sigterm_cuts_a_passed_through_response_already_started_without_a_traceback(tmp_path: Path) -> None:
    """A passed-through response the drain leaves running after part of its body went out
    cannot be told of the stop: its body is cut (no chunked end, so the client sees it is
    short) and one warning says so. Found by a probe: the cancellation was let through to
    uvicorn, which logged a traceback."""
    with _stopped_once_arrived(tmp_path, b"part of a body") as (url, log), httpx2.Client(timeout=30) as client, \
            client.stream("POST", f"{url}/v1/embeddings", json={"model": "m", "input": "a secret text"}) as answer:
        assert answer.status_code == 200
        with pytest.raises(httpx2.RemoteProtocolError):  # incomplete chunked read
            answer.read()
    text = log.read_text()
    assert "a secret text" not in text and "Traceback" not in text and "cut" in text, text[-3000:]


def test_a_stream_whose_client_stopped_reading_keeps_its_record_through_the_stop(tmp_path: Path) -> None:
    """A stream still running when the drain ends, to a client that reads nothing more (its
    buffers full): no answer can reach it, and its record is written all the same, its cut
    logged in one line. Found
    by this test: the SSE error event waited on the client, so the request's record came
    after the recorder's final drain and was dropped (before that event, it won the race)."""
    usage, log = tmp_path / "usage", tmp_path / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--usage-dir", str(usage), "--usage-flush-interval", "0.05",
            "--engine", "sim"]
    env = {"CACHETALLY_SIM_TOKEN_DELAY_S": "0", "CACHETALLY_SHUTDOWN_TIMEOUT_S": SHUTDOWN_TIMEOUT}
    rid = uuid.uuid4().hex
    body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 10_000_000, "stream": True})
    with running_server(args, env=env, log_path=log) as (url, proc):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
            time.sleep(1.0)  # the stream fills the socket buffers: a send now waits on the client
            proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            assert proc.wait(timeout=30) == 0  # type: ignore[attr-defined]
    text = log.read_text()
    assert _drops_logged(text) == 0, text[-3000:]
    # Cut, not failed: the stop's own warning says so (the CancelledError was let through
    # to uvicorn, which logged it with a traceback).
    assert "Traceback" not in text and "cut" in text, text[-3000:]
    records = [record for record in _records(usage) if record["request_id"] == rid]
    assert [record["outcome"] for record in records] == ["error"], records
    assert records[0]["completion_tokens"] > 0


def _response(client: socket.socket) -> bytes:
    """Everything the server sends on ``client`` until it closes the connection."""
    client.settimeout(30)
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("mode", ["sim", "upstream"])
def test_a_request_whose_body_is_still_coming_when_the_drain_ends_gets_the_503_in_openai_json(
    tmp_path: Path, upstream_sim: str, mode: str
) -> None:
    """A client sent its headers and part of its body, then nothing more: still reading it
    when the drain ends, the request gets the stop's 503 and one record. Found by a probe:
    the cancellation came while the body was read, outside the stop's answer, so uvicorn
    logged a traceback and answered a plain-text 500."""
    rid = uuid.uuid4().hex
    secret = f"secret-{uuid.uuid4().hex}"
    body = orjson.dumps({"model": "sim-model", "prompt": secret, "max_tokens": 5})
    with _serving(mode, tmp_path, upstream_sim) as (url, proc, usage, log):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body[:-10]))
            wait_healthy(url, proc)  # a request after it: the first is in the app, reading its body
            proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            answer = _response(client)
        assert proc.wait(timeout=30) == 0  # type: ignore[attr-defined]
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"content-type: application/json" in head.lower(), answer
    assert orjson.loads(content)["error"]["message"] == STOPPED
    text = log.read_text()
    assert secret not in text and "Traceback" not in text, text[-3000:]
    assert [record["outcome"] for record in _records(usage) if record["request_id"] == rid] == ["error"]


def _processes(pid: int) -> list[int]:
    """``pid`` and its children (the workers of ``--workers N``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_twice_ends_each_request_in_flight_with_an_openai_error_and_keeps_its_record(
    tmp_path: Path, workers: str
) -> None:
    """Ctrl-C twice in a terminal (SIGINT to every process of the group; uvicorn's force
    quit): the requests still running end at once with the stop's 503 or SSE error, and
    their records are written. Found by a probe: with several workers, a worker skipped the
    app's shutdown and then died by the SIGTERM its parent had sent, so their records and
    any not yet flushed were lost and counted nowhere; with one, uvicorn's plain-text 500, a
    cut stream and tracebacks."""
    usage, log = tmp_path / "usage", tmp_path / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--usage-dir", str(usage), "--engine", "sim", "--workers", workers]
    env = {"CACHETALLY_SIM_TOKEN_DELAY_S": TOKEN_DELAY, "CACHETALLY_SHUTDOWN_TIMEOUT_S": "60"}
    secret = f"secret-{uuid.uuid4().hex}"
    rids = {"json": uuid.uuid4().hex, "stream": uuid.uuid4().hex}
    answers = {}
    with running_server(args, env=env, log_path=log) as (url, proc):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        clients = {kind: socket.create_connection((host, int(port))) for kind in rids}
        for kind, client in clients.items():
            body = orjson.dumps({"model": "sim-model", "prompt": secret, "max_tokens": 2000,
                                 "stream": kind == "stream"})
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rids[kind].encode(), len(body), body))
        while metric_value(httpx2.get(f"{url}/metrics").text, "cachetally_ledger_open_slots") < 2:
            time.sleep(0.05)  # both are running (the gauge sums every worker's)
        for _ in range(2):  # the second while the first's drain waits on them (60 s)
            for pid in _processes(proc.pid):
                os.kill(pid, signal.SIGINT)
            time.sleep(0.5)
        for kind, client in clients.items():
            with client:
                answers[kind] = _response(client)
        assert proc.wait(timeout=30) == 0  # type: ignore[attr-defined]
    head, _, content = answers["json"].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and orjson.loads(content)["error"]["message"] == STOPPED, answers
    assert STOPPED.encode() in answers["stream"] and answers["stream"].endswith(b"\r\n0\r\n\r\n"), answers
    text = log.read_text()
    assert secret not in text and "Traceback" not in text, text[-3000:]
    outcomes = {record["request_id"].split(".")[0]: record["outcome"] for record in _records(usage)}
    assert outcomes == {rids["json"]: "error", rids["stream"]: "error"}, (outcomes, text[-3000:])


def _workers(pid: int) -> list[int]:
    """The workers among ``pid``'s children, in the order they were started (not
    multiprocessing's resource tracker)."""
    return [child for child in _processes(pid)[1:] if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie until its parent reaps it, or gone)."""
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_a_worker_that_the_stop_itself_ended_is_not_replaced(tmp_path: Path) -> None:
    """A Ctrl-C reaches the supervisor and every worker. One with nothing to drain stops at
    once, while the supervisor is still in a round of health checks and has not read the
    signal: it must not start a replacement for it. Found in CI by the Ctrl-C test above:
    the replacement, cut in the middle of its imports by the second Ctrl-C, logged a
    traceback. The schedule is forced: the first worker, paused, holds the supervisor in its
    health check while the stop reaches the supervisor and the second worker."""
    log = tmp_path / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--usage-dir", str(tmp_path / "usage"), "--engine", "sim",
            "--workers", "2"]
    with running_server(args, log_path=log) as (_, proc):
        first, second = _workers(proc.pid)
        os.kill(first, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # the supervisor's round (every 0.5 s) now waits on the first's answer (5 s)
            os.kill(proc.pid, signal.SIGINT)
            os.kill(second, signal.SIGINT)
            deadline = time.monotonic() + 30
            while not _exited(second):
                assert time.monotonic() < deadline, "the second worker did not stop"
                time.sleep(0.01)
        finally:
            os.kill(first, signal.SIGINT)
            os.kill(first, signal.SIGCONT)
        started = set()
        while proc.poll() is None:  # type: ignore[attr-defined]
            with contextlib.suppress(FileNotFoundError):
                started.update(_workers(proc.pid))
            time.sleep(0.01)
        assert proc.returncode == 0  # type: ignore[attr-defined]
    text = log.read_text()
    assert started <= {first, second} and "died" not in text and "Traceback" not in text, (started, text[-3000:])


def test_a_request_pipelined_behind_one_the_drain_ended_is_told_the_server_stopped(
    tmp_path: Path, upstream_sim: str
) -> None:
    """Two requests sent at once on one connection: the second waits in uvicorn until the
    first ends, which the drain's end does; uvicorn then runs it, after the app stopped. It
    never ran on the engine: the stop's 503, and no record. Found by a probe: it was told
    "cachetally is not running (engine not started)"."""
    rids = [uuid.uuid4().hex, uuid.uuid4().hex]
    with _serving("sim", tmp_path, upstream_sim) as (url, proc, usage, log):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as client:
            for rid in rids:
                body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2000})
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
            wait_healthy(url, proc)  # a request after them: the first is in the app
            proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            answer = _response(client)
        assert proc.wait(timeout=30) == 0  # type: ignore[attr-defined]
    assert answer.count(b"HTTP/1.1 503 ") == 2 and answer.count(STOPPED.encode()) == 2, answer
    assert {record["request_id"]: record["outcome"] for record in _records(usage)} == {rids[0]: "error"}
