"""Upstream mode: cachetally as a drop-in proxy in front of a running server.

Loopback tests run the standalone sim (``python -m engine_adapter.sim``) as a subprocess
and cachetally in process, served by a real uvicorn on 127.0.0.1 in a thread; both are
always stopped. Message-level and in-process tests cover what a real server cannot be
made to do on cue (a read error at an exact byte, a client leaving at an exact point).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from engine_adapter.engine import Engine
from proxy.asgi.errors import error_body
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from proxy.upstream.client import POOL_FULL, TIMED_OUT, UNREACHABLE, Origin, UpstreamFailure
from proxy.upstream.engine import UpstreamEngine
from proxy.upstream.forward import UpstreamBodyError
from proxy.upstream.hop_headers import declared_length, request_headers, response_headers
from proxy.upstream.pool import Http1Pool
from tests.servers import free_port, metric_value, running_server, serving_in_thread
from tests.upstream_fakes import AsgiClient, ScriptedClient, ScriptedResponse, Sent

loopback = pytest.mark.loopback
SIM = ["-m", "engine_adapter.sim", "--log-level", "warning"]


# -- fixtures: the sim as a subprocess, cachetally in a uvicorn thread --------------------


@dataclass
class Sim:
    url: str
    proc: Any


@dataclass
class Proxy:
    url: str
    app: CachetallyApp

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)

    def settle(self, name: str, expected: float, timeout_s: float = 2.0, **labels: str) -> float:
        """Poll a gauge until it equals ``expected`` (the server finishes after the client)."""
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name, **labels)) != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        return value


@pytest.fixture
def start_sim() -> Iterator[Callable[..., Sim]]:
    with contextlib.ExitStack() as stack:

        def start(*args: str) -> Sim:
            url, proc = stack.enter_context(running_server([*SIM, *args], timeout_s=20))
            return Sim(url, proc)

        yield start


@pytest.fixture
def start_proxy(start_sim: Callable[..., Sim]) -> Iterator[Callable[..., Proxy]]:
    # Depends on start_sim so proxies stop before the sims they front.
    with contextlib.ExitStack() as stack:

        def start(upstream: str, **overrides: Any) -> Proxy:
            settings = Settings(engine="upstream", upstream=upstream, **overrides).validate()
            app = CachetallyApp(settings)
            return Proxy(stack.enter_context(serving_in_thread(app, "cachetally")), app)

        yield start


def fresh_prompt(words: int = 599) -> str:
    """A prompt of ``words + 1`` sim tokens whose blocks are new to the cache."""
    return " ".join([uuid.uuid4().hex, *(f"w{i}" for i in range(words))])


def events(raw: bytes) -> list[Any]:
    """The data of every SSE event; ``[DONE]`` stays a string."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        event = event.removeprefix(b"event: error\n")  # the relay's own error event is named
        if event.startswith(b"data: "):
            data = event[len(b"data: ") :]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def without_ids(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def stream_bytes(url: str, body: dict[str, Any], **kwargs: Any) -> tuple[httpx.Response, bytes]:
    with httpx.Client(timeout=10) as client, client.stream("POST", url, json=body, **kwargs) as resp:
        return resp, b"".join(resp.iter_raw())


# -- loopback: accounting --------------------------------------------------------------------


@loopback
def test_cached_tokens_come_from_the_upstream_report(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim("--report-cached-tokens")
    proxy = start_proxy(sim.url)
    prompt = fresh_prompt()
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        cold = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        warm = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        stream = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages = [chunk.usage for chunk in stream if chunk.usage is not None]
        chat_warm = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": prompt}], max_tokens=2
        )
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.prompt_tokens == 600
    assert cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens == 592
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == 0  # the chat template: new blocks
    assert chat_warm.usage is not None and chat_warm.usage.prompt_tokens_details is not None
    chat_cached = chat_warm.usage.prompt_tokens_details.cached_tokens
    assert chat_cached == ((chat_warm.usage.prompt_tokens - 1) // 16) * 16
    metrics = proxy.metrics()
    assert metric_value(metrics, "cachetally_cached_tokens_total", source="upstream", tier="all") == (
        592 + chat_cached
    )
    assert metric_value(metrics, "cachetally_requests_total", cache="hit") == 2
    assert metric_value(metrics, "cachetally_requests_total", cache="miss") == 2
    assert metric_value(metrics, "cachetally_requests_total", cache="unknown") == 0


@loopback
def test_without_a_report_cached_tokens_is_zero_and_unknown(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim()
    proxy = start_proxy(sim.url)
    prompt = fresh_prompt()
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        for _ in range(2):
            result = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
            assert result.usage is not None and result.usage.prompt_tokens_details is not None
            assert result.usage.prompt_tokens_details.cached_tokens == 0  # the `missing` policy
    metrics = proxy.metrics()
    assert metric_value(metrics, "cachetally_requests_total", cache="unknown") == 2
    assert metric_value(metrics, "cachetally_cached_tokens_total") == 0


@loopback
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_ghost_usage_leaves_the_clients_stream_byte_identical(
    start_sim: Any, start_proxy: Any, route: str
) -> None:
    sim = start_sim("--report-cached-tokens")
    proxy = start_proxy(sim.url)
    prompt = fresh_prompt(100)
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 3, "stream": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if "chat" in route else {"prompt": prompt}
    _, direct = stream_bytes(sim.url + route, body)
    resp, proxied = stream_bytes(proxy.url + route, body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert b"usage" not in proxied
    assert without_ids(proxied) == without_ids(direct)
    # ... yet the proxy saw the usage it asked for, and counted the request (a hit: the
    # direct request warmed the sim's cache).
    name = "chat" if "chat" in route else "completions"
    assert proxy.metric("cachetally_requests_total", route=name, stream="true", cache="hit") == 1
    assert proxy.metric("cachetally_prompt_tokens_total") > 100


@loopback
def test_continuous_usage_chunks_gain_cached_tokens(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim("--report-cached-tokens")
    proxy = start_proxy(sim.url)
    prompt = fresh_prompt()
    body = {
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    stream_bytes(proxy.url + "/v1/completions", body)  # cold
    _, raw = stream_bytes(proxy.url + "/v1/completions", body)
    chunks = [e for e in events(raw) if isinstance(e, dict)]
    assert len(chunks) == 4 and all("usage" in c for c in chunks)
    cached = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks]
    # The upstream reports the number only in its final usage chunk; the continuous ones
    # before it follow the `missing` policy (zero) rather than stay without the field.
    assert cached == [0, 0, 0, 592]
    assert chunks[-1]["choices"] == []


# -- loopback: pass-through and failures ---------------------------------------------------


@loopback
def test_upstream_errors_and_other_routes_pass_through_intact(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim()
    proxy = start_proxy(sim.url)
    for method, path, content in (
        ("POST", "/v1/chat/completions", b'{"model": "gpt-x", "messages": []}'),
        ("POST", "/v1/completions", b'{"model": "sim-model"}'),
        ("POST", "/v1/completions", b'{"prompt": "x", "n": 0}'),
        ("GET", "/v1/nowhere", b""),
    ):
        headers = {"content-type": "application/json"}
        direct = httpx.request(method, sim.url + path, content=content, headers=headers)
        proxied = httpx.request(method, proxy.url + path, content=content, headers=headers)
        assert 400 <= direct.status_code < 500
        assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)
        assert proxied.headers["content-type"] == direct.headers["content-type"]
    models = httpx.get(proxy.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["sim-model"]
    assert proxy.metric("cachetally_requests_total") == 0  # refused requests are not counted


@loopback
def test_upstream_down_is_502_in_openai_json(start_proxy: Any) -> None:
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2.0)
    resp = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "BadGatewayError"
    assert resp.json()["error"]["code"] == 502
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.models.list()
    assert info.value.status_code == 502
    assert proxy.metric("cachetally_ledger_open_slots") == 0


@loopback
def test_read_timeout_is_504_before_headers_and_an_sse_event_after(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim("--token-delay-s", "1.0")
    proxy = start_proxy(sim.url, read_timeout_s=0.3)
    # Without the read timeout the sim would answer 200 after its 3 s of tokens.
    resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "GatewayTimeoutError"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    resp, raw = stream_bytes(proxy.url + "/v1/chat/completions", body)
    assert resp.status_code == 200
    last = events(raw)[-1]
    assert last["error"]["code"] == 504
    assert "[DONE]" not in events(raw)
    assert proxy.settle("cachetally_ledger_open_slots", 0) == 0
    assert proxy.settle("cachetally_upstream_connections_checked_out", 0) == 0


@loopback
def test_killing_the_upstream_mid_stream_ends_the_stream_with_an_error_event(
    start_sim: Any, start_proxy: Any
) -> None:
    sim = start_sim("--token-delay-s", "0.1", "--report-cached-tokens")
    proxy = start_proxy(sim.url)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    received = b""
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body
    ) as resp:
        chunks = resp.iter_raw()
        while b"tok1" not in received:
            received += next(chunks)
        assert proxy.metric("cachetally_upstream_connections_checked_out") == 1
        killed = time.monotonic()
        sim.proc.kill()
        received += b"".join(chunks)
        waited = time.monotonic() - killed
    assert waited < 1.0, f"the client waited {waited:.3f} s after the upstream died"
    parsed = events(received)
    error = parsed[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("BadGatewayError", 502)
    assert "[DONE]" not in parsed
    assert proxy.settle("cachetally_ledger_open_slots", 0) == 0
    assert proxy.settle("cachetally_upstream_connections_checked_out", 0) == 0
    assert proxy.metric("cachetally_upstream_connections_open") == 0


@loopback
def test_killing_the_upstream_before_a_json_response_is_502(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim("--token-delay-s", "0.2")
    proxy = start_proxy(sim.url)
    killer = threading.Timer(0.5, sim.proc.kill)
    killer.start()
    try:
        resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 50}, timeout=10)
    finally:
        killer.join()
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "BadGatewayError"
    assert proxy.settle("cachetally_ledger_open_slots", 0) == 0
    assert proxy.settle("cachetally_upstream_connections_checked_out", 0) == 0


async def dies_mid_json(scope: Any, receive: Any, send: Any) -> None:
    """An upstream that starts a 200 JSON answer to a chat and dies in its body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/v1/models":
        body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")]})
    await send({"type": "http.response.body", "body": b'{"id":"chatcmpl-x","choices":[', "more_body": True})
    raise RuntimeError("the upstream dies mid-body")  # uvicorn drops the connection


@loopback
def test_an_upstream_that_dies_in_a_json_body_is_a_502_in_openai_json(start_proxy: Any) -> None:
    """The JSON body is held to be patched, so the client has had nothing yet: it gets an
    OpenAI error, not a dropped connection or the server's plain-text 500."""
    with serving_in_thread(dies_mid_json, "upstream") as upstream:
        proxy = start_proxy(upstream)
        resp = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
        assert resp.status_code == 502
        assert resp.json()["error"]["type"] == "BadGatewayError"
        assert proxy.settle("cachetally_ledger_open_slots", 0) == 0


@loopback
def test_a_client_that_leaves_closes_the_upstream_stream(start_sim: Any, start_proxy: Any) -> None:
    sim = start_sim("--token-delay-s", "0.1")
    proxy = start_proxy(sim.url)
    # A prompt of token ids: its count asks nothing of the upstream (proxy.upstream.prompt_count),
    # whose /tokenize would leave a connection of its own idle in the pool.
    body = {"prompt": [1, 2], "max_tokens": 200, "stream": True}
    url = proxy.url + "/v1/completions"
    with httpx.Client(timeout=10) as client, client.stream("POST", url, json=body) as resp:
        chunks = resp.iter_raw()
        while b"tok1" not in next(chunks):
            pass
        assert proxy.metric("cachetally_upstream_connections_open") == 1
    # The client closed its connection mid-stream: the proxy closes its upstream one.
    assert proxy.settle("cachetally_upstream_connections_open", 0) == 0
    assert proxy.metric("cachetally_upstream_connections_checked_out") == 0
    assert proxy.settle("cachetally_ledger_open_slots", 0) == 0
    # ... and the pool still serves the next request.
    assert httpx.get(proxy.url + "/v1/models").status_code == 200


# -- in process: a llama.cpp-shaped upstream reporting only timings.cache_n -----------------


LLAMA_CPP_TIMINGS = {"cache_n": 256, "prompt_n": 44, "prompt_ms": 30.1, "predicted_n": 2, "predicted_ms": 16}


async def llama_cpp(request: Request) -> Response:
    body = orjson.loads(await request.body())
    usage = {"completion_tokens": 2, "prompt_tokens": 300, "total_tokens": 302}
    if not body.get("stream"):
        message = {"role": "assistant", "content": "a b"}
        return JSONResponse(
            {"choices": [{"finish_reason": "length", "index": 0, "message": message}],
             "created": 1, "model": "gguf", "object": "chat.completion", "usage": usage, "id": "chatcmpl-1",
             "timings": LLAMA_CPP_TIMINGS}
        )
    head = {"created": 1, "id": "chatcmpl-2", "model": "gguf", "object": "chat.completion.chunk"}
    chunks = [
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "a"}}], **head},
        {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **head, "usage": usage,
         "timings": LLAMA_CPP_TIMINGS},
    ]
    data = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return Response(data, media_type="text/event-stream")


@contextlib.asynccontextmanager
async def in_process(upstream_app: Any, upstream: str = "http://fake-upstream:9") -> AsyncIterator[Any]:
    settings = Settings(engine="upstream", upstream=upstream).validate()
    app = CachetallyApp(settings, engine_factory=lambda sink: UpstreamEngine(settings, lambda origin: AsgiClient(upstream_app, origin)))
    async with app.running(), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://cachetally"
    ) as client:
        yield client, app


