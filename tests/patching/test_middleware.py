"""UsagePatchMiddleware at the ASGI message level.

Each test calls ``await mw(scope, receive, send)`` with a scripted client (``receive``)
and a list-collecting ``send``. Inner apps are small ASGI functions that publish a
``Scheduled`` under ``current_request_key`` (as an engine tap does) and then answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from engine_adapter.events import Scheduled, current_request_key
from proxy.accounting.metrics import Metrics
from proxy.accounting.request_id import is_valid_request_id
from proxy.asgi.errors import STOPPED, UVICORN_STOP, error_sse_event
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware

CHAT = "/v1/chat/completions"
InnerApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# -- the client side -----------------------------------------------------------------------


Headers = list[tuple[bytes, bytes]]


def http_scope(path: str = CHAT, *, method: str = "POST", headers: Headers | None = None) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *(headers or [])],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


class Client:
    """Scripted ``receive`` (the request body, then a disconnect once ``leave`` is called)
    and a list-collecting ``send``."""

    def __init__(self, body: bytes | list[bytes] = b"") -> None:
        chunks = [body] if isinstance(body, bytes) else body
        self.pending: list[Message] = [
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
            for i, chunk in enumerate(chunks)
        ]
        self.gone = asyncio.Event()
        self.sent: list[Message] = []

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> Message:
        if self.pending:
            return self.pending.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    # what the client got
    @property
    def start(self) -> Message:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        assert len(starts) == 1
        return starts[0]

    @property
    def status(self) -> int:
        return self.start["status"]

    def header(self, name: str) -> str | None:
        headers = self.start["headers"]
        values = [v.decode("latin-1") for k, v in headers if k.decode("latin-1").lower() == name]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        last = self.sent[-1] if self.sent else {}
        return last.get("type") == "http.response.body" and not last.get("more_body", False)

    def json(self) -> Any:
        return orjson.loads(self.body)


def chat_request(*, stream: bool = False, **extra: Any) -> bytes:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    return orjson.dumps(payload)


#: Families with a tenant label; ``Harness.sample`` reads the ``default`` tenant's series.
_TENANT_LABELLED = {
    "cachetally_requests", "cachetally_prompt_tokens", "cachetally_cached_tokens", "cachetally_completion_tokens"
}


# -- the engine side -----------------------------------------------------------------------


class Harness:
    def __init__(self, config: PatchConfig = PatchConfig()) -> None:
        self.ledger = UsageLedger()
        self.metrics = Metrics(self.ledger)
        self.config = config
        self.inner_keys: list[str | None] = []
        self.inner_headers: list[list[tuple[bytes, bytes]]] = []
        self.inner_bodies: list[bytes] = []

    def middleware(self, respond: InnerApp, *events: tuple[int, int]) -> UsagePatchMiddleware:
        """An inner app that publishes ``events`` for the current request, then ``respond``s."""

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            key = current_request_key.get()
            self.inner_keys.append(key)
            self.inner_headers.append(list(scope["headers"]))
            message = await receive()
            self.inner_bodies.append(message["body"])
            assert key is not None
            for prompt, cached in events:
                self.ledger.publish(Scheduled(key, prompt, cached))
            await respond(scope, receive, send)

        return UsagePatchMiddleware(inner, ledger=self.ledger, metrics=self.metrics, config=self.config)

    async def call(self, mw: UsagePatchMiddleware, client: Client, scope: Scope | None = None) -> None:
        await mw(scope or http_scope(), client.receive, client.send)
        self.assert_clean()

    def inner_header(self, name: bytes, request: int = 0) -> list[bytes]:
        """Every value of header ``name`` the inner app saw on ``request``: a client's beside
        the middleware's own would be one more."""
        return [value for key, value in self.inner_headers[request] if key == name]

    def assert_clean(self) -> None:
        assert len(self.ledger) == 0
        assert current_request_key.get() is None
        assert self.sample("cachetally_ledger_open_slots") == 0

    def sample(self, name: str, **labels: str) -> float | None:
        if name.split("_total")[0] in _TENANT_LABELLED:
            labels.setdefault("tenant", "default")
        return self.metrics.registry.get_sample_value(name, labels)

    def requests(self) -> dict[str, float]:
        """``cachetally_requests_total`` by cache label, summed over the other labels."""
        out: dict[str, float] = {}
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if s.name == "cachetally_requests_total":
                    out[s.labels["cache"]] = out.get(s.labels["cache"], 0) + s.value
        return out


async def start(send: Send, content_type: bytes, status: int = 200, extra: Headers | None = None) -> None:
    headers = [(b"content-type", content_type), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})


def json_response(body: bytes, *, status: int = 200, chunk: int | None = None) -> InnerApp:
    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"application/json", status, [(b"content-length", str(len(body)).encode())])
        parts = [body] if chunk is None else [body[i : i + chunk] for i in range(0, len(body), chunk)]
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    return respond


def sse_response(*events: bytes, content_length: bool = False) -> InnerApp:
    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        extra = [(b"content-length", str(sum(map(len, events))).encode())] if content_length else []
        await start(send, b"text/event-stream; charset=utf-8", extra=extra)
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return respond


def chat_completion(**usage: Any) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66, **usage},
        }
    )


def chunk(delta: dict[str, Any] | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": choices}
    payload.update(extra)
    return b"data: " + orjson.dumps(payload) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
TOKEN = chunk({"content": "hello"})
USAGE = chunk(usage={"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66})
DONE = b"data: [DONE]\n\n"


def sse_payloads(body: bytes) -> list[Any]:
    events = body.split(b"\n\n")
    assert events[-1] == b""
    return [
        "[DONE]" if event == b"data: [DONE]" else orjson.loads(event.removeprefix(b"data: "))
        for event in events[:-1]
    ]


# -- JSON and SSE patching --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_json_body_is_patched_exactly_with_a_recomputed_content_length() -> None:
    h = Harness()
    client = Client(chat_request())
    await h.call(h.middleware(json_response(chat_completion(), chunk=7), (64, 48)), client)

    assert client.status == 200
    assert client.json()["usage"] == {
        "prompt_tokens": 64,
        "completion_tokens": 2,
        "total_tokens": 66,
        "prompt_tokens_details": {"cached_tokens": 48},
    }
    assert client.header("content-length") == str(len(client.body))
    assert h.requests() == {"hit": 1}
    assert h.sample("cachetally_cached_tokens_total", model="m", source="engine", tier="all") == 48
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 64


@pytest.mark.asyncio
async def test_json_body_already_right_goes_out_unchanged() -> None:
    h = Harness()
    original = chat_completion(prompt_tokens_details={"cached_tokens": 48})
    client = Client(chat_request())
    await h.call(h.middleware(json_response(original), (64, 48)), client)
    assert client.body == original
    assert client.header("content-length") == str(len(original))


@pytest.mark.asyncio
async def test_sse_is_patched_with_content_length_removed_and_first_event_passed_immediately() -> None:
    h = Harness()
    seen_by_client_after_first_send: list[bytes] = []

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream", extra=[(b"content-length", b"999")])
        await send({"type": "http.response.body", "body": ROLE, "more_body": True})
        seen_by_client_after_first_send.append(client.body)
        for event in (TOKEN, USAGE, DONE):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    client = Client(chat_request(stream=True, stream_options={"include_usage": True}))
    await h.call(h.middleware(respond, (64, 48)), client)

    assert seen_by_client_after_first_send == [ROLE]
    assert client.header("content-length") is None
    assert client.header("content-type") == "text/event-stream"
    assert client.complete
    events = client.body.split(b"\n\n")
    assert client.body.startswith(ROLE + TOKEN)
    assert client.body.endswith(b"\n\n" + DONE)
    usage = orjson.loads(events[2].removeprefix(b"data: "))
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert usage["choices"] == []
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_sse_stream_with_continuous_usage_is_counted_once() -> None:
    h = Harness()
    continuous = [
        chunk(
            {"content": f"t{i}"},
            usage={"prompt_tokens": 64, "completion_tokens": i, "total_tokens": 64 + i},
        )
        for i in (1, 2)
    ]
    body = chat_request(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    client = Client(body)
    await h.call(h.middleware(sse_response(ROLE, *continuous, USAGE, DONE), (64, 0)), client)

    payloads = sse_payloads(client.body)
    cached = [p["usage"]["prompt_tokens_details"]["cached_tokens"] for p in payloads[1:4]]
    assert cached == [0, 0, 0]  # 0 is written, never omitted
    assert h.requests() == {"miss": 1}


# -- request ids -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_client_request_id_is_echoed_and_is_the_key_the_engine_sees() -> None:
    h = Harness()
    client = Client(chat_request())
    scope = http_scope(headers=[(b"x-request-id", b"client-id.1:A_b")])
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client, scope)

    assert client.header("x-request-id") == "client-id.1:A_b"
    assert h.inner_keys == ["client-id.1:A_b"]
    assert h.inner_header(b"x-request-id") == [b"client-id.1:A_b"]


@pytest.mark.asyncio
async def test_request_id_is_minted_when_absent() -> None:
    h = Harness()
    client = Client(chat_request())
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client)

    echoed = client.header("x-request-id")
    assert echoed is not None and is_valid_request_id(echoed)
    assert h.inner_keys == [echoed]
    assert h.inner_header(b"x-request-id") == [echoed.encode()]
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "bad",
    [
        b"a" * 129,
        b"abc\r\nset-cookie: x=1",
        "caf\u00e9".encode(),
        "\u2028".encode(),
        b"a\x00b",
        b"a\x1bb",
        b"a\tb",
        b"has space",
        b"",
    ],
    ids=["too-long", "crlf", "non-ascii", "u2028", "nul", "esc", "tab", "space", "empty"],
)
async def test_invalid_request_id_is_replaced_and_never_echoed(bad: bytes) -> None:
    h = Harness()
    client = Client(chat_request())
    scope = http_scope(headers=[(b"x-request-id", bad)])
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client, scope)

    echoed = client.header("x-request-id")
    assert echoed is not None and is_valid_request_id(echoed)
    assert echoed.encode("latin-1") != bad
    assert all(value != bad for _, value in client.start["headers"])
    assert h.inner_keys == [echoed]
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


