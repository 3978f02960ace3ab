"""The simulated engine: vLLM-shaped responses, exact Scheduled events, standalone CLI."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio

from engine_adapter.engine import Engine
from engine_adapter.events import Scheduled, current_request_key
from engine_adapter.sim import SimConfig, SimEngine
from engine_adapter.sim.tokenizer import render_chat, tokenize
from tests.servers import stop

ROOT = Path(__file__).resolve().parents[3]


class ListSink:
    def __init__(self) -> None:
        self.events: list[Scheduled] = []
        #: What the sink was told, in order: ("added", key, prompt) and ("scheduled", key, prompt).
        self.told: list[tuple[str, str, int]] = []

    def publish(self, event: Scheduled) -> None:
        self.events.append(event)
        self.told.append(("scheduled", event.request_id, event.prompt_tokens))

    def added(self, request_id: str, prompt_tokens: int) -> None:
        self.told.append(("added", request_id, prompt_tokens))


def words(prefix: str, count: int) -> str:
    """``count`` distinct one-token words."""
    return " ".join(f"{prefix}{i}" for i in range(count))


def sse_events(body: bytes) -> list[Any]:
    """The data of every SSE event; ``[DONE]`` stays a string."""
    assert body.endswith(b"data: [DONE]\n\n")
    out: list[Any] = []
    for event in body.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ")
        data = event[len(b"data: ") :]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


@pytest.fixture
def sink() -> ListSink:
    return ListSink()


@pytest_asyncio.fixture
async def engine(sink: ListSink) -> AsyncIterator[SimEngine]:
    engine = SimEngine(sink, SimConfig(default_max_tokens=3))
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def client(engine: SimEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = await engine.start()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        yield client


async def complete(client: httpx.AsyncClient, prompt: Any, **extra: Any) -> dict[str, Any]:
    payload = {"model": "sim-model", "prompt": prompt, **extra}
    resp = await client.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.asyncio
async def test_cold_then_repeated_prompt(client: httpx.AsyncClient, sink: ListSink) -> None:
    prompt = words("w", 600)
    cold = await complete(client, prompt)
    warm = await complete(client, prompt)
    assert cold["usage"] == {"prompt_tokens": 600, "total_tokens": 603, "completion_tokens": 3}
    assert "prompt_tokens_details" not in warm["usage"]
    assert sink.events == [
        Scheduled(cold["id"], 600, 0, 0, 0, cache_creation_tokens=592, source="engine", first_choice=0),
        Scheduled(warm["id"], 600, 592, 592, 0, cache_creation_tokens=0, source="engine", first_choice=0),
    ]


@pytest.mark.asyncio
async def test_prompt_of_whole_blocks_recomputes_its_last_block(
    client: httpx.AsyncClient, sink: ListSink
) -> None:
    prompt = words("w", 608)
    await complete(client, prompt)
    await complete(client, prompt)
    assert [e.cached_tokens for e in sink.events] == [0, 592]


@pytest.mark.asyncio
async def test_shared_prefix_hits_its_full_blocks(
    client: httpx.AsyncClient, sink: ListSink
) -> None:
    await complete(client, words("w", 600))
    await complete(client, words("w", 300) + " " + words("x", 300))
    assert [e.cached_tokens for e in sink.events] == [0, 288]


@pytest.mark.asyncio
async def test_chat_shares_system_prompt_prefix(client: httpx.AsyncClient, sink: ListSink) -> None:
    system = {"role": "system", "content": words("s", 200)}
    for question in ("hello there", "what now"):
        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": [system, {"role": "user", "content": question}]},
        )
        assert resp.json()["usage"]["prompt_tokens"] == 210
    # 205 shared tokens: <|im_start|> system s0..s199 <|im_end|> <|im_start|> user.
    assert [e.cached_tokens for e in sink.events] == [0, 192]


@pytest.mark.asyncio
async def test_key_comes_from_the_proxy_context(client: httpx.AsyncClient, sink: ListSink) -> None:
    token = current_request_key.set("proxy-key-1")
    try:
        await complete(client, "hello world")
    finally:
        current_request_key.reset(token)
    assert [e.request_id for e in sink.events] == ["proxy-key-1"]


@pytest.mark.asyncio
async def test_lru_eviction_with_tiny_capacity(sink: ListSink) -> None:
    engine = SimEngine(sink, SimConfig(capacity_blocks=2))
    app = await engine.start()
    a, b = words("a", 40), words("b", 40)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        for prompt in (a, a, b, a):
            await complete(c, prompt)
    await engine.stop()
    assert [e.cached_tokens for e in sink.events] == [0, 32, 0, 0]
    assert engine.cache.num_cached_blocks == 2


@pytest.mark.asyncio
async def test_list_of_prompts_is_one_engine_request_each(
    client: httpx.AsyncClient, sink: ListSink
) -> None:
    body = await complete(client, [words("w", 100), words("x", 50)], n=2, max_tokens=2)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert {c["text"] for c in body["choices"]} == {" tok0 tok1"}
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"] == {"prompt_tokens": 150, "total_tokens": 158, "completion_tokens": 8}
    assert [(e.request_id, e.prompt_tokens) for e in sink.events] == [
        (body["id"], 100),
        (body["id"], 50),
    ]


@pytest.mark.asyncio
async def test_batch_prompts_are_scheduled_in_order(
    client: httpx.AsyncClient, sink: ListSink
) -> None:
    body = await complete(client, [words("w", 100)] * 2)
    assert body["usage"]["prompt_tokens"] == 200
    assert [e.cached_tokens for e in sink.events] == [0, 96]


@pytest.mark.asyncio
async def test_token_id_prompts(client: httpx.AsyncClient, sink: ListSink) -> None:
    await complete(client, list(range(40)))
    await complete(client, [list(range(40)), list(range(33))])
    counts = [(e.prompt_tokens, e.cached_tokens) for e in sink.events]
    assert counts == [(40, 0), (40, 32), (33, 32)]


@pytest.mark.asyncio
async def test_chat_n2_is_one_engine_request(client: httpx.AsyncClient, sink: ListSink) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    resp = await client.post("/v1/chat/completions", json={"messages": messages, "n": 2})
    body = resp.json()
    prompt_tokens = len(tokenize(render_chat(messages)))
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "sim-model"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": " tok0 tok1 tok2",
        "refusal": None,
    }
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 6,
        "completion_tokens": 6,
    }
    assert len(sink.events) == 1
    assert sink.events[0].prompt_tokens == prompt_tokens == 7


@pytest.mark.asyncio
async def test_chat_stream_include_usage(client: httpx.AsyncClient, sink: ListSink) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    content = [c for c in chunks if c["choices"]][1:]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == " tok0 tok1 tok2"
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    usage_chunks = [c for c in chunks if "usage" in c]
    assert usage_chunks == [chunks[-1]]
    assert chunks[-1]["choices"] == []
    prompt_tokens = sink.events[0].prompt_tokens
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 3,
        "completion_tokens": 3,
    }
    assert sink.events[0].request_id == chunks[0]["id"]


@pytest.mark.asyncio
async def test_completion_stream_continuous_usage(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": [words("w", 20), words("x", 10)],
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = sse_events(resp.content)[:-1]
    content, final = chunks[:-1], chunks[-1]
    assert len(content) == 3 * 4
    assert all("usage" in c and len(c["choices"]) == 1 for c in content)
    by_index: dict[int, list[tuple[int, int]]] = {}
    for c in content:
        u = c["usage"]
        by_index.setdefault(c["choices"][0]["index"], []).append(
            (u["prompt_tokens"], u["completion_tokens"])
        )
    assert by_index == {
        0: [(20, 1), (20, 2), (20, 3)],
        1: [(20, 1), (20, 2), (20, 3)],
        2: [(10, 1), (10, 2), (10, 3)],
        3: [(10, 1), (10, 2), (10, 3)],
    }
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 30, "total_tokens": 42, "completion_tokens": 12}


@pytest.mark.asyncio
async def test_chat_stream_continuous_usage_covers_role_chunk(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = sse_events(resp.content)[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert [len(c["choices"]) for c in chunks] == [1, 1, 1, 1, 0]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "stream_options", [None, {"include_usage": False}, {"continuous_usage_stats": True}]
)
async def test_stream_without_include_usage_has_no_usage(
    client: httpx.AsyncClient, sink: ListSink, stream_options: dict[str, bool] | None
) -> None:
    for route, payload in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi there"}),
    ):
        payload.update(stream=True, stream_options=stream_options)
        resp = await client.post(route, json=payload)
        assert b"usage" not in resp.content
        assert resp.content.endswith(b"data: [DONE]\n\n")
    assert len(sink.events) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("route", "content", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", b'{"model": "sim-model"}', "messages"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "messages"),
        ("/v1/completions", b'{"model": "sim-model"}', "prompt"),
        ("/v1/completions", b'{"prompt": 5}', "prompt"),
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "stream": "maybe"}', "stream"),
        (
            "/v1/completions",
            b'{"prompt": "x", "stream_options": {"include_usage": true}}',
            "stream_options",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    client: httpx.AsyncClient, sink: ListSink, route: str, content: bytes, param: str | None
) -> None:
    resp = await client.post(route, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"]
    assert sink.events == []


@pytest.mark.asyncio
async def test_unknown_model_is_404(client: httpx.AsyncClient, sink: ListSink) -> None:
    resp = await client.post("/v1/completions", json={"model": "gpt-x", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json() == {
        "error": {
            "message": "The model `gpt-x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert sink.events == []


@pytest.mark.asyncio
async def test_report_cached_tokens_like_vllm_prompt_tokens_details(sink: ListSink) -> None:
    """vLLM 0.32's figures with ``--enable-prompt-tokens-details`` (seen on it: tmp capture of
    its raw responses): chat reports reads and writes; completions its reads alone, and of
    one prompt, not their sum: in JSON the last prompt's, in a stream the first's."""
    engine = SimEngine(sink, SimConfig(report_cached_tokens=True, default_max_tokens=1))
    app = await engine.start()
    warm, cold = words("w", 40), words("c", 40)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": warm}]})).json()
        first = await complete(c, warm)
        batch = await complete(c, [warm, cold])
        streamed = await c.post("/v1/completions", json={"prompt": [warm, words("s", 40)], **stream})
    await engine.stop()
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 32}
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert batch["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # cold's; warm's 32 lost
    final = sse_events(streamed.content)[-2]
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # warm's; the other's lost


@pytest.mark.asyncio
async def test_system_fingerprint_where_vllm_puts_it(client: httpx.AsyncClient) -> None:
    """On the JSON body; in a stream on the usage chunk, else on each choice's finishing chunk
    (what the proxy's ghost usage chunk must move back when it drops that chunk)."""
    body = await complete(client, "hi", n=2)
    assert body["system_fingerprint"] == "vllm-sim"
    for options, where in (({"include_usage": True}, "usage"), (None, "finish")):
        extra = {"stream_options": options} if options else {}
        resp = await client.post("/v1/completions", json={"prompt": "hi", "n": 2, "stream": True, **extra})
        chunks = sse_events(resp.content)[:-1]
        stamped = [c for c in chunks if "system_fingerprint" in c]
        assert [list(c)[-1] for c in stamped] == ["system_fingerprint"] * len(stamped)
        if where == "usage":
            assert [c["choices"] for c in stamped] == [[]]
        else:
            assert sorted(c["choices"][0]["index"] for c in stamped) == [0, 1]
            assert all(c["choices"][0]["finish_reason"] == "length" for c in stamped)


@pytest.mark.asyncio
async def test_messages_stream_starts_with_the_whole_prompt_as_vllm_does(sink: ListSink) -> None:
    """vLLM's ``message_start`` has no cache fields yet, even when it reports them: its
    ``input_tokens`` is the whole prompt; only ``message_delta`` splits it."""
    engine = SimEngine(sink, SimConfig(report_cached_tokens=True, default_max_tokens=1))
    app = await engine.start()
    body = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": words("m", 40)}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        await c.post("/v1/messages", json=body)
        resp = await c.post("/v1/messages", json={**body, "stream": True})
    await engine.stop()
    events = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in resp.content.split(b"\n\n") if e]
    start, delta = events[0]["message"]["usage"], events[-2]["usage"]
    prompt = delta["input_tokens"] + delta["cache_read_input_tokens"] + delta["cache_creation_input_tokens"]
    assert start == {"input_tokens": prompt, "output_tokens": 0}
    assert delta["cache_read_input_tokens"] > 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "messages"), [
    ({"instructions": "Be brief.", "input": "hi there"},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]),
    ({"instructions": "", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "you"}]}]},
     [{"role": "user", "content": "hi\nyou"}]),
], ids=["instructions", "input-text-parts"])
async def test_responses_prompt_is_the_chat_vllm_renders(
        client: httpx.AsyncClient, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """As vLLM's Responses route renders it (and its ``/tokenize`` counts that chat): non-empty
    ``instructions`` first, as a system message; ``input_text`` parts as text parts."""
    resp = await client.post("/v1/responses", json={"model": "sim-model", **body})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["input_tokens"] == len(tokenize(render_chat(messages)))


@pytest.mark.asyncio
async def test_models_health_metrics_and_lifecycle(sink: ListSink) -> None:
    engine: Engine = SimEngine(sink)
    assert engine.name == "sim"
    assert not engine.healthy()
    app = await engine.start()
    assert engine.healthy()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        assert (await c.get("/health")).status_code == 200
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["sim-model"]
        await complete(c, words("w", 40))
        await complete(c, words("w", 40))
        await engine.stop()
        await engine.stop()
        assert not engine.healthy()
        assert (await c.get("/health")).status_code == 503
        resp = await c.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status_code == 503
    text = engine.metrics_text().decode()
    assert "sim_requests_total 2\n" in text
    assert "sim_prompt_tokens_total 80\n" in text
    assert "sim_prompt_tokens_cached_total 32\n" in text
    assert "sim_prefix_cache_blocks 2\n" in text


@pytest.mark.asyncio
async def test_token_delay_applies_per_step(sink: ListSink) -> None:
    engine = SimEngine(sink, SimConfig(token_delay_s=0.02))
    app = await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        start = time.perf_counter()
        await complete(c, "hi", max_tokens=5)
        assert time.perf_counter() - start >= 0.1
    await engine.stop()


@pytest.mark.asyncio
async def test_each_prompt_is_announced_on_arrival_and_scheduled_after_the_prefill(sink: ListSink) -> None:
    """As vLLM's tap: every engine request's prompt is announced before any is scheduled, so
    that one cut during the prefill still has its prompt billed."""
    engine = SimEngine(sink, SimConfig(prefill_delay_s=0.01, default_max_tokens=1))
    app = await engine.start()
    token = current_request_key.set("k")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
            await complete(c, [words("a", 40), words("b", 7)], n=2)
    finally:
        current_request_key.reset(token)
    await engine.stop()
    assert sink.told == [("added", "k", 40), ("added", "k", 7), ("scheduled", "k", 40), ("scheduled", "k", 7)]


@pytest.fixture
def standalone_sim(tmp_path: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "sim.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_adapter.sim", "--port", str(port), "--report-cached-tokens"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "sim.log").read_text()
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "standalone sim did not come up"
            time.sleep(0.1)
        yield base
    finally:
        stop(proc)
        log.close()


@pytest.mark.loopback
def test_standalone_cli_with_openai_client(standalone_sim: str) -> None:
    messages = [
        {"role": "system", "content": words("s", 100)},
        {"role": "user", "content": "hello"},
    ]
    with openai.OpenAI(base_url=f"{standalone_sim}/v1", api_key="unused") as client:
        first = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=2)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        stream = client.chat.completions.create(
            model="sim-model",
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok0 tok1"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens == first.usage.prompt_tokens == 109
    assert usage.prompt_tokens_details.cached_tokens == 96


@pytest.mark.asyncio
async def test_messages_errors_have_vllms_anthropic_envelope(client: httpx.AsyncClient, sink: ListSink) -> None:
    """vLLM's Messages route answers its errors as ``{"type": "error", "error": {type, message}}``
    (``translate_error_response``, the OpenAI type name kept), which the ``anthropic`` SDK
    reads; the sim answered OpenAI's JSON there."""
    unknown = await client.post("/v1/messages", json={"model": "gpt-x", "max_tokens": 1, "messages": []})
    not_object = await client.post("/v1/messages", json=["hi"])
    assert (unknown.status_code, unknown.json()) == (
        404, {"type": "error", "error": {"type": "NotFoundError", "message": "The model `gpt-x` does not exist."}})
    assert (not_object.status_code, not_object.json()) == (
        400, {"type": "error", "error": {"type": "BadRequestError", "message": "Request body must be a JSON object"}})
    responses = await client.post("/v1/responses", json={"model": "gpt-x", "input": "hi"})
    assert responses.json()["error"]["code"] == 404  # the Responses API's stay OpenAI's
    assert sink.events == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--block-size", "0"], "argument --block-size: 0 is not at least 1"),
        (["--capacity-blocks", "-1"], "argument --capacity-blocks: -1 is not at least 0"),
        (["--token-delay-s", "-0.5"], "argument --token-delay-s: -0.5 is not at least 0"),
        (["--port", "70000"], "argument --port: 70000 is not 0 to 65535"),  # it served, on another port
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    ],
)
def test_a_bad_sim_flag_is_one_usage_line_and_exit_2_not_a_traceback(argv: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "engine_adapter.sim", *argv],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1].startswith(f"python -m engine_adapter.sim: error: {says}"), out.stderr
    assert "Traceback" not in out.stderr


def test_sim_help_gives_each_option_its_default_and_unit() -> None:
    out = subprocess.run([sys.executable, "-m", "engine_adapter.sim", "--help"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    for says in ["--block-size TOKENS", "(default: 16)", "--token-delay-s SECONDS", "seconds per generated token",
                 "(default: 4096)", "(default: 8000)", "(default: warning)", "example:"]:
        assert says in out, says