async def starlette_endpoint(scope: Any, receive: Any, send: Any) -> None:
    response = await llama_cpp(Request(scope, receive))
    await response(scope, receive, send)


@pytest.mark.asyncio
async def test_llama_cpp_timings_cache_n_becomes_the_standard_field() -> None:
    async with in_process(starlette_endpoint) as (client, app):
        messages = [{"role": "user", "content": "hi"}]
        resp = await client.post("/v1/chat/completions", json={"messages": messages})
        assert resp.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
        assert resp.json()["timings"] == LLAMA_CPP_TIMINGS  # the vendor field stays
        resp = await client.post("/v1/chat/completions", json={"messages": messages, "stream": True})
        final = [e for e in events(resp.content) if isinstance(e, dict) and "usage" in e]
        assert [e["usage"]["prompt_tokens_details"] for e in final] == [{"cached_tokens": 256}]
        metrics = app.metrics.exposition().decode()
    assert metric_value(metrics, "cachetally_cached_tokens_total", source="upstream", tier="all") == 512
    assert metric_value(metrics, "cachetally_requests_total", cache="hit") == 2


# -- in process: what is forwarded -------------------------------------------------------------


async def echo(scope: Any, receive: Any, send: Any) -> None:
    body = await Request(scope, receive).body()
    seen = {
        "method": scope["method"],
        "raw_path": scope["raw_path"].decode(),
        "query": scope["query_string"].decode(),
        "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
        "body": body.decode(),
    }
    extra = {"keep-alive": "timeout=5", "x-upstream": "yes", "server": "fake", "connection": "keep-alive"}
    await JSONResponse(seen, headers=extra)(scope, receive, send)