@pytest.mark.asyncio
async def test_two_request_id_headers_are_not_trusted() -> None:
    h = Harness()
    client = Client(chat_request())
    scope = http_scope(headers=[(b"x-request-id", b"one"), (b"x-request-id", b"two")])
    await h.call(h.middleware(json_response(chat_completion())), client, scope)
    echoed = client.header("x-request-id")
    assert echoed not in (None, "one", "two")


@pytest.mark.asyncio
async def test_concurrent_requests_with_the_same_id_each_get_their_own_cached_tokens() -> None:
    h = Harness()
    arrived = 0
    both_in_flight = asyncio.Event()

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal arrived
        key = current_request_key.get()
        assert key is not None
        assert dict(scope["headers"])[b"x-request-id"] == key.encode()
        cached = orjson.loads((await receive())["body"])["cached"]
        h.inner_keys.append(key)
        h.ledger.publish(Scheduled(key, 64, cached))
        arrived += 1
        if arrived == 2:
            both_in_flight.set()
        await both_in_flight.wait()  # both slots open at once, same client id
        await json_response(chat_completion())(scope, receive, send)

    mw = UsagePatchMiddleware(inner, ledger=h.ledger, metrics=h.metrics)
    clients = [Client(chat_request(cached=16)), Client(chat_request(cached=40))]
    scope = http_scope(headers=[(b"x-request-id", b"same")])
    await asyncio.gather(*(mw(dict(scope), c.receive, c.send) for c in clients))

    assert [c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for c in clients] == [16, 40]
    assert [c.header("x-request-id") for c in clients] == ["same", "same"]
    assert len(set(h.inner_keys)) == 2 and "same" in h.inner_keys
    h.assert_clean()
    assert h.requests() == {"hit": 2}


@pytest.mark.asyncio
@pytest.mark.parametrize("fails", [False, True], ids=["answered", "inner-app-raised"])
async def test_the_same_id_in_flight_in_two_processes_gets_two_keys(fails: bool) -> None:
    """Two workers of one instance (``--workers 2``): two ledgers, each with its process tag."""
    harnesses = [Harness(), Harness()]
    both_in_flight = asyncio.Event()
    keys: list[str] = []

    def worker(h: Harness, tag: str) -> UsagePatchMiddleware:
        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            key = current_request_key.get()
            assert key is not None
            keys.append(key)
            h.ledger.publish(Scheduled(key, 64, 16))
            if len(keys) == 2:
                both_in_flight.set()
            await both_in_flight.wait()
            if fails:
                raise RuntimeError("engine died")
            await json_response(chat_completion())(scope, receive, send)

        return UsagePatchMiddleware(inner, ledger=h.ledger, metrics=h.metrics, process_tag=tag)

    clients = [Client(chat_request()), Client(chat_request())]
    scope = http_scope(headers=[(b"x-request-id", b"same")])
    workers = (worker(h, tag) for h, tag in zip(harnesses, (".p101", ".p102"), strict=True))
    calls = (w(dict(scope), c.receive, c.send) for w, c in zip(workers, clients, strict=True))
    results = await asyncio.gather(*calls, return_exceptions=True)

    assert sorted(keys) == ["same.p101", "same.p102"]
    for h in harnesses:
        h.assert_clean()
    if fails:
        assert all(isinstance(r, RuntimeError) for r in results)
    else:
        assert [c.header("x-request-id") for c in clients] == ["same", "same"]


@pytest.mark.asyncio
async def test_a_client_id_of_128_characters_keeps_the_key_within_128_with_the_process_tag() -> None:
    """The key is the usage record's ``request_id``: at most 128 characters, the tag last."""
    h, keys = Harness(), []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        keys.append(current_request_key.get())
        await json_response(chat_completion())(scope, receive, send)

    client = Client(chat_request())
    mw = UsagePatchMiddleware(inner, ledger=h.ledger, metrics=h.metrics, process_tag=".p101")
    await mw(http_scope(headers=[(b"x-request-id", b"a" * 128)]), client.receive, client.send)
    assert keys == ["a" * 123 + ".p101"]
    assert client.header("x-request-id") == "a" * 128  # the echo stays the client's


# -- the request side -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_body_is_forwarded_byte_for_byte_when_nothing_is_rewritten() -> None:
    h = Harness()
    body = b'{"model":"m","messages":[{"role":"user","content":"\\u00e9 hi"}],  "stream": false}'
    client = Client([body[:10], body[10:]])
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client)
    assert h.inner_bodies == [body]
    assert h.inner_header(b"content-length") == [str(len(body)).encode()]


def _read_deep(body: bytes, drop: str = "") -> str:
    """``json.loads`` of a text nested past the recursion limit, as the engine reads it (vLLM's
    parser starts from its own stack, not this test's), less ``drop``, written canonically:
    ``NaN`` compares equal to itself."""
    import json
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 2000)
    try:
        read = json.loads(body)
        read.pop(drop, None)
        return json.dumps(read, sort_keys=True)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [300, 1023])
@pytest.mark.parametrize("odd", ["", ',"seed":123456789012345678901234567890', ',"score":NaN'],
                         ids=["plain", "wide-int", "nan"])
