"""Bad input from clients, the proxy's own API key, and what must never reach a log.

Loopback servers in sim and upstream mode run at ``--log-level debug`` with their output
captured to a file, and with an API key (``CACHETALLY_API_KEY``) so every request also
exercises the key check; ``/health`` and ``/metrics`` are configured exempt. Every test
ends with the same log check: no prompt text, completion text, ``Authorization`` value,
API key, raw invalid request id, or traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Message

from proxy.server.app import CachetallyApp
from proxy.server.client_bounds import MAX_PIPELINED
from proxy.server.settings import Settings, SettingsError, load_settings
from proxy.upstream.engine import UpstreamEngine
from tests.load import count, log_failures, report
from tests.servers import running_server

KEY = "sk-KEYMARKER-" + uuid.uuid4().hex
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT_MARKER = "PROMPTMARKER"
ID_MARKER = "IDMARKER"
COMPLETION_MARKER = "tok1 tok2"  # the sim's generated text
SECRETS = (KEY, "KEYMARKER", PROMPT_MARKER, ID_MARKER, COMPLETION_MARKER)
SIM = ["-m", "engine_adapter.sim", "--log-level", "warning"]


@dataclass
class Server:
    url: str
    log: Path
    mode: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def other_sim() -> Iterator[str]:
    """A second upstream the proxy must never be steered to."""
    with running_server([*SIM, "--model", "model-b"]) as (url, _):
        yield url


@pytest.fixture(scope="module", params=["sim", "upstream"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("hostile") / f"{request.param}.log"
    env = {"CACHETALLY_API_KEY": KEY, "CACHETALLY_AUTH_EXEMPT_PATHS": "/health /metrics"}
    serve = ["-m", "proxy.server.cli", "serve", "--log-level", "debug"]
    with contextlib.ExitStack() as stack:
        if request.param == "sim":
            args = [*serve, "--engine", "sim"]
        else:
            upstream, _ = stack.enter_context(running_server([*SIM, "--model", "model-a"]))
            args = [*serve, "--upstream", upstream]
        url, _ = stack.enter_context(running_server(args, env=env, log_path=log))
        # One metered request, so the log holds a debug-level line whichever of this module's
        # tests run here (pytest -k, xdist's load), and the teardown's check reads one.
        assert httpx.post(f"{url}/v1/completions", json=completion(), headers=AUTH).status_code == 200
        yield Server(url, log, request.param)
    text = log.read_text(errors="replace")
    assert " DEBUG " in text  # the check ran against a debug-level log
    leaked = [secret for secret in SECRETS if secret in text]
    assert not leaked, f"{leaked} in the {request.param} server log"
    assert not log_failures(log)


def raw_exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes or ``timeout_s`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out and out.split(b"\r\n\r\n", 1)[1].endswith(b"}"):
                    break  # a complete JSON error body
    return out


def head(method: str, path: str, *headers: str, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"authorization: Bearer {KEY}", *headers]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_and_body(raw: bytes) -> tuple[int, bytes]:
    start, _, body = raw.partition(b"\r\n\r\n")
    return int(start.split(b" ", 2)[1]), body


def completion(prompt: str = f"{PROMPT_MARKER} hello", **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, **extra}


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.loopback
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json_is_an_openai_400(server: Server, body: bytes) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=AUTH)
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert resp.json()["error"]["type"] == "BadRequestError"


@pytest.mark.loopback
def test_a_64_mib_content_length_is_refused_with_413_before_the_body_arrives(server: Server) -> None:
    # The other 64 MiB never come: a server that waited for them would answer nothing.
    raw = raw_exchange(
        server.port, head("POST", "/v1/completions", "content-type: application/json", length=64 << 20) + b'{"pro'
    )
    status, body = status_and_body(raw)
    assert status == 413, raw[:200]
    assert orjson.loads(body)["error"]["type"] == "RequestEntityTooLargeError"


@pytest.mark.loopback
@pytest.mark.parametrize(
    "bad",
    [
        ID_MARKER + "x" * 200,  # too long
        ID_MARKER + "\x01\x7f",  # control characters
        ID_MARKER + "é",  # non-ASCII (sent as UTF-8)
        ID_MARKER + "%0d%0aset-cookie: a=b",  # an encoded CRLF injection
        ID_MARKER + " with spaces",
    ],
    ids=["too-long", "control", "non-ascii", "crlf-encoded", "spaces"],
)
def test_an_invalid_request_id_is_replaced_and_never_echoed(server: Server, bad: str) -> None:
    body = orjson.dumps(completion())
    raw = raw_exchange(
        server.port,
        head("POST", "/v1/completions", "content-type: application/json", length=len(body)).replace(
            b"\r\n\r\n", b"\r\nx-request-id: " + bad.encode() + b"\r\n\r\n"
        )
        + body,
    )
    assert ID_MARKER.encode() not in raw
    status, _ = status_and_body(raw)
    if status == 200:
        headers = dict(line.split(b": ", 1) for line in raw.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])
        assert len(headers[b"x-request-id"]) == 32  # a minted uuid4 hex
    else:
        assert status == 400  # the HTTP parser refused the header before the app saw it


@pytest.mark.loopback
def test_a_raw_crlf_in_a_request_id_cannot_inject_a_response_header(server: Server) -> None:
    # On the wire a CRLF ends the header: what follows is a separate request header that
    # is not echoed, and the id before it is a valid one.
    body = orjson.dumps(completion())
    raw = raw_exchange(
        server.port,
        head(
            "POST", "/v1/completions", "content-type: application/json",
            "x-request-id: safe-id\r\nset-cookie: injected=1", length=len(body),
        )
        + body,
    )
    assert status_and_body(raw)[0] == 200
    assert b"set-cookie" not in raw.lower() and b"injected" not in raw
    assert b"x-request-id: safe-id\r\n" in raw


@pytest.mark.loopback
def test_duplicated_and_large_headers_are_handled_and_oversized_ones_refused(server: Server) -> None:
    headers = {"x-dup-" + str(i % 3): "v" * 64 for i in range(100)} | {"x-big": "b" * 8192}
    dup = [("x-request-id", "one"), ("x-request-id", "two"), *AUTH.items(), *headers.items()]
    dup += [("x-same", "a")] * 100
    resp = httpx.post(f"{server.url}/v1/completions", json=completion(), headers=dup)
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] not in ("one", "two")  # two ids: neither is trusted
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.loopback
def test_a_header_past_the_bound_is_refused_with_431_and_never_held_whole(server: Server) -> None:
    """uvicorn's httptools parser bounds no header: a well-formed request with a 1 MiB header
    was served, and a header that never ended was held in memory as it came (150 MiB sent,
    the server's RSS up 260 MiB). Past 16 KiB still arriving, as uvicorn's h11 protocol, it
    is refused in OpenAI error JSON."""
    body = orjson.dumps(completion())
    start = head("POST", "/v1/completions", "content-type: application/json", length=len(body))
    raw = raw_exchange(server.port, start[:-2] + b"x-huge: " + b"h" * (20 << 10))  # no end yet
    status, answer = status_and_body(raw)
    assert (status, orjson.loads(answer)["error"]["code"]) == (431, 431)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as endless:
        endless.sendall(start[:-2] + b"x-huge: ")
        sent, chunk = 0, b"h" * (1 << 16)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            while sent < 256 << 20:
                sent += endless.send(chunk)
    # What the kernels' buffers hold on loopback, not the header: refused at its first 16 KiB.
    assert sent < 32 << 20
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.loopback
def test_a_pipelined_flood_is_cut_not_queued_and_a_few_pipelined_requests_are_answered(server: Server) -> None:
    """uvicorn queues each request pipelined behind a running one, without a bound, and reads
    on at every response's end: 40 MiB of 33-byte requests on one connection took the server
    from 42 MiB to 2.9 GiB. Past MAX_PIPELINED queued, the connection is reset."""
    request = head("GET", "/health")
    few = MAX_PIPELINED + 1  # one running, the rest queued behind it (one read holds them all)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request * few)
        assert answers_until_closed(sock, few) == [200] * few
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request * (few + 1))  # one queued past the bound: reset, never all answered
        assert len(answers_until_closed(sock, few + 1)) < few + 1
    flood = 4000
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(request * flood)
        answers = answers_until_closed(sock, flood)
    # Reset, not answered: a 400 written while a response runs would land inside its bytes.
    assert len(answers) <= few and set(answers) <= {200}, answers
    assert httpx.get(f"{server.url}/health").status_code == 200


def answers_until_closed(sock: socket.socket, most: int) -> list[int]:
    """The status of each response read until the server closes or resets the connection,
    or ``most`` came."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while out.count(b"HTTP/1.1 ") < most and (chunk := sock.recv(1 << 16)):
            out += chunk
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


@pytest.mark.loopback
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_wrong_method_is_an_openai_405(server: Server, method: str) -> None:
    resp = httpx.request(method, f"{server.url}/v1/chat/completions", headers=AUTH)
    assert resp.status_code == 405
    assert resp.json()["error"] == {
        "message": "Method Not Allowed", "type": "MethodNotAllowedError", "param": None, "code": 405,
    }
    assert resp.headers["allow"] == "POST"


@pytest.mark.loopback
@pytest.mark.parametrize("path", ["/metrics", "/stats", "/health"])
def test_a_wrong_method_on_our_own_routes_is_an_openai_405(server: Server, path: str) -> None:
    resp = httpx.post(f"{server.url}{path}", headers=AUTH)
    assert resp.status_code == 405
    assert resp.json()["error"]["type"] == "MethodNotAllowedError"
    assert resp.headers["allow"] == "GET, HEAD"


@pytest.mark.loopback
@pytest.mark.parametrize("server", ["sim"], indirect=True)  # upstream: the upstream's own 404 (test_upstream)
def test_an_unknown_route_is_an_openai_404(server: Server) -> None:
    resp = httpx.get(f"{server.url}/v1/no-such-route", headers=AUTH)
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}
    assert resp.headers["content-length"] == str(len(resp.content))