@pytest.mark.asyncio
async def test_request_is_forwarded_with_path_query_and_end_to_end_headers_only() -> None:
    async with in_process(echo, "http://fake-upstream:9/base/") as (client, _):
        resp = await client.post(
            "/v1/chat/completions?a=1&b=%2F",
            content=b'{"messages": [{"role": "user", "content": "hi"}]}',
            headers={
                "authorization": "Bearer sk-secret",
                "accept-encoding": "gzip, br",
                "connection": "keep-alive, x-hop",
                "x-hop": "1",
                "keep-alive": "timeout=5",
                "te": "trailers",
                "proxy-authorization": "Basic abc",
                "x-custom": "kept",
                "content-type": "application/json",
            },
        )
        seen = resp.json()
        assert resp.headers["x-upstream"] == "yes"
        assert "keep-alive" not in resp.headers
        assert resp.headers.get("server") != "fake"
        headers = dict(seen["headers"])
        assert (seen["method"], seen["raw_path"]) == ("POST", "/base/v1/chat/completions")
        assert seen["query"] == "a=1&b=%2F"
        assert headers["host"] == "fake-upstream:9"
        assert headers["authorization"] == "Bearer sk-secret"
        # the one value: the client's gzip beside it would have the upstream encode what is patched
        assert [value for name, value in seen["headers"] if name == "accept-encoding"] == ["identity"]
        assert headers["x-custom"] == "kept"
        assert headers["x-request-id"]  # the proxy's request key, for the engine's logs
        assert int(headers["content-length"]) == len(seen["body"])
        for hop in ("connection", "x-hop", "keep-alive", "te", "proxy-authorization"):
            assert hop not in headers
        # Only what the client sent: none of httpx's own defaults.
        assert "user-agent" in headers and headers["user-agent"] == dict(resp.request.headers)["user-agent"]
        resp = await client.get("/v1/models?x=%20y", headers={"accept-encoding": "gzip"})
        seen = resp.json()
        assert (seen["method"], seen["raw_path"], seen["query"]) == ("GET", "/base/v1/models", "x=%20y")
        assert dict(seen["headers"])["accept-encoding"] == "gzip"  # not parsed: left alone
        resp = await client.get("/v1/models", headers={"accept-encoding": "", "user-agent": ""})
        sent = {name for name, _ in resp.json()["headers"]}
        assert sent == {"host", "accept", "connection", "accept-encoding", "user-agent"} - {"connection"}