async def test_a_rewritten_body_nested_past_orjsons_depth_reaches_the_engine(depth: int, odd: str) -> None:
    """vLLM's json reads 300 levels (a tool's JSON schema); orjson writes 254, and reads
    1,024. Removing ``stream_interval`` used to fail such a request with a 500, and at 1,023
    levels the standard library's encoder and decoder failed too (RecursionError: a 500
    where the engine answers). An integer orjson cannot hold and a ``NaN`` send the body
    through the standard library: the engine reads them as the client wrote them."""
    deep = "[" * depth + "]" * depth
    body = ('{"model":"m","messages":[{"role":"user","content":"hi"}],"stream_interval":8' + odd + ',"x":'
            + deep + "}").encode()
    h = Harness()
    client = Client(body)
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client)
    assert client.status == 200
    assert [_read_deep(b) for b in h.inner_bodies] == [_read_deep(body, drop="stream_interval")]


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "request_body"), [
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ("/invocations", {"model": "m", "prompt": "hi"}),
    ("/invocations", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_a_client_cannot_group_the_tokens_of_a_completions_or_invocations_stream(
    path: str, request_body: dict
) -> None:
    """docs/ACCOUNTING.md: vLLM's per-request ``stream_interval`` is removed from chat,
    completions and invocations bodies (chat above, and on real vLLM in
    tests/real_vllm/test_vllm_hostile_billing.py), else a cut stream is counted in chunks."""
    body = orjson.dumps({**request_body, "stream": True, "stream_interval": 50})
    h = Harness()
    client = Client(body)
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client, http_scope(path))
    assert [orjson.loads(b) for b in h.inner_bodies] == [{**request_body, "stream": True}]


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
async def test_invalid_request_json_gets_an_openai_400(body: bytes) -> None:
    h = Harness()
    client = Client(body)
    scope = http_scope(headers=[(b"x-request-id", b"r1")])
    await h.call(h.middleware(json_response(chat_completion())), client, scope)

    assert client.status == 400
    error = client.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, None)
    assert error["message"]
    assert client.header("x-request-id") == "r1"
    assert client.header("content-length") == str(len(client.body))
    assert h.inner_keys == []  # the inner app never ran
    assert h.requests() == {}


@pytest.mark.asyncio
async def test_oversized_body_by_content_length_gets_413_without_reading() -> None:
    h = Harness(PatchConfig(max_request_bytes=100))

    async def must_not_read() -> Message:
        raise AssertionError("the body was read")

    client = Client()
    scope = http_scope(headers=[(b"content-length", b"101")])
    await h.middleware(json_response(chat_completion()))(scope, must_not_read, client.send)
    h.assert_clean()

    assert client.status == 413
    assert client.json()["error"]["code"] == 413
    assert client.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert h.inner_keys == []
    assert h.requests() == {}


@pytest.mark.asyncio
async def test_oversized_streamed_body_gets_413() -> None:
    h = Harness(PatchConfig(max_request_bytes=100))
    client = Client([b"x" * 60, b"x" * 41, b"never read"])
    await h.call(h.middleware(json_response(chat_completion())), client)
    assert client.status == 413
    assert client.pending == [{"type": "http.request", "body": b"never read", "more_body": False}]
    assert h.inner_keys == []


@pytest.mark.asyncio
async def test_body_at_the_limit_is_accepted() -> None:
    body = chat_request()
    h = Harness(PatchConfig(max_request_bytes=len(body)))
    client = Client(body)
    scope = http_scope(headers=[(b"content-length", str(len(body)).encode())])
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client, scope)
    assert client.status == 200


@pytest.mark.asyncio
async def test_details_flag_is_stripped_from_the_request_and_answered() -> None:
    h = Harness()
    client = Client(chat_request(return_cached_tokens_details=True))

    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client)
    assert b"return_cached_tokens_details" not in h.inner_bodies[0]
    assert orjson.loads(h.inner_bodies[0])["messages"] == [{"role": "user", "content": "hi"}]
    details = client.json()["cached_tokens_details"]
    assert details == {"local": None, "external": None, "created": None, "source": "engine"}


@pytest.mark.asyncio
async def test_details_flag_reaches_an_upstream_that_answers_it_itself() -> None:
    """Upstream mode keeps the flag: it is SGLang's own, and SGLang answers it itself."""
    h = Harness(PatchConfig(strip_details_flag=False))
    body = chat_request(return_cached_tokens_details=True)
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), Client(body))
    assert h.inner_bodies == [body]


@pytest.mark.asyncio
async def test_details_are_answered_when_the_response_already_had_the_engines_figure() -> None:
    """Nothing else to change: the details alone still change the body the client gets."""
    h = Harness()
    client = Client(chat_request(return_cached_tokens_details=True))
    right = chat_completion(prompt_tokens_details={"cached_tokens": 48})
    await h.call(h.middleware(json_response(right), (64, 48)), client)
    assert client.json()["cached_tokens_details"]["source"] == "engine"
    assert client.header("content-length") == str(len(client.body))


@pytest.mark.asyncio
async def test_an_upstream_figure_not_believed_with_no_engine_event_is_no_mismatch() -> None:
    """The mismatch counter counts the engine's figure overwriting another: with no engine
    event there is none, whatever the upstream claims (here more cached than its prompt)."""
    h = Harness()
    client = Client(chat_request())
    await h.call(h.middleware(json_response(chat_completion(prompt_tokens_details={"cached_tokens": 80}))), client)
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert h.sample("cachetally_cached_tokens_mismatch_total") == 0


@pytest.mark.asyncio
async def test_a_different_reported_value_is_overwritten_and_counted_as_a_mismatch() -> None:
    h = Harness()
    client = Client(chat_request())
    reported = chat_completion(prompt_tokens_details={"cached_tokens": 32})
    await h.call(h.middleware(json_response(reported), (64, 48)), client)
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert h.sample("cachetally_cached_tokens_mismatch_total") == 1
    assert h.sample("cachetally_cached_tokens_total", model="m", source="engine", tier="all") == 48