@pytest.mark.loopback
@pytest.mark.asyncio
@pytest.mark.parametrize("server", ["sim"], indirect=True)  # exact figures: the engine's events
async def test_concurrent_requests_sharing_one_id_each_get_their_own_cached_tokens(server: Server) -> None:
    n = count(1000, 1000)
    prefixes = [" ".join([uuid.uuid4().hex, *(f"w{j}" for j in range(10 + 7 * (i % 11)))]) for i in range(n)]
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as client:

        async def warm(prefix: str) -> int:
            resp = await client.post("/v1/completions", json={"prompt": prefix, "max_tokens": 1})
            return resp.json()["usage"]["prompt_tokens"]

        prompt_tokens = await asyncio.gather(*(warm(p) for p in prefixes))

    # A fresh client: idle keep-alive connections may be closed by the server meanwhile.
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as client:

        async def shared_id(prefix: str) -> httpx.Response:
            body = {"prompt": prefix + " " + uuid.uuid4().hex, "max_tokens": 1}
            return await client.post("/v1/completions", json=body, headers={"x-request-id": "shared-id"})

        responses = await asyncio.gather(*(shared_id(p) for p in prefixes))
    block = 16
    for resp, warmed in zip(responses, prompt_tokens, strict=True):
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "shared-id"
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == warmed // block * block
    assert len({warmed // block for warmed in prompt_tokens}) > 3  # the answers differ
    report("shared-request-id", requests=n, exact=n)


# -- the upstream is fixed by configuration ---------------------------------------------------


@pytest.mark.loopback
@pytest.mark.parametrize("server", ["upstream"], indirect=True)
def test_no_request_can_steer_the_upstream(server: Server, other_sim: str) -> None:
    other = other_sim.split("//", 1)[1]
    for target, extra in (
        (f"http://{other}/v1/models", ()),  # absolute-form request target
        ("/v1/models", (f"x-forwarded-host: {other}", f"forwarded: host={other}")),
        ("/v1/models", (f"x-original-url: http://{other}/v1/models", f"x-rewrite-url: http://{other}/")),
    ):
        raw = raw_exchange(server.port, head("GET", target, *extra, "connection: close").replace(
            b"host: 127.0.0.1", f"host: {other}".encode()
        ))
        status, body = status_and_body(raw)
        assert status == 200, raw[:300]
        assert [m["id"] for m in orjson.loads(body)["data"]] == ["model-a"]
    # A target that is not an absolute path never reaches the URL builder's host part
    # (httptools refuses it; h11 would pass it on as raw_path).
    raw = raw_exchange(server.port, head("GET", f"@{other}/v1/models", "connection: close"))
    assert status_and_body(raw)[0] == 400


@pytest.mark.asyncio
@pytest.mark.parametrize("target", [b"@evil.example/v1/models", b"http://evil.example/v1/models", b"evil"])
async def test_a_non_path_request_target_is_refused_upstream_not_forwarded(target: bytes) -> None:
    engine = UpstreamEngine(Settings(engine="upstream", upstream="http://127.0.0.1:9"))
    app = await engine.start()
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": target.decode(), "raw_path": target,
             "query_string": b"", "headers": []}
    try:
        assert engine.target_for(scope) is None
        await asyncio.wait_for(app(scope, receive, send), 5)
    finally:
        await engine.stop()
    assert sent[0]["status"] == 400


# -- the proxy's own API key -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def in_process(**settings: Any):
    app = CachetallyApp(Settings(engine="sim", **settings).validate())
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


@pytest.mark.asyncio
async def test_api_key_is_required_on_v1_routes_only() -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    async with in_process(api_key="k-123") as client:
        for headers in ({}, {"authorization": "Bearer k-12"}, {"authorization": "Bearer k-1234"},
                        {"authorization": "Basic k-123"}, {"authorization": "k-123"}):
            resp = await client.post("/v1/completions", json=body, headers=headers)
            assert resp.status_code == 401, headers
            assert resp.json()["error"] == {
                "message": "Missing or invalid API key", "type": "AuthenticationError", "param": None, "code": 401,
            }
            assert resp.headers["www-authenticate"] == "Bearer"
        two = [("authorization", "Bearer k-123"), ("authorization", "Bearer k-123")]
        assert (await client.post("/v1/completions", json=body, headers=two)).status_code == 401
        for scheme in ("Bearer", "bearer"):
            ok = await client.post("/v1/completions", json=body, headers={"authorization": f"{scheme} k-123"})
            assert ok.status_code == 200
        # As vLLM's own --api-key: /v1 routes need the key, probes and scrapes do not.
        assert (await client.get("/v1/models")).status_code == 401
        for path in ("/health", "/metrics", "/stats"):
            assert (await client.get(path)).status_code == 200


@pytest.mark.asyncio
async def test_every_prefix_vllms_own_key_guards_needs_the_key_here_too() -> None:
    """vLLM's ``--api-key`` guards ``/v1``, ``/v2`` (Cohere's v2 rerank), ``/inference`` and
    ``/cohere``: a request there without the key is refused before any route is looked up."""
    async with in_process(api_key="k") as client:
        for path in ("/v1/rerank", "/v2/rerank", "/inference/v1/generate", "/cohere/v1/rerank"):
            refused = await client.post(path, json={"model": "m", "query": "q", "documents": ["d"]})
            assert (refused.status_code, refused.headers.get("www-authenticate")) == (401, "Bearer"), path
            keyed = await client.post(path, json={}, headers={"authorization": "Bearer k"})
            assert keyed.status_code != 401, path


@pytest.mark.asyncio
async def test_a_guarded_route_under_the_root_path_needs_the_key_as_the_bare_one() -> None:
    """Behind a ``--root-path`` (vLLM's, or an ASGI server's), ``/api/v1/completions`` is the
    engine's ``/v1/completions``: it runs the engine and is billed, so it needs the key too."""
    app = CachetallyApp(Settings(engine="sim", api_key="k").validate())
    async with app.running():
        transport = httpx.ASGITransport(app=app, root_path="/api")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path in ("/api/v1/completions", "/v1/completions"):
                refused = await client.post(path, json={"prompt": "x", "max_tokens": 1})
                assert (refused.status_code, refused.headers.get("www-authenticate")) == (401, "Bearer"), path


@pytest.mark.asyncio
async def test_a_websocket_without_the_key_is_closed_as_a_policy_violation() -> None:
    """vLLM's realtime API is a WebSocket under ``/v1``: without the key it is closed with
    1008 (policy violation, RFC 6455), which a client tells apart from a normal close."""
    app = CachetallyApp(Settings(engine="sim", api_key="k").validate())
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async with app.running():
        scope = {"type": "websocket", "path": "/v1/realtime", "root_path": "", "headers": []}
        await app(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


@pytest.mark.asyncio
async def test_exempt_paths_are_open_and_only_those() -> None:
    async with in_process(api_key="k", auth_exempt_paths=["/v1/models"]) as client:
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/v1/models/")).status_code == 401
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 401
    async with in_process() as client:  # no key: open
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200


def test_api_key_comes_from_env_or_flag_and_is_never_printed() -> None:
    settings = load_settings(env={"CACHETALLY_API_KEY": "from-env", "CACHETALLY_AUTH_EXEMPT_PATHS": "/health"})
    assert (settings.api_key, settings.auth_exempt_paths) == ("from-env", ["/health"])
    assert "from-env" not in repr(settings)
    flags = load_settings(env={"CACHETALLY_API_KEY": "from-env"}, overrides={"api_key": "from-flag"})
    assert flags.api_key == "from-flag"
    # CACHETALLY_API_KEY=$UNSET in a template would open the server: refused, not read as "no key".
    for name in ("CACHETALLY_API_KEY", "CACHETALLY_API_KEYS_FILE"):
        with pytest.raises(SettingsError, match="empty; leave it unset"):
            load_settings(env={name: ""})
    with pytest.raises(SettingsError, match="empty; leave it unset"):
        load_settings(env={}, overrides={"api_key": ""})  # --api-key ''

    from proxy.server.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-key", "k", "--auth-exempt-path", "/health"])
    assert (args.api_key, args.auth_exempt_path) == ("k", ["/health"])


def test_secrets_in_urls_and_query_strings_never_reach_the_log(tmp_path: Path) -> None:
    """An OTLP endpoint's password or token (printed at start), and the keys clients put in
    query strings (uvicorn's access line, on by default): the log shows neither, only that
    they were there."""
    log = tmp_path / "serve.log"
    endpoint = "http://otlpuser:SECRET-PASS@127.0.0.1:9/v1/traces?token=SECRET-TOKEN"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--otlp-endpoint", endpoint]
    with running_server(args, log_path=log) as (url, _):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions?api_key=SECRET-QUERY&x=1", json=chat).status_code == 200
        assert httpx.get(f"{url}/health?token=SECRET-HEALTH").status_code == 200
        # A target that does not start with "/" has a query too: "*" (uvicorn logs "%2A"),
        # as a request and as a WebSocket handshake.
        port = int(url.rsplit(":", 1)[1])
        for upgrade in ("", "upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n"
                            "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"GET *?api_key=SECRET-STAR HTTP/1.1\r\nhost: h\r\n{upgrade}\r\n".encode())
                assert sock.recv(65536).startswith((b"HTTP/1.1 404", b"HTTP/1.1 403"))
    text = log.read_text(errors="replace")
    assert "SECRET" not in text
    assert "OTLP spans to http://***@127.0.0.1:9/v1/traces?***" in text
    assert '"POST /v1/chat/completions?*** HTTP/1.1" 200' in text and '"GET /health?*** HTTP/1.1" 200' in text
    assert '"GET %2A?*** HTTP/1.1" 404' in text and '"WebSocket %2A?***" 403' in text


def test_a_malformed_websocket_handshake_keeps_its_headers_out_of_the_debug_log(tmp_path: Path) -> None:
    """At debug the websockets library writes why it refused a handshake, with the traceback
    of the header it could not read, value and all: a key sent as a subprotocol
    (``openai-insecure-api-key.KEY``) in a list it cannot parse reached the log."""
    log = tmp_path / "serve.log"
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "debug"]
    with running_server(args, log_path=log) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        for header in ("sec-websocket-protocol: realtime openai-insecure-api-key.SECRET-PROTOCOL",
                       "sec-websocket-key: SECRET-KEY"):
            handshake = ["GET /v1/realtime HTTP/1.1", "host: h", "upgrade: websocket", "connection: Upgrade",
                         "sec-websocket-version: 13", "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==", header]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(("\r\n".join(handshake) + "\r\n\r\n").encode())
                # Refused either way: by the library (400), or, where an older one reads the list,
                # by the app, which closes it unaccepted (uvicorn 0.30: 403).
                assert sock.recv(65536).startswith((b"HTTP/1.1 400", b"HTTP/1.1 403"))
    assert "SECRET" not in log.read_text(errors="replace")