def test_hop_by_hop_headers_are_dropped_both_ways() -> None:
    raw = [
        (b"Host", b"client"), (b"Connection", b"close, X-Foo"), (b"X-Foo", b"1"), (b"Upgrade", b"h2c"),
        (b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"3"), (b"X-Keep", b"a"), (b"X-Keep", b"b"),
        (b"Trailer", b"X-Checksum"),  # announces trailers of a framing the proxy does not keep
    ]
    assert request_headers(raw) == [(b"X-Keep", b"a"), (b"X-Keep", b"b")]
    assert declared_length(raw) == 3
    assert declared_length([(b"content-length", b"-1")]) is None
    upstream = [(b"date", b"x"), (b"server", b"y"), (b"content-length", b"3"), (b"te", b"z"), (b"trailer", b"x-sum")]
    assert response_headers(upstream) == [(b"content-length", b"3")]


# -- message level: failures at exact points -------------------------------------------------


def engine_with(respond: Callable[[Sent], ScriptedResponse]) -> UpstreamEngine:
    client = ScriptedClient(respond)
    return UpstreamEngine(Settings(engine="upstream", upstream="http://up:1"), lambda origin: client)


def http_scope(path: str = "/v1/chat/completions", method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
    }


async def drive(
    engine: UpstreamEngine, disconnect: asyncio.Event | None = None, scope: dict[str, Any] | None = None
) -> list[Message]:
    app = await engine.start()
    sent: list[Message] = []
    first = True

    async def receive() -> Message:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await (disconnect or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    try:
        await asyncio.wait_for(app(scope or http_scope(), receive, send), 5)
    finally:
        await engine.stop()
    return sent


def sse_response(stream: ScriptedResponse) -> Callable[[Sent], ScriptedResponse]:
    stream.headers = [(b"content-type", b"text/event-stream")]
    return lambda request: stream


RESET = UpstreamFailure(UNREACHABLE, "ClientPayloadError")
SLOW = UpstreamFailure(TIMED_OUT, "SocketTimeoutError")


@pytest.mark.asyncio
@pytest.mark.parametrize(("error", "status"), [(RESET, 502), (SLOW, 504)])
async def test_mid_stream_failure_sends_one_sse_error_event_and_closes(error: UpstreamFailure, status: int) -> None:
    stream = ScriptedResponse([b'data: {"a":1}\n\n', b'data: {"b":'], error)
    sent = await drive(engine_with(sse_response(stream)))
    assert sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[:2] == [b'data: {"a":1}\n\n', b'data: {"b":']
    # The half-sent event is closed first, so the error event parses on its own.
    assert bodies[2].startswith(b"\n\nevent: error\ndata: ")
    assert orjson.loads(bodies[2][len(b"\n\nevent: error\ndata: ") :])["error"]["code"] == status
    assert sent[-1]["more_body"] is False and len(sent) == 4
    assert stream.closed


@pytest.mark.asyncio
async def test_a_messages_stream_that_fails_mid_way_ends_with_anthropics_named_error_event() -> None:
    """The anthropic SDK skips an unnamed event: an OpenAI-shaped ``data: {"error"...}`` in a
    Messages stream left its client with a stream that just stopped, as vLLM never ends one."""
    start = b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1"}}\n\n'
    stream = ScriptedResponse([start, b"event: content_block_delta\ndata: {\"ty"], RESET)
    sent = await drive(engine_with(sse_response(stream)), scope=http_scope("/v1/messages"))
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[2].startswith(b"\n\nevent: error\ndata: ")
    error = orjson.loads(bodies[2][len(b"\n\nevent: error\ndata: ") :])
    assert error == {"type": "error", "error": {"type": "api_error", "message": RESET.message}}
    assert sent[-1]["more_body"] is False and len(sent) == 4


@pytest.mark.asyncio
async def test_mid_body_failure_of_a_non_sse_response_cuts_it_off() -> None:
    stream = ScriptedResponse([b'{"partial":'], RESET, headers=[(b"content-type", b"application/json")])
    with pytest.raises(UpstreamBodyError):
        await drive(engine_with(lambda r: stream))
    assert stream.closed


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "status"), [(UNREACHABLE, 502), (TIMED_OUT, 504), (POOL_FULL, 503)]
)
async def test_failures_before_the_headers_are_openai_errors(answer: tuple[int, str], status: int) -> None:
    def respond(request: Sent) -> ScriptedResponse:
        raise UpstreamFailure(answer, "scripted")

    sent = await drive(engine_with(respond))
    assert sent[0]["status"] == status
    assert sent[1]["body"] == error_body("/v1/chat/completions", status, answer[1])