@pytest.mark.asyncio
async def test_a_stream_with_a_wrong_figure_in_every_usage_chunk_is_one_mismatched_response() -> None:
    """The counter counts responses, as its help says, not the usage chunks of one."""
    h = Harness()
    wrong = {"prompt_tokens_details": {"cached_tokens": 32}}
    continuous = [chunk({"content": f"t{i}"}, usage={"prompt_tokens": 64, "completion_tokens": i,
                                                     "total_tokens": 64 + i, **wrong}) for i in (1, 2, 3)]
    final = chunk(usage={"prompt_tokens": 64, "completion_tokens": 3, "total_tokens": 67, **wrong})
    body = chat_request(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    client = Client(body)
    await h.call(h.middleware(sse_response(ROLE, *continuous, final, DONE), (64, 48)), client)
    cached = [p["usage"]["prompt_tokens_details"]["cached_tokens"] for p in sse_payloads(client.body)[1:5]]
    assert cached == [48, 48, 48, 48]
    assert h.sample("cachetally_cached_tokens_mismatch_total") == 1


@pytest.mark.asyncio
async def test_a_last_usage_chunk_without_a_prompt_count_keeps_the_one_reported_before() -> None:
    """No engine event and no cached figure: the record bills the prompt the upstream
    reported, which a later usage object that omits ``prompt_tokens`` does not unsay."""
    h, records = Harness(), _Records()
    counted = chunk({"content": "t"}, usage={"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65})
    final = chunk(usage={"completion_tokens": 1})
    body = chat_request(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    mw = UsagePatchMiddleware(sse_response(ROLE, counted, final, DONE), ledger=h.ledger, metrics=h.metrics,
                              recorder=records)  # type: ignore[arg-type]
    await h.call(mw, Client(body))
    [record] = records.records
    assert (record.prompt_tokens, record.cached_tokens) == (64, None)


# -- passthrough ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_non_200_passes_through_byte_identical() -> None:
    h = Harness()
    error = orjson.dumps({"error": {"message": "no", "usage": {"prompt_tokens": 1}}})
    client = Client(chat_request())
    await h.call(h.middleware(json_response(error, status=400), (64, 48)), client)
    assert client.status == 400
    assert client.body == error
    assert client.header("content-length") == str(len(error))


@pytest.mark.asyncio
async def test_encoded_response_passes_through_and_is_counted() -> None:
    h = Harness()
    compressed = gzip.compress(chat_completion())

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        extra = [(b"content-encoding", b"gzip"), (b"content-length", str(len(compressed)).encode())]
        await start(send, b"application/json", extra=extra)
        await send({"type": "http.response.body", "body": compressed[:5], "more_body": True})
        await send({"type": "http.response.body", "body": compressed[5:], "more_body": False})

    client = Client(chat_request())
    await h.call(h.middleware(respond, (64, 48)), client)
    assert client.body == compressed
    assert client.header("content-length") == str(len(compressed))
    assert h.sample("cachetally_patch_skipped_total", reason="encoded") == 1
    # The engine still told us: the request is counted exactly.
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_other_routes_pass_through_with_an_echoed_id_and_no_slot() -> None:
    h = Harness()
    body = b'{"data":[]}'
    seen: list[str | None] = []

    async def models(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_request_key.get())
        assert len(h.ledger) == 0
        await json_response(body)(scope, receive, send)

    mw = UsagePatchMiddleware(models, ledger=h.ledger, metrics=h.metrics)
    client = Client()
    await h.call(mw, client, http_scope("/v1/models", method="GET", headers=[(b"x-request-id", b"m-1")]))
    assert client.body == body
    assert client.header("x-request-id") == "m-1"
    assert seen == [None]
    assert h.requests() == {}


@pytest.mark.asyncio
async def test_json_response_over_the_limit_passes_through_and_is_counted() -> None:
    h = Harness(PatchConfig(max_response_bytes=50))
    original = chat_completion()
    client = Client(chat_request())
    await h.call(h.middleware(json_response(original, chunk=40), (64, 48)), client)
    assert client.body == original
    assert client.header("content-length") == str(len(original))
    assert client.complete
    assert h.sample("cachetally_patch_skipped_total", reason="body_too_large") == 1
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_sse_event_over_the_limit_passes_through_and_is_counted() -> None:
    h = Harness(PatchConfig(max_event_bytes=64))
    big = chunk({"content": "x" * 200})
    split = [big[:50], big[50:120], big[120:]]

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        for part in [*split, USAGE, DONE]:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    client = Client(STREAM_BODY)
    await h.call(h.middleware(respond, (64, 48)), client)
    assert client.body.startswith(big)
    assert sse_payloads(client.body)[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert h.sample("cachetally_patch_skipped_total", reason="event_too_large") == 1


@pytest.mark.asyncio
async def test_malformed_json_response_passes_through_and_is_counted() -> None:
    h = Harness()
    client = Client(chat_request())
    await h.call(h.middleware(json_response(b"{oops"), (64, 48)), client)
    assert client.body == b"{oops"
    assert h.sample("cachetally_patch_skipped_total", reason="malformed") == 1


#: What Python's json writes and orjson cannot hold or write back: NaN, an integer past 64
#: bits, a lone surrogate, nesting past orjson's 254 levels. vLLM's own serializer is Python.
ODD = '"seed":123456789012345678901234567890,"score":NaN,"note":"\\ud800","deep":' + "[" * 300 + "]" * 300


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_response_orjson_cannot_hold_is_patched_and_otherwise_left_as_it_was(stream: bool) -> None:
    """Oracle: Python's json reads the client's bytes as the upstream's, with only the usage
    patched; before, such a body went out unpatched (and a ghost usage chunk leaked), a wide
    integer became a float, and deep nesting failed the request."""
    import json

    usage = '"usage":{"prompt_tokens":64,"completion_tokens":2,"total_tokens":66,"prompt_tokens_details":null}'
    if stream:
        sent = ('{"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","choices":[],' + usage + ","
                + ODD + "}").encode()
        app = sse_response(ROLE, TOKEN, b"data: " + sent + b"\n\n", DONE)
        request = chat_request(stream=True, stream_options={"include_usage": True})
    else:
        sent = ('{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[],' + usage + ","
                + ODD + "}").encode()
        app = json_response(sent)
        request = chat_request()
    h = Harness()
    client = Client(request)
    await h.call(h.middleware(app, (64, 48)), client)
    assert client.status == 200
    got = client.body.split(b"\n\n")[2].removeprefix(b"data: ") if stream else client.body
    expected = json.loads(sent)
    expected["usage"]["prompt_tokens_details"] = {"cached_tokens": 48}
    assert repr(json.loads(got)) == repr(expected)  # repr: NaN is not equal to itself
    assert h.sample("cachetally_cached_tokens_total", model="m", source="engine", tier="all") == 48


#: The same values inside the usage object itself, which the Responses and Messages shapes edit.
ODD_USAGE = '"x_seed":123456789012345678901234567890,"x_score":NaN,"x_note":"\\ud800"'


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["responses", "messages"])
async def test_a_shapes_usage_orjson_cannot_hold_is_patched_and_otherwise_left_as_it_was(route: str) -> None:
    """Oracle: Python's json, as for chat above; before, the request failed with no answer."""
    import json

    if route == "responses":
        sent = ('{"id":"resp_1","object":"response","model":"m","status":"completed","output":[],"usage":'
                '{"input_tokens":64,"input_tokens_details":{"cached_tokens":0},"output_tokens":2,' + ODD_USAGE + "}}")
        request = b'{"model":"m","input":"hi"}'
    else:
        sent = ('{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[],"usage":'
                '{"input_tokens":64,"output_tokens":2,' + ODD_USAGE + "}}")
        request = b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}'
    h = Harness()
    client = Client(request)
    await h.call(h.middleware(json_response(sent.encode()), (64, 48)), client, http_scope(f"/v1/{route}"))
    assert client.status == 200
    expected = json.loads(sent)
    if route == "responses":
        expected["usage"]["input_tokens_details"]["cached_tokens"] = 48
    else:
        expected["usage"] |= {"input_tokens": 16, "cache_read_input_tokens": 48}
    assert repr(json.loads(client.body)) == repr(expected)  # repr: NaN is not equal to itself
    assert h.sample("cachetally_cached_tokens_total", model="m", source="engine", tier="all") == 48


# -- disconnects and failures --------------------------------------------------------------------

STREAM_BODY = chat_request(stream=True, stream_options={"include_usage": True})
# How far the inner app gets before the client leaves: (start sent?, events sent).
POINTS = {
    "before-start": (False, ()),
    "after-start": (True, ()),
    "mid-body": (True, (ROLE, TOKEN)),
    "before-usage": (True, (ROLE, TOKEN, chunk({}, finish_reason="stop"))),
    "after-done": (True, (ROLE, TOKEN, USAGE, DONE)),
}


def stops_at(point: str, then: Callable[[Receive], Awaitable[None]]) -> InnerApp:
    started, events = POINTS[point]

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        if started:
            await start(send, b"text/event-stream")
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await then(receive)

    return respond


@pytest.mark.asyncio
@pytest.mark.parametrize("point", list(POINTS))
async def test_client_disconnect_leaves_nothing_behind(point: str) -> None:
    h = Harness()
    client = Client(STREAM_BODY)

    async def wait_for_disconnect(receive: Receive) -> None:
        client.leave()
        assert (await receive())["type"] == "http.disconnect"

    await h.call(h.middleware(stops_at(point, wait_for_disconnect), (64, 48)), client)
    assert not client.complete
    if point == "after-done":
        payloads = sse_payloads(client.body)
        assert payloads[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    # The engine saw the request: it is counted once, with the engine's figures.
    assert h.requests() == {"hit": 1}
    # The model label comes from the response; before any event there is none.
    model = "m" if POINTS[point][1] else "unknown"
    assert h.sample("cachetally_cached_tokens_total", model=model, source="engine", tier="all") == 48


@pytest.mark.asyncio
@pytest.mark.parametrize("point", list(POINTS))
async def test_cancelled_request_leaves_nothing_behind(point: str) -> None:
    h = Harness()
    client = Client(STREAM_BODY)
    reached = asyncio.Event()
    key_after: list[str | None] = []

    async def hang(receive: Receive) -> None:
        reached.set()
        await asyncio.Event().wait()

    mw = h.middleware(stops_at(point, hang), (64, 48))

    async def server() -> None:
        try:
            await mw(http_scope(), client.receive, client.send)
        finally:
            key_after.append(current_request_key.get())

    task = asyncio.create_task(server())
    await reached.wait()
    assert len(h.ledger) == 1
    task.cancel(UVICORN_STOP)  # as uvicorn cancels the requests still running when a graceful stop's drain ends
    await task  # the request's own task ended it (proxy.patching.stopped)
    last = client.sent[-1]
    if point == "before-start":
        assert client.status == 503 and orjson.loads(last["body"])["error"]["message"] == STOPPED
    else:  # a started stream ends with one error event
        assert last["more_body"] is False and last["body"].endswith(error_sse_event(CHAT, 503, STOPPED))
    assert key_after == [None]
    h.assert_clean()
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
@pytest.mark.parametrize("point", list(POINTS))
async def test_a_cancellation_that_is_not_the_servers_stop_goes_on(point: str) -> None:
    """A caller's own timeout around the app ends it as it ends anything: the client is not
    told the server stopped, and the timeout fires. Swallowed, the client got that 503 or
    error event, and the caller's timeout never fired."""
    h = Harness()
    client = Client(STREAM_BODY)

    async def hang(receive: Receive) -> None:
        timeout.reschedule(asyncio.get_running_loop().time())  # the caller's deadline passes now
        await asyncio.Event().wait()

    mw = h.middleware(stops_at(point, hang), (64, 48))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:
            await mw(http_scope(), client.receive, client.send)
    assert STOPPED.encode() not in b"".join(m.get("body", b"") for m in client.sent)
    h.assert_clean()
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_a_cancellation_during_a_cut_streams_prompt_ask_that_is_not_the_servers_stop_goes_on() -> None:
    """Upstream mode's ask about the prompt of a stream its client cut ends on a caller's own
    timeout as anything does: the timeout fires. Swallowed, the caller's timeout never fired."""
    h = Harness()
    client = Client(STREAM_BODY)
    asked: list[str] = []

    async def leave(receive: Receive) -> None:
        client.leave()
        assert (await receive())["type"] == "http.disconnect"

    async def count_prompt(route: str, body: bytes, scope: Scope) -> int | None:
        asked.append(route)
        timeout.reschedule(asyncio.get_running_loop().time())  # the caller's deadline passes now
        await asyncio.Event().wait()
        return None

    inner = h.middleware(stops_at("mid-body", leave), (64, 48)).app
    mw = UsagePatchMiddleware(inner, ledger=h.ledger, metrics=h.metrics, config=h.config, count_prompt=count_prompt)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:
            await mw(http_scope(), client.receive, client.send)
    assert asked == ["chat"]
    h.assert_clean()


class _Records:
    """A recorder that keeps what it is handed."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def submit(self, record: Any) -> None:
        self.records.append(record)


def sse_events(body: bytes) -> list[tuple[bytes | None, bytes]]:
    """(event name, data) of each event, as an SSE client splits the bytes it got."""
    events = []
    for block in body.split(b"\n\n"):
        if block:
            name, data = None, []
            for line in block.split(b"\n"):
                field, _, value = line.partition(b":")
                if field == b"event":
                    name = value.removeprefix(b" ")
                elif field == b"data":
                    data.append(value.removeprefix(b" "))
            events.append((name, b"\n".join(data)))
    return events


async def _stopped_once(messages: list[Message], body: bytes, *, path: str = CHAT,
                        config: PatchConfig = PatchConfig(), recorder: _Records | None = None) -> Client:
    """A stream that sends ``messages`` and hangs, cancelled there as the server's stop does."""
    reached = asyncio.Event()

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        for message in messages:
            await send(message)
        reached.set()
        await asyncio.Event().wait()

    h = Harness(config)
    client = Client(body)
    mw = UsagePatchMiddleware(h.middleware(respond, (64, 48)).app, ledger=h.ledger, metrics=h.metrics,
                              config=config, recorder=recorder)  # type: ignore[arg-type]
    task = asyncio.create_task(mw(http_scope(path), client.receive, client.send))
    await reached.wait()
    task.cancel(UVICORN_STOP)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    h.assert_clean()
    return client


def _body(*parts: bytes, more: bool = True) -> list[Message]:
    return [{"type": "http.response.body", "body": part, "more_body": more} for part in parts]


@pytest.mark.asyncio
async def test_a_messages_stream_the_stop_cuts_ends_with_anthropics_error_event() -> None:
    """The anthropic SDK reads a Messages stream's error in Anthropic's shape; an OpenAI error
    object there is no error it can name. The stop's 503 is Anthropic's overload: try again."""
    opening = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
               b'"role":"assistant","model":"m","content":[],"usage":{"input_tokens":64,"output_tokens":0}}}\n\n')
    body = b'{"model":"m","max_tokens":2,"stream":true,"messages":[{"role":"user","content":"hi"}]}'
    client = await _stopped_once(_body(opening), body, path="/v1/messages")
    name, data = sse_events(client.body)[-1]
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": STOPPED}}
    assert (name, orjson.loads(data)) == (b"error", overloaded)
    assert client.complete


@pytest.mark.asyncio
async def test_a_stream_cut_by_the_stop_inside_an_event_that_went_out_in_part_ends_with_a_whole_error_event() -> None:
    """An event over ``max_event_bytes`` goes out in parts: the stop's error event must still
    be an event of its own to the client, not more of the cut one's data."""
    part = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","note":"' + b"a" * 1000
    client = await _stopped_once(_body(ROLE, part), STREAM_BODY, config=PatchConfig(max_event_bytes=256))
    assert part in client.body  # it did go out, unended
    name, data = sse_events(client.body)[-1]
    assert (name, orjson.loads(data)["error"]["message"]) == (b"error", STOPPED)


@pytest.mark.asyncio
async def test_a_stream_already_whole_when_the_stop_comes_is_recorded_completed_and_sent_nothing_more() -> None:
    """An app may still run after its last body message; the stop then has nothing to tell
    the client, whose stream ended whole, and the record says so."""
    records = _Records()
    client = await _stopped_once([*_body(ROLE, TOKEN, USAGE, DONE), *_body(b"", more=False)], STREAM_BODY,
                                 recorder=records)
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert STOPPED.encode() not in client.body
    [record] = records.records
    assert (record.outcome, record.completion_tokens) == ("completed", 2)


LEG_CONFIG = PatchConfig(pd_legs=True, max_request_bytes=256)
#: A decode leg's kv_transfer_params, with the figures its prefill leg handed over.
HANDED = b'{"do_remote_prefill": true, "cachetally_prefill": {"prompt_tokens": 300, "cached_tokens": 256, "source": "engine"}'


async def _oversized_leg(chunks: list[bytes], *, leaves: bool = False) -> tuple[Client, Any]:
    """A decode leg over ``max_request_bytes`` sent in ``chunks``; ``leaves``: the client goes
    after them, the body unfinished. The client, and the request's record."""
    h, records = Harness(LEG_CONFIG), _Records()
    client = Client(chunks)
    if leaves:
        client.pending[-1]["more_body"] = True
        client.leave()
    mw = UsagePatchMiddleware(h.middleware(json_response(chat_completion())).app, ledger=h.ledger,
                              metrics=h.metrics, config=LEG_CONFIG, recorder=records)  # type: ignore[arg-type]
    await h.call(mw, client)
    [record] = records.records
    return client, record


def _leg_body(params: bytes) -> list[bytes]:
    body = b'{"model": "m", "user": "' + b"u" * 300 + b'", "kv_transfer_params": ' + params + b"}"
    return [body[i : i + 16] for i in range(0, len(body), 16)]  # many receive messages past the limit


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", [b"", b', "t": NaN', b', "t": 123456789012345678901234567890'],
                         ids=["plain", "nan", "wide-int"])
async def test_a_decode_leg_over_the_limit_is_refused_and_bills_its_handed_prefill(extra: bytes) -> None:
    """Read to its end, however many messages it takes, and read as the engine's json.loads
    reads it (NaN and integers past 64 bits are no reason to bill nothing)."""
    client, record = await _oversized_leg(_leg_body(HANDED + extra + b"}"))
    assert client.status == 413
    assert (record.status, record.outcome, record.prompt_tokens, record.cached_tokens) == (413, "error", 300, 256)


@pytest.mark.asyncio
async def test_a_decode_leg_over_the_limit_whose_client_leaves_is_recorded_disconnected_and_not_answered() -> None:
    client, record = await _oversized_leg(_leg_body(HANDED + b"}")[:-1], leaves=True)
    assert client.sent == []
    assert (record.status, record.outcome) == (None, "disconnected")


@pytest.mark.asyncio
async def test_disconnect_while_the_body_is_being_read() -> None:
    """Nothing answered, nothing counted, and the record says the client left."""
    h, records = Harness(), _Records()
    client = Client([b'{"model": ', b"never"])
    client.pending.pop()  # the second half never comes
    client.leave()
    mw = UsagePatchMiddleware(h.middleware(json_response(chat_completion())).app, ledger=h.ledger,
                              metrics=h.metrics, config=h.config, recorder=records)  # type: ignore[arg-type]
    await h.call(mw, client)
    assert client.sent == []
    assert h.inner_keys == []
    assert h.requests() == {}
    [record] = records.records
    assert (record.status, record.outcome) == (None, "disconnected")


@pytest.mark.asyncio
@pytest.mark.parametrize("started", [False, True], ids=["before-start", "after-start"])
async def test_inner_app_raising_leaves_nothing_behind(started: bool) -> None:
    h = Harness()
    client = Client(STREAM_BODY)

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        if started:
            await start(send, b"text/event-stream")
            await send({"type": "http.response.body", "body": ROLE, "more_body": True})
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        await h.middleware(respond, (64, 48))(http_scope(), client.receive, client.send)
    h.assert_clean()
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_inner_app_raising_before_the_engine_saw_it_is_not_counted() -> None:
    h = Harness()

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("no engine")

    with pytest.raises(RuntimeError):
        await h.middleware(respond)(http_scope(), Client(chat_request()).receive, Client().send)
    h.assert_clean()
    assert h.requests() == {}


# -- ghost usage (upstream mode) -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_ghost_usage_asks_for_usage_drops_it_and_still_counts_the_request() -> None:
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    sent = [(b"content-length", b"%d" % len(chat_request(stream=True))), (b"accept-encoding", b"gzip, br")]
    # An upstream that reports the number itself; no engine event.
    upstream_usage = chunk(
        usage={
            "prompt_tokens": 64,
            "completion_tokens": 2,
            "total_tokens": 66,
            "prompt_tokens_details": {"cached_tokens": 32},
        }
    )
    await h.call(h.middleware(sse_response(ROLE, TOKEN, upstream_usage, DONE)), client, http_scope(headers=sent))

    forwarded = orjson.loads(h.inner_bodies[0])
    assert forwarded["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    # the replayed body's length and an unencoded answer, each the one value the inner app sees
    assert h.inner_header(b"content-length") == [str(len(h.inner_bodies[0])).encode()]
    assert h.inner_header(b"accept-encoding") == [b"identity"]
    assert client.body == ROLE + TOKEN + DONE  # the client did not ask for usage
    assert h.requests() == {"hit": 1}
    assert h.sample("cachetally_cached_tokens_total", model="m", source="upstream", tier="all") == 32
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 64


def finishing(index: int = 0, **extra: Any) -> bytes:
    """A chunk with a finish_reason, serialized the way vLLM's pydantic models are."""
    choice = {"index": index, "delta": {"content": "!"}, "finish_reason": "length"}
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice], **extra}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


GHOST_USAGE = chunk(
    usage={"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66}, system_fingerprint="fp-1"
)


@pytest.mark.asyncio
@pytest.mark.parametrize("together", [False, True], ids=["separate-sends", "one-send"])
async def test_ghost_usage_puts_the_fingerprint_back_where_vllm_would_have(together: bool) -> None:
    # vLLM 0.32 stamps system_fingerprint on finishing chunks only without include_usage;
    # with it, the (dropped) usage chunk carries it. n=2: two finishing chunks. Choice 1's
    # token is not held behind choice 0's finishing chunk: each choice keeps its order.
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    upstream = [ROLE, TOKEN, finishing(0), choice_token(1), finishing(1), GHOST_USAGE, DONE]
    if together:
        upstream = [b"".join(upstream)]
    await h.call(h.middleware(sse_response(*upstream)), client)
    direct = ROLE + TOKEN + choice_token(1) + finishing(0, system_fingerprint="fp-1")
    direct += finishing(1, system_fingerprint="fp-1") + DONE
    assert client.body == direct
    assert h.requests() == {"unknown": 1}


def choice_token(index: int) -> bytes:
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": index, "delta": {"content": "more"}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@pytest.mark.asyncio
async def test_ghost_hold_lets_a_choice_still_generating_stream_past_one_that_finished() -> None:
    """n=2: choice 0 finishes first; choice 1's chunks reach the client as they come."""
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True, n=2))
    seen_by_client: list[bytes] = []
    go_on = asyncio.Event()

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        for event in (ROLE, finishing(0), choice_token(1), choice_token(1)):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        seen_by_client.append(client.body)  # before the stream goes on
        go_on.set()
        for event in (finishing(1), GHOST_USAGE, DONE):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await h.call(h.middleware(respond), client)
    assert seen_by_client == [ROLE + choice_token(1) + choice_token(1)]
    assert client.body == (
        ROLE + choice_token(1) * 2 + finishing(0, system_fingerprint="fp-1")
        + finishing(1, system_fingerprint="fp-1") + DONE
    )