@pytest.mark.asyncio
async def test_client_disconnect_closes_the_upstream_stream_at_once() -> None:
    stream = ScriptedResponse([b'data: {"a":1}\n\n'], hang=True)
    disconnect = asyncio.Event()
    engine = engine_with(sse_response(stream))
    task = asyncio.ensure_future(drive(engine, disconnect))
    await asyncio.wait_for(stream.hanging.wait(), 5)
    assert not stream.closed
    disconnect.set()
    sent = await asyncio.wait_for(task, 1)
    assert stream.closed
    assert [m.get("body") for m in sent[1:]] == [b'data: {"a":1}\n\n']  # no end, no error


@pytest.mark.asyncio
@pytest.mark.parametrize("length", [None, 8], ids=["chunked", "content-length"])
async def test_streamed_request_body_is_forwarded_as_it_comes(length: int | None) -> None:
    client = ScriptedClient(lambda r: ScriptedResponse([b"ok"]))
    engine = UpstreamEngine(Settings(engine="upstream", upstream="http://up:1"), lambda origin: client)
    app = await engine.start()
    parts = [b'{"a":', b' 1', b"}"]
    messages = [{"type": "http.request", "body": p, "more_body": i < 2} for i, p in enumerate(parts)]
    sent: list[Message] = []

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # no disconnect: the client stays
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    framing = [(b"transfer-encoding", b"chunked")] if length is None else [(b"content-length", b"%d" % length)]
    scope = http_scope("/v1/embeddings") | {"headers": [*framing, (b"content-type", b"application/json")]}
    await asyncio.wait_for(app(scope, receive, send), 5)
    await engine.stop()
    request = client.requests[0]
    assert request.headers == [(b"content-type", b"application/json")]  # framing is the pool's to write
    assert (request.body, request.length) == (b'{"a": 1}', length)  # the client's length, to be checked
    assert [m.get("body") for m in sent] == [None, b"ok", b""]