@pytest.mark.asyncio
async def test_ghost_hold_releases_unchanged_when_no_usage_chunk_comes() -> None:
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    await h.call(h.middleware(sse_response(ROLE, finishing(0), DONE)), client)
    assert client.body == ROLE + finishing(0) + DONE


@pytest.mark.asyncio
async def test_ghost_usage_without_a_fingerprint_changes_nothing_else() -> None:
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    await h.call(h.middleware(sse_response(ROLE, finishing(0), USAGE, DONE)), client)
    assert client.body == ROLE + finishing(0) + DONE


def usage_so_far(completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": 64, "completion_tokens": completion_tokens, "total_tokens": 64 + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 32}}


@pytest.mark.asyncio
async def test_ghost_usage_stands_down_before_an_upstream_that_sends_usage_unasked() -> None:
    """vLLM's ``--enable-force-include-usage`` puts usage on every chunk and sends the usage
    chunk whatever the client asked: the client gets the stream as that upstream sent it. Seen
    on vLLM 0.32 before: the client lost the usage chunk, and its fingerprint moved to the last
    choice's chunk."""
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True))
    upstream = [chunk({"role": "assistant", "content": ""}, usage=usage_so_far(0)),
                chunk({"content": "hello"}, usage=usage_so_far(1)), finishing(0, usage=usage_so_far(2)),
                chunk(usage=usage_so_far(2), system_fingerprint="fp-1"), DONE]
    await h.call(h.middleware(sse_response(*upstream)), client)
    assert sse_payloads(client.body) == sse_payloads(b"".join(upstream))
    assert h.requests() == {"hit": 1}  # counted once, from the usage chunk
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 64
    assert h.sample("cachetally_cached_tokens_total", model="m", source="upstream", tier="all") == 32