@pytest.mark.asyncio
async def test_lifecycle_health_pool_gauges_and_websockets() -> None:
    engine: Engine = UpstreamEngine(Settings(engine="upstream", upstream="http://127.0.0.1:9"))
    assert engine.name == "upstream"
    assert engine.describe() == "forwarding to http://127.0.0.1:9"  # the ready line
    assert not engine.healthy()
    assert b"cachetally_upstream_connections" not in engine.metrics_text()  # no pool yet
    app = await engine.start()
    assert engine.healthy()
    text = engine.metrics_text().decode()
    for name in ("open", "idle", "checked_out"):
        assert f"cachetally_upstream_connections_{name} 0\n" in text
    assert "cachetally_upstream_requests_queued 0\n" in text
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "websocket", "path": "/ws"}, None, send)  # type: ignore[arg-type]
    assert sent == [{"type": "websocket.close", "code": 1003}]
    await engine.stop()
    await engine.stop()
    assert not engine.healthy()


@loopback
def test_authorization_is_never_logged(start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}")
    with caplog.at_level("DEBUG"):
        resp = httpx.post(
            proxy.url + "/v1/completions?api_key=q-secret",
            json={"prompt": "hi"},
            headers={"authorization": "Bearer sk-very-secret"},
        )
    assert resp.status_code == 502
    # Everything cachetally's server thread logged (the test's own client logs its URL).
    served = "\n".join(r.getMessage() for r in caplog.records if r.threadName.startswith("cachetally-"))
    assert "upstream POST '/v1/completions': ConnectionRefusedError -> 502" in served
    assert "sk-very-secret" not in served and "q-secret" not in served