@pytest.mark.asyncio
async def test_ghost_usage_leaves_a_client_that_asked_for_usage_alone() -> None:
    h = Harness(PatchConfig(ghost_usage=True))
    body = chat_request(stream=True, stream_options={"include_usage": True})
    client = Client(body)
    await h.call(h.middleware(sse_response(ROLE, TOKEN, USAGE, DONE), (64, 48)), client)
    assert h.inner_bodies == [body]
    payloads = sse_payloads(client.body)
    assert payloads[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert h.requests() == {"hit": 1}


@pytest.mark.asyncio
async def test_ghost_usage_does_not_touch_non_streaming_requests() -> None:
    h = Harness(PatchConfig(ghost_usage=True))
    body = chat_request()
    client = Client(body)
    await h.call(h.middleware(json_response(chat_completion()), (64, 48)), client)
    assert h.inner_bodies == [body]


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["responses", "messages"])
async def test_ghost_usage_leaves_a_responses_or_messages_stream_alone(route: str) -> None:
    """Their streams end with their usage whatever the body asks (Responses' ``response.completed``,
    Messages' ``message_delta``), and their models have no ``stream_options`` nor ``stream_interval``
    (vLLM reads that on chat and completions alone): the body goes as sent."""
    h = Harness(PatchConfig(ghost_usage=True))
    request = ({"model": "m", "input": "hi", "stream": True} if route == "responses" else
               {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    request["stream_interval"] = 8
    body = orjson.dumps(request)
    await h.call(h.middleware(json_response(b'{"error": {"message": "no"}}', status=400)), Client(body),
                 http_scope(f"/v1/{route}"))
    assert h.inner_bodies == [body]


@pytest.mark.asyncio
async def test_ghost_usage_keeps_the_clients_other_stream_options() -> None:
    """An upstream's own options stay beside the usage asked for (OpenAI's ``include_obfuscation``
    shapes its stream)."""
    h = Harness(PatchConfig(ghost_usage=True))
    client = Client(chat_request(stream=True, stream_options={"include_obfuscation": False}))
    await h.call(h.middleware(sse_response(ROLE, TOKEN, DONE)), client)
    assert orjson.loads(h.inner_bodies[0])["stream_options"] == {
        "include_obfuscation": False, "include_usage": True, "continuous_usage_stats": False}


# -- one count per request, with the right cache label -------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("events", "response", "want"),
    [
        (((64, 48),), chat_completion(), "hit"),
        (((64, 0),), chat_completion(), "miss"),
        ((), chat_completion(prompt_tokens_details={"cached_tokens": 8}), "hit"),
        ((), chat_completion(prompt_tokens_details={"cached_tokens": 0}), "miss"),
        ((), chat_completion(), "unknown"),
    ],
    ids=["engine-hit", "engine-miss", "upstream-hit", "upstream-miss", "unknown"],
)
async def test_each_request_is_counted_once_with_its_cache_label(
    events: tuple[tuple[int, int], ...], response: bytes, want: str
) -> None:
    h = Harness()
    mw = h.middleware(json_response(response), *events)
    for _ in range(3):
        await h.call(mw, Client(chat_request()))
    assert h.requests() == {want: 3}
    assert h.sample("cachetally_requests_total", model="m", route="chat", stream="false", cache=want) == 3
    stats = h.metrics.stats
    assert stats.total_requests == 3
    if want == "unknown":
        assert stats.unknown_requests == 3
        # The zero policy wrote 0 into the response; the metrics do not pretend it was known.
        assert h.sample("cachetally_prompt_tokens_total", model="m") is None


@pytest.mark.asyncio
async def test_a_served_answer_without_any_usage_is_still_a_counted_request() -> None:
    """No engine figures and no usage object (a peer that reports none): the request was
    served, so it is counted, as ``unknown``, not dropped from the request totals."""
    h = Harness()
    answer = orjson.loads(chat_completion())
    del answer["usage"]
    await h.call(h.middleware(json_response(orjson.dumps(answer))), Client(chat_request()))
    assert h.requests() == {"unknown": 1}
    assert h.metrics.stats.unknown_requests == 1

@pytest.mark.asyncio
async def test_completions_route_is_labelled() -> None:
    h = Harness()
    text = orjson.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": "x"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        }
    )
    client = Client(orjson.dumps({"model": "m", "prompt": "hi"}))
    await h.call(h.middleware(json_response(text), (10, 0)), client, http_scope("/v1/completions"))
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    labels = {"model": "m", "route": "completions", "stream": "false", "cache": "miss"}
    assert h.sample("cachetally_requests_total", **labels) == 1