@loopback
def test_a_path_cannot_forge_or_flood_log_lines(start_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The path is the client's, and the server decodes ``%0A`` into a newline: a log line
    quotes it and shows at most 200 characters of it."""
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}")
    forged = "%0A2026-01-01 00:00:00,000 ERROR cachetally.app: FORGED tenant=acme"
    with caplog.at_level("INFO"):
        for path in (f"/v1/chat/completions{forged}", "/v1/" + "x" * 20_000):
            assert httpx.post(proxy.url + path, json={"model": "m", "messages": []}).status_code == 502
    served = [r.getMessage() for r in caplog.records if r.threadName.startswith("cachetally-")]
    failed = [line for line in served if line.startswith("upstream POST")]
    assert len(failed) == 2, served
    assert all("\n" not in line and len(line) < 400 for line in failed)
    assert "FORGED" in failed[0]  # quoted in its line, not a line of its own


# -- the default client (HTTP/1.1 pool) against a raw upstream on 127.0.0.1 ---------------------


class RawUpstream:
    """A TCP server that records each request head and answers with scripted bytes."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers, self.heads = answers, []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                writer.write(self.answers.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def call(app: Any, path: str, query: bytes = b"", headers: list[Any] | None = None) -> list[Message]:
    sent: list[Message] = []
    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Message:
        if not requests:
            await asyncio.Event().wait()  # the client stays
        return requests.pop()

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
             "query_string": query, "headers": headers or [], "http_version": "1.1"}
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@loopback
@pytest.mark.asyncio
async def test_default_transport_adds_nothing_decodes_nothing_follows_nothing() -> None:
    import gzip

    packed = gzip.compress(b'{"data": []}')
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-type: application/json\r\n"
        b"set-cookie: s=1\r\ncontent-length: %d\r\n\r\n" % len(packed) + packed,
        b"HTTP/1.1 302 Found\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n",
        b"",  # never asked for: the upstream keeps the connection open
    ]
    upstream = RawUpstream(answers)
    async with upstream as url:
        engine = UpstreamEngine(Settings(engine="upstream", upstream=url))
        app = await engine.start()
        try:
            sent = await call(app, "/v1/x%2Fy", b"a=%20b&c=/", [(b"x-one", b"1"), (b"x-one", b"2")])
            assert sent[0]["status"] == 200
            assert (b"content-encoding", b"gzip") in sent[0]["headers"]
            assert b"".join(m.get("body", b"") for m in sent[1:]) == packed  # byte for byte
            sent = await call(app, "/v1/models")
            assert sent[0]["status"] == 302  # relayed, not followed
            assert (b"location", b"/elsewhere") in sent[0]["headers"]
            text = engine.metrics_text().decode()
            assert "cachetally_upstream_connections_checked_out 0\n" in text
            assert "cachetally_upstream_connections_open 1\n" in text  # one connection, reused
        finally:
            await engine.stop()
    first, second = (head.decode("latin-1").split("\r\n") for head in upstream.heads)
    assert first[0] == "GET /v1/x%2Fy?a=%20b&c=/ HTTP/1.1"  # the target as the client sent it
    names = [line.split(":")[0].lower() for line in first[1:] if line]
    assert sorted(names) == ["host", "x-one", "x-one"]  # no User-Agent, Accept, Accept-Encoding
    assert not any(line.lower().startswith("cookie") for line in second)  # no shared cookie jar


@loopback
@pytest.mark.asyncio
async def test_default_transport_maps_a_reset_before_the_headers_to_502() -> None:
    upstream = RawUpstream([b"HTTP/1.1 20"])  # then the connection closes
    async with upstream as url:
        engine = UpstreamEngine(Settings(engine="upstream", upstream=url))
        app = await engine.start()
        try:
            sent = await call(app, "/v1/models")
        finally:
            await engine.stop()
    assert sent[0]["status"] == 502
    assert orjson.loads(sent[1]["body"])["error"]["code"] == 502


PARTIAL_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\ndata:\r\n"
)


def http1_client(url: str, **overrides: float) -> Http1Pool:
    options = {"max_connections": 1024, "keepalive_s": 30.0, "connect_timeout_s": 2.0, "read_timeout_s": 5.0}
    return Http1Pool(Origin.parse(url), **(options | overrides))  # type: ignore[arg-type]


@loopback
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answers", "read_timeout_s", "status"),
    [([PARTIAL_SSE], 5.0, 502), ([PARTIAL_SSE, b""], 0.2, 504)],
    ids=["reset", "stall"],
)
async def test_default_client_maps_a_failure_mid_body(answers: list[bytes], read_timeout_s: float, status: int) -> None:
    async with RawUpstream(answers) as url:
        client = http1_client(url, read_timeout_s=read_timeout_s)
        try:
            response = await client.send("GET", b"/v1/x", [], b"")
            assert await response.read() == b"data:"
            with pytest.raises(UpstreamFailure) as info:
                await response.read()
            response.close()
            assert info.value.status == status
            assert client.pool_state() == (0, 0, 0, 0)  # the broken connection is not pooled
        finally:
            await client.aclose()


@loopback
@pytest.mark.asyncio
async def test_default_client_answers_503_when_every_connection_stays_busy() -> None:
    async with RawUpstream([PARTIAL_SSE, b""]) as url:
        client = http1_client(url, max_connections=1, connect_timeout_s=0.2)
        try:
            held = await client.send("GET", b"/a", [], b"")
            assert client.pool_state() == (1, 0, 1, 0)
            with pytest.raises(UpstreamFailure) as info:
                await client.send("GET", b"/b", [], b"")
            assert info.value.status == 503
            held.close()  # unfinished: dropped, so the upstream sees the client leave
            assert client.pool_state() == (0, 0, 0, 0)
        finally:
            await client.aclose()


@loopback
@pytest.mark.asyncio
async def test_default_client_answers_502_when_nothing_listens() -> None:
    client = http1_client(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(UpstreamFailure) as info:
            await client.send("GET", b"/v1/models", [], b"")
    finally:
        await client.aclose()
    assert (info.value.status, info.value.reason) == (502, "ConnectionRefusedError")


@contextlib.contextmanager
def raw_upstream_in_thread(answers: list[bytes]) -> Iterator[str]:
    """:class:`RawUpstream` on an event loop of its own thread, for a proxy started from a
    test that blocks (the proxy asks the upstream for its models while it starts)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    upstream = RawUpstream(answers)
    async def stop() -> None:
        await upstream.__aexit__()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:  # a connection still waiting for a request it will not get
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    try:
        yield asyncio.run_coroutine_threadsafe(upstream.__aenter__(), loop).result(5)
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@loopback
def test_a_304_with_a_content_length_leaves_the_clients_connection_usable(start_proxy: Any) -> None:
    """RFC 9110 lets a 304 state the length of the representation it does not send; passed on,
    the server in front would wait for those bytes and drop the connection. Two pipelined
    requests on one connection both get their answers."""
    models = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
    ok = b"HTTP/1.1 200 OK\r\netag: \"v1\"\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models)
    not_modified = b"HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\ncontent-length: 54\r\n\r\n"
    with raw_upstream_in_thread([ok, not_modified, ok]) as url:
        proxy = start_proxy(url)  # its first answer is the model list the proxy asks for at start
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as client:
            client.sendall(b'GET /v1/models HTTP/1.1\r\nhost: x\r\nif-none-match: "v1"\r\n\r\n'
                           b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            with contextlib.suppress(TimeoutError):
                while not got.endswith(models) and (chunk := client.recv(65536)):
                    got += chunk
    assert got.startswith(b"HTTP/1.1 304 ")
    assert got.count(b"HTTP/1.1 200 OK") == 1 and got.endswith(models)