@pytest.mark.asyncio
async def test_lifespan_scope_passes_through() -> None:
    h = Harness()
    calls: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope["type"])

    mw = UsagePatchMiddleware(inner, ledger=h.ledger, metrics=h.metrics)
    await mw({"type": "lifespan"}, Client().receive, Client().send)
    assert calls == ["lifespan"]


@pytest.mark.asyncio
async def test_a_responses_stream_cut_early_takes_no_model_name_from_the_clients_metadata() -> None:
    """vLLM's ``response.created`` echoes the request's ``metadata`` ahead of the response's
    own ``model``; a client hanging up before ``response.completed`` must not get its
    metadata's ``model`` into the labels, and is labelled with the response's own."""
    h = Harness()

    def event(kind: str, data: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"

    def engine(metadata: dict[str, str]) -> InnerApp:
        async def respond(scope: Scope, receive: Receive, send: Send) -> None:
            head = {"id": "resp_1", "created_at": 1, "incomplete_details": None, "instructions": None,
                    "metadata": metadata, "model": "served", "object": "response", "output": [],
                    "status": "in_progress", "usage": None}
            await start(send, b"text/event-stream")
            await send({"type": "http.response.body", "body": event("response.created", {"response": head}),
                        "more_body": True})
            for _ in range(3):
                await send({"type": "http.response.body", "more_body": True,
                            "body": event("response.output_text.delta", {"delta": "x"})})
            assert (await receive())["type"] == "http.disconnect"  # the client hung up: no response.completed

        return respond

    for name in ("mint-1", "mint-2"):
        metadata = {"model": name}
        client = Client(orjson.dumps({"model": "served", "input": "hi", "stream": True, "metadata": metadata}))
        mw = h.middleware(engine(metadata), (20, 0))
        task = asyncio.create_task(mw(http_scope("/v1/responses"), client.receive, client.send))

        async def events_sent() -> None:
            while len(client.sent) < 5:  # the start and four events
                await asyncio.sleep(0)

        await asyncio.wait_for(events_sent(), 5)  # a failure, never a spin
        client.leave()
        await asyncio.wait_for(task, 5)
    models = {s.labels["model"] for f in h.metrics.registry.collect() for s in f.samples
              if s.name == "cachetally_requests_total"}
    assert models == {"served"}  # response.created's own model, never the metadata's


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["responses", "messages"])
async def test_use_beam_search_on_responses_and_messages_is_ignored_as_vllm_ignores_it(route: str) -> None:
    """vLLM's Responses and Messages models have no ``use_beam_search`` (an extra, dropped): a
    request whose tool loop runs two engine requests is billed both, whatever the body says."""
    if route == "responses":
        model = pytest.importorskip("vllm.entrypoints.openai.responses.protocol").ResponsesRequest
        request = {"model": "m", "input": "hi", "use_beam_search": True}
        answer = {"id": "resp_1", "object": "response", "model": "m", "status": "completed", "output": [],
                  "usage": {"input_tokens": 250, "output_tokens": 2, "total_tokens": 252,
                            "input_tokens_details": {"cached_tokens": 100}}}
    else:
        model = pytest.importorskip("vllm.entrypoints.anthropic.protocol").AnthropicMessagesRequest
        request = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                   "use_beam_search": True}
        answer = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                  "usage": {"input_tokens": 250, "output_tokens": 2}}
    assert "use_beam_search" not in model.model_fields
    h = Harness()
    client = Client(orjson.dumps(request))
    await h.call(h.middleware(json_response(orjson.dumps(answer)), (100, 0), (150, 100)), client,
                 http_scope(f"/v1/{route}"))
    usage = client.json()["usage"]
    if route == "responses":
        assert usage["input_tokens_details"]["cached_tokens"] == 100
    else:  # Anthropic counts cache reads beside the uncached input: 250 = 150 + 100
        assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (150, 100)
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 250


@pytest.mark.asyncio
@pytest.mark.parametrize("flag", [True, "true", 1])
async def test_a_beam_search_counts_the_clients_prompt_not_every_beam_step(flag: Any) -> None:
    """vLLM's beam search runs one engine request per beam per step on the prompt and the
    tokens so far (each publishes its event): the bill is the client's prompt, as its
    response says, not the sum of the steps."""
    h = Harness()
    client = Client(chat_request(use_beam_search=flag, n=2))
    steps = [(64, 48), (65, 64), (65, 64), (66, 65), (66, 65)]  # the prompt, then two beams per step
    await h.call(h.middleware(json_response(chat_completion()), *steps), client)
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 64
    assert h.sample("cachetally_cached_tokens_total", model="m", source="engine", tier="all") == 48


@pytest.mark.asyncio
async def test_a_streamed_beam_search_asks_for_its_usage_chunk_in_every_mode() -> None:
    """A beam search's answer reaches the client from no engine output the tap counts (each
    beam's whole text in one event, built from the search's steps): embedded too, the stream
    asks vLLM for its usage chunk, bills from it and keeps it from the client that asked for none."""
    h = Harness()
    client = Client(chat_request(use_beam_search=True, n=2, stream=True))
    beams = [chunk(choices=[{"index": i, "delta": {"content": "x y z"}, "finish_reason": "length"}]) for i in (0, 1)]
    usage = chunk(usage={"prompt_tokens": 64, "completion_tokens": 32, "total_tokens": 96})
    await h.call(h.middleware(sse_response(ROLE, *beams, usage, DONE), (64, 0)), client)
    assert orjson.loads(h.inner_bodies[0])["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert client.body == ROLE + b"".join(beams) + DONE
    assert h.sample("cachetally_completion_tokens_total", model="m") == 32


def text_completion(prompt_tokens: int = 10, **usage: Any) -> bytes:
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                                   "total_tokens": prompt_tokens + 1, **usage}})


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], ["a", "b", "c"]],
                         ids=["two-strings", "two-token-lists", "three-strings"])
async def test_a_beam_search_over_several_prompts_is_refused_and_counted_while_billing(prompt: Any) -> None:
    """vLLM runs one beam search per prompt, their steps interleaved: no event says which is a
    client's prompt. While billing is on the request is refused with a 400 before the engine
    runs, and ``cachetally_refused_unmetered_total`` says so (two prompts are already several)."""
    h = Harness(PatchConfig(refuse_unmetered=True))
    client = Client(orjson.dumps({"model": "m", "prompt": prompt, "n": 2, "use_beam_search": True}))
    await h.call(h.middleware(json_response(text_completion()), (10, 0)), client, http_scope("/v1/completions"))
    assert client.status == 400
    assert "not metered" in client.json()["error"]["message"]
    assert h.sample("cachetally_refused_unmetered_total", route="/v1/completions") == 1
    assert h.requests() == {}  # nothing billed


@pytest.mark.asyncio
async def test_a_beam_search_over_several_prompts_is_served_while_billing_is_off() -> None:
    """The refusal is billing's: a server that does not bill serves the search as vLLM does."""
    h = Harness(PatchConfig(refuse_unmetered=False))
    client = Client(orjson.dumps({"model": "m", "prompt": ["a", "b"], "n": 2, "use_beam_search": True}))
    await h.call(h.middleware(json_response(text_completion()), (10, 0)), client, http_scope("/v1/completions"))
    assert client.status == 200
    assert h.sample("cachetally_refused_unmetered_total", route="/v1/completions") is None


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt", ["a", ["a"], [1, 2, 3], [1.0, 2.0], [True, 2]],
                         ids=["string", "one-string", "token-ids", "float-ids", "bool-id"])
async def test_a_beam_search_over_one_prompt_is_served_and_billed_while_billing(prompt: Any) -> None:
    """A list of token ids is one prompt, as is a one-string list: served and billed once.
    vLLM's model reads ``1.0`` and ``true`` in it as token ids too."""
    h = Harness(PatchConfig(refuse_unmetered=True))
    client = Client(orjson.dumps({"model": "m", "prompt": prompt, "n": 2, "use_beam_search": True}))
    await h.call(h.middleware(json_response(text_completion()), (10, 0), (11, 10), (11, 10)), client,
                 http_scope("/v1/completions"))
    assert client.status == 200
    assert h.sample("cachetally_refused_unmetered_total", route="/v1/completions") is None
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 10


@pytest.mark.asyncio
@pytest.mark.parametrize("billing", [True, False], ids=["billing", "not-billing"])
async def test_several_prompts_without_a_beam_search_are_served_and_billed_all(billing: bool) -> None:
    """Only a beam search over several prompts is refused: a completions batch is metered, each
    prompt its own engine request, and billed all of them (not the first alone, as a beam search)."""
    h = Harness(PatchConfig(refuse_unmetered=billing))
    client = Client(orjson.dumps({"model": "m", "prompt": ["a", "b"]}))
    await h.call(h.middleware(json_response(text_completion(21)), (10, 0), (11, 0)), client,
                 http_scope("/v1/completions"))
    assert client.status == 200
    assert h.sample("cachetally_refused_unmetered_total", route="/v1/completions") is None
    assert h.sample("cachetally_prompt_tokens_total", model="m") == 21


@pytest.mark.asyncio
@pytest.mark.parametrize("drop", [True, False], ids=["upstream", "upstream-behind-a-pd-router"])
async def test_a_clients_remote_prefill_claim_is_not_billed_as_cache_reads_in_upstream_mode(drop: bool) -> None:
    """Upstream mode without ``pd_legs``: vLLM reports a body's ``kv_transfer_params``
    ``remote_prefill_cached_tokens`` as its own cache reads, so the client would choose its
    cached count (and its discount). The claim is removed before the upstream sees it."""
    h = Harness(PatchConfig(drop_kv_transfer_params=drop, strip_details_flag=False))

    async def vllm_upstream(scope: Scope, receive: Receive, send: Send) -> None:
        claim = orjson.loads(h.inner_bodies[-1]).get("kv_transfer_params", {}).get("remote_prefill_cached_tokens")
        cached = 0 if claim is None else claim
        await json_response(chat_completion(prompt_tokens_details={"cached_tokens": cached}))(scope, receive, send)

    client = Client(chat_request(kv_transfer_params={"do_remote_prefill": True, "remote_prefill_cached_tokens": 60}))
    await h.call(h.middleware(vllm_upstream), client)
    billed = 0 if drop else 60
    assert client.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": billed}
    assert h.sample("cachetally_cached_tokens_total", model="m", source="upstream", tier="all") == billed
    assert h.requests() == {"hit" if billed else "miss": 1}


@pytest.mark.asyncio
async def test_a_usage_chunk_whose_id_has_a_long_run_of_digits_keeps_the_engines_compact_form() -> None:
    """A string of 19 digits or more reads like an integer past 64 bits, so the chunk is read by
    ``json``; it was written back in ``json``'s spaced form, unlike every other chunk (a random
    ``chatcmpl-`` hex id holds such a run now and then). It comes back as orjson writes it."""
    h = Harness()
    client = Client(chat_request(stream=True, stream_options={"include_usage": True}))
    rid = "chatcmpl-53fbc3d42dc449809098134995075869"
    usage = {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65}
    event = {"id": rid, "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}
    await h.call(h.middleware(sse_response(ROLE, TOKEN, b"data: " + orjson.dumps(event) + b"\n\n", DONE), (64, 48)),
                 client)
    patched = {**event, "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 48}}}
    assert client.body == ROLE + TOKEN + b"data: " + orjson.dumps(patched) + b"\n\n" + DONE
