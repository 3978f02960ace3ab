"""The Responses and Messages shapes on loopback, with the official ``anthropic`` and
``openai`` SDKs: ``cachetally serve --engine sim`` with usage records on (billing on), and
upstream mode in front of the sim.

Embedded: the engine's figures in every path (JSON and SSE; chat and completions too, their
writes under OpenAI's name and vLLM's), 0 reads cold, the full blocks warm, writes = the
blocks the cold request cached; Anthropic's three input figures
add up to the prompt; one record per request under its route. Upstream in front of an
engine that reports the right figures: every stream and body goes through byte for byte,
and the records and counters carry its reads and writes; in front of Anthropic's own
stream shape, a final ``message_delta`` without cache figures stays as it came, and one with
some of them keeps ``message_start``'s others, as the SDK reads them; a Responses
stream whose final event is megabytes large is still read, and one that ends
``response.failed`` is an error, with or without ``event:`` lines.
Refused while billing is on: engine routes that are not metered, background responses."""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_adapter.sim.tokenizer import render_chat, tokenize
from tests.real_vllm import test_vllm_apis as apis
from tests.servers import metric_value, running_server, serving_in_thread
from tests.real_vllm.test_vllm_records import records_for

pytestmark = pytest.mark.loopback

BLOCK = 16  # the sim's block size
MODEL = "sim-model"


@pytest.fixture(scope="module")
def usage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def billed(usage_dir: Path) -> Iterator[str]:
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning",
            "--usage-dir", str(usage_dir), "--usage-flush-interval", "0.2"]
    with running_server(args) as (url, _):
        yield url


def prompt_size(prompt: str, route: str = "chat") -> int:
    return len(tokenize(prompt if route == "completions" else render_chat([{"role": "user", "content": prompt}])))


def sdk(base: str, route: str) -> anthropic.Anthropic | openai.OpenAI:
    if route == "messages":
        return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=30)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def fresh_prompt() -> str:
    return " ".join([uuid.uuid4().hex, *(f"w{i}" for i in range(60))])


@pytest.mark.parametrize("path", [*apis.PATHS, "chat-json", "chat-sse", "chat-continuous", "completions-json",
                                  "completions-sse"])
def test_embedded_figures_records_and_counters(billed: str, usage_dir: Path, path: str) -> None:
    route, ask = ALL_PATHS[path]
    prompt = fresh_prompt()
    size = prompt_size(prompt, route)
    before = httpx.get(f"{billed}/metrics").text
    ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    with sdk(billed, route) as client:
        cold = ask(client, MODEL, prompt, ids[0])
        warm = ask(client, MODEL, prompt, ids[1])
    assert cold == (size, 0, (size // BLOCK) * BLOCK)
    assert warm == (size, ((size - 1) // BLOCK) * BLOCK, 0)
    after = httpx.get(f"{billed}/metrics").text
    moved = metric_value(after, "cachetally_requests_total", route=route) - metric_value(
        before, "cachetally_requests_total", route=route)
    assert moved == 2
    written = metric_value(after, "cachetally_cache_write_tokens_total") - metric_value(
        before, "cachetally_cache_write_tokens_total")
    assert written == cold[2] + warm[2]
    found = records_for(usage_dir, set(ids))
    for rid, figures in zip(ids, (cold, warm), strict=True):
        [record] = found[rid]
        assert record["route"] == route
        assert (record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) == figures


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_stream_is_recorded_as_one_whatever_its_stream_options(billed: str, usage_dir: Path, route: str) -> None:
    """vLLM's Responses and Messages models have no ``stream_options`` (the chat model
    refuses this one): the request is a stream there, and its record says so."""
    rid = uuid.uuid4().hex
    body: dict[str, Any] = {"model": MODEL, "stream": True, "stream_options": []}
    if route == "responses":
        body |= {"input": "hello", "max_output_tokens": 2}
    else:
        body |= {"max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
    answer = httpx.post(f"{billed}/v1/{route}", json=body, headers={"x-request-id": rid})
    assert answer.headers["content-type"].startswith("text/event-stream")
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["stream"], record["outcome"], record["completion_tokens"]) == (True, "completed", 2)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/inference/v1/generate", "/v1/chat/completions/batch"])
def test_unmetered_engine_routes_are_refused_while_billing(billed: str, path: str) -> None:
    before = metric_value(httpx.get(f"{billed}/metrics").text, "cachetally_refused_unmetered_total", route=path)
    answer = httpx.post(f"{billed}{path}", json={"model": MODEL, "input": "hello"})
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == 403
    after = metric_value(httpx.get(f"{billed}/metrics").text, "cachetally_refused_unmetered_total", route=path)
    assert after - before == 1


@pytest.mark.parametrize("flag", [True, 1, "true", "on", "YES", "t"])  # what vLLM's pydantic reads as true
def test_background_responses_are_refused_while_billing(billed: str, flag: object) -> None:
    with openai.OpenAI(base_url=f"{billed}/v1", api_key="unused", max_retries=0) as client, \
            pytest.raises(openai.BadRequestError, match="not metered"):
        client.responses.create(model=MODEL, input="hello", store=True, extra_body={"background": flag})


def test_without_billing_unmetered_routes_pass_through() -> None:
    args = ["-m", "proxy.server.cli", "serve", "--engine", "sim", "--log-level", "warning"]
    with running_server(args) as (url, _):
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "hello"}).status_code == 404  # the sim's own


def billed_front(upstream: str, usage_dir: Path, *extra: str) -> list[str]:
    """``cachetally serve`` in front of ``upstream``, with usage records (billing on)."""
    return ["-m", "proxy.server.cli", "serve", "--upstream", upstream, "--log-level", "warning",
            "--usage-dir", str(usage_dir), "--usage-flush-interval", "0.2", *extra]


@pytest.fixture(scope="module")
def upstream_pair(usage_dir: Path) -> Iterator[tuple[str, str]]:
    """(the sim alone, reporting its figures; cachetally --upstream in front of it, billing on)."""
    sim = ["-m", "engine_adapter.sim", "--log-level", "warning", "--report-cached-tokens"]
    with running_server(sim) as (engine, _):
        proxy = billed_front(engine, usage_dir)
        with running_server(proxy) as (front, _):
            yield engine, front


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_upstream_passes_right_figures_byte_for_byte(upstream_pair: tuple[str, str], api: str, stream: bool) -> None:
    engine, front = upstream_pair
    prompt = fresh_prompt()
    if api == "responses":
        path, body = "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": 3}
    else:
        path, body = "/v1/messages", {"model": MODEL, "max_tokens": 3,
                                      "messages": [{"role": "user", "content": prompt}]}
    body["stream"] = stream
    httpx.post(f"{engine}{path}", json=body)  # warm, so the figures are not all 0
    direct = httpx.post(f"{engine}{path}", json=body).content
    proxied = httpx.post(f"{front}{path}", json=body).content
    if api == "messages" and stream:
        # vLLM's message_start reports no reads yet: it gets the `missing` policy's 0, as
        # the continuous chat chunks before an upstream's final one do; the rest is as it came.
        direct = direct.replace(b'"output_tokens":0}', b'"output_tokens":0,"cache_read_input_tokens":0}', 1)
    assert masked(proxied) == masked(direct)
    assert (b'"cache_read_input_tokens":' if api == "messages" else b'"cached_tokens":') in proxied


def masked(raw: bytes) -> bytes:
    raw = re.sub(rb'"(resp|msg)_[0-9a-f]{32}"', b'"X"', raw)
    return re.sub(rb'"created_at":\d+', b'"created_at":0', raw)


def chat_json(client: openai.OpenAI, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    answer = client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": prompt}],
                                            extra_headers={"x-request-id": rid})
    assert answer.usage is not None
    return _chat(answer.usage)


def chat_sse(client: openai.OpenAI, model: str, prompt: str, rid: str, *,
             continuous: bool = False) -> tuple[int, int, int | None]:
    """``continuous``: vLLM's ``continuous_usage_stats``, a usage object on every chunk, each
    with the whole request's figures."""
    options = {"include_usage": True, **({"continuous_usage_stats": True} if continuous else {})}
    chunks = client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": prompt}],
                                            stream=True, stream_options=options,  # type: ignore[arg-type]
                                            extra_headers={"x-request-id": rid})
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) == (4 if continuous else 1)  # continuous: the role chunk's, 2 tokens', the final
    figures = {_chat(usage) for usage in usages}
    assert len(figures) == 1, figures
    return _chat(usages[-1])


def completions_json(client: openai.OpenAI, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    answer = client.completions.create(model=model, max_tokens=2, prompt=prompt, extra_headers={"x-request-id": rid})
    assert answer.usage is not None
    return _chat(answer.usage)


def completions_sse(client: openai.OpenAI, model: str, prompt: str, rid: str) -> tuple[int, int, int | None]:
    chunks = client.completions.create(model=model, max_tokens=2, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, extra_headers={"x-request-id": rid})
    [usage] = [chunk.usage for chunk in chunks if chunk.usage is not None]
    return _chat(usage)


def _chat(usage: Any) -> tuple[int, int, int | None]:
    """The writes as the official SDK reads them (OpenAI's ``cache_write_tokens``), which vLLM's
    own clients read under vLLM's name, ``created_cache_tokens``: the same figure."""
    details = usage.prompt_tokens_details
    assert details.cache_write_tokens == details.model_dump().get("created_cache_tokens")
    return usage.prompt_tokens, details.cached_tokens, details.cache_write_tokens


ALL_PATHS: dict[str, tuple[str, apis.Ask]] = {
    **apis.PATHS, "chat-json": ("chat", chat_json), "chat-sse": ("chat", chat_sse),
    "chat-continuous": ("chat", lambda *ask: chat_sse(*ask, continuous=True)),
    "completions-json": ("completions", completions_json), "completions-sse": ("completions", completions_sse),
}


@pytest.mark.parametrize("path", [*apis.PATHS, "chat-json", "chat-sse", "completions-json", "completions-sse"])
def test_upstream_cache_writes_reach_the_record_and_the_counter(
    upstream_pair: tuple[str, str], usage_dir: Path, path: str
) -> None:
    """The upstream's own count of the prompt tokens it wrote to its cache, which the client
    reads (a vLLM upstream's ``created_cache_tokens`` also under OpenAI's name), is the
    record's ``cache_creation_tokens`` and moves the write counter. vLLM's completions route
    reports none: unknown, and nothing counted."""
    _, front = upstream_pair
    route, ask = ALL_PATHS[path]
    if path == "messages-sse":  # in front of vLLM the figures come with message_delta only
        ask = functools.partial(apis.messages_sse, start_known=False)
    prompt = fresh_prompt()
    size = prompt_size(prompt, route)
    rid = uuid.uuid4().hex
    before = httpx.get(f"{front}/metrics").text
    with sdk(front, route) as client:
        cold = ask(client, MODEL, prompt, rid)
    assert cold == (size, 0, None if route == "completions" else (size // BLOCK) * BLOCK)
    after = httpx.get(f"{front}/metrics").text
    written = metric_value(after, "cachetally_cache_write_tokens_total", source="upstream") - metric_value(
        before, "cachetally_cache_write_tokens_total", source="upstream")
    assert written == (cold[2] or 0)
    [record] = records_for(usage_dir, {rid})[rid]
    assert record["source"] == "upstream"
    assert (record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) == cold


# Anthropic's own stream: the prompt's figures in message_start, output_tokens only in the
# final message_delta (https://docs.anthropic.com/en/docs/build-with-claude/streaming).
ANTHROPIC_EVENTS = [
    {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 50,
                  "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
     "usage": {"output_tokens": 5}},
    {"type": "message_stop"},
]


async def anthropic_stream(request: Request) -> Response:
    await request.body()
    body = b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in ANTHROPIC_EVENTS)
    return Response(body, media_type="text/event-stream")


@pytest.mark.parametrize("missing", ["zero", "omit"])
def test_an_upstream_message_delta_without_cache_figures_keeps_those_of_message_start(
    usage_dir: Path, missing: str
) -> None:
    upstream_app = Starlette(routes=[Route("/v1/messages", anthropic_stream, methods=["POST"])])
    rid = uuid.uuid4().hex
    with serving_in_thread(upstream_app, "anthropic") as upstream:
        args = billed_front(upstream, usage_dir, "--missing", missing)
        with running_server(args) as (front, _), sdk(front, "messages") as client:
            assert isinstance(client, anthropic.Anthropic)
            with client.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                        extra_headers={"x-request-id": rid}) as stream:
                [delta] = [event for event in stream if event.type == "message_delta"]
                usage = stream.get_final_message().usage
            metrics = httpx.get(f"{front}/metrics").text
    assert delta.usage.cache_read_input_tokens is None  # as the upstream wrote it
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.output_tokens) \
        == (10, 50, 0, 5)
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["source"], record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) \
        == ("upstream", 60, 50, 0)
    assert metric_value(metrics, "cachetally_requests_total", cache="hit") == 1
    assert metric_value(metrics, "cachetally_cached_tokens_total", source="upstream", tier="all") == 50


@pytest.mark.parametrize("missing", ["zero", "omit"])
@pytest.mark.parametrize("figures", [{"input_tokens": 10}, {"cache_read_input_tokens": 50},
                                     {"input_tokens": 10, "cache_read_input_tokens": None}], ids=["input", "reads", "null"])
def test_a_message_delta_with_some_input_figures_keeps_the_others_of_message_start(
    usage_dir: Path, missing: str, figures: dict[str, Any]
) -> None:
    """A ``message_delta``'s figures are cumulative and each is optional: the ``anthropic`` SDK
    keeps ``message_start``'s value for one the delta omits or sends as ``null``. The client
    and the record see the reads ``message_start`` reported, never a 0 put in their place."""
    events = [*ANTHROPIC_EVENTS[:-2], {**ANTHROPIC_EVENTS[-2], "usage": {**figures, "output_tokens": 5}},
              ANTHROPIC_EVENTS[-1]]

    async def stream(request: Request) -> Response:
        await request.body()
        body = b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in events)
        return Response(body, media_type="text/event-stream")

    rid = uuid.uuid4().hex
    with serving_in_thread(Starlette(routes=[Route("/v1/messages", stream, methods=["POST"])]), "partial") as upstream:
        args = billed_front(upstream, usage_dir, "--missing", missing)
        with running_server(args) as (front, _), sdk(front, "messages") as client:
            assert isinstance(client, anthropic.Anthropic)
            with client.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                        extra_headers={"x-request-id": rid}) as answer:
                usage = answer.get_final_message().usage
            metrics = httpx.get(f"{front}/metrics").text
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.output_tokens) \
        == (10, 50, 0, 5)
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["source"], record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) \
        == ("upstream", 60, 50, 0)
    assert metric_value(metrics, "cachetally_cached_tokens_total", source="upstream", tier="all") == 50


@pytest.mark.asyncio
@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_cut_stream_counts_only_its_token_events(api: str) -> None:
    """A stream cut before its final usage is billed for the tokens it delivered: in these
    shapes the framing events (``message_start``, ``response.created``, ...) are no tokens."""
    from engine_adapter.sim import apis as sim_apis
    from proxy.accounting.records.notes import RequestNotes

    req = sim_apis.ApiRequest(api, MODEL, list(range(40)), 7, True, True)
    stream = sim_apis.messages_stream if api == "messages" else sim_apis.responses_stream

    async def step() -> None:
        return None

    events = [event async for event in stream(req, "x", (0, 32), step)]
    cut = events[:5]  # a few tokens in, long before the final usage
    notes = RequestNotes(api)
    for event in cut:
        notes.sse_events(event)
    delivered = sum(b"delta" in event.split(b"\n", 1)[0] and b"text" in event for event in cut)
    assert notes.completion(stream=True) == (delivered, "stream")
    assert 0 < delivered < 7


async def lifespan(receive: Any, send: Any) -> None:
    """The lifespan of a bare ASGI upstream under a uvicorn with lifespan on: nothing to do."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def dies_mid_messages_stream(scope: Any, receive: Any, send: Any) -> None:
    """An upstream that starts Anthropic's stream and dies in it (uvicorn drops the connection)."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for e in ANTHROPIC_EVENTS[:3]:
        body = b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e))
        await send({"type": "http.response.body", "body": body, "more_body": True})
    raise RuntimeError("the upstream dies mid-stream")


def test_a_messages_stream_whose_upstream_dies_raises_in_the_anthropic_sdk_and_is_an_error(usage_dir: Path) -> None:
    """The SDK reads only named events: the relay's error event must be ``event: error``, or
    a cut stream reads as a whole one (no exception, ``stop_reason`` None)."""
    rid = uuid.uuid4().hex
    with serving_in_thread(dies_mid_messages_stream, "dies") as upstream:
        args = billed_front(upstream, usage_dir, "--model", MODEL, "--log-level", "critical")
        with running_server(args) as (front, _), sdk(front, "messages") as client:
            assert isinstance(client, anthropic.Anthropic)
            with pytest.raises(anthropic.APIStatusError, match="Upstream server unreachable"), client.messages.stream(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-request-id": rid},
            ) as stream:
                stream.get_final_message()
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["outcome"], record["completion_tokens"]) == ("error", 1)


#: A Responses stream's ``response`` object as its first events carry it.
RESPONSE_HEAD = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "status": "in_progress",
                 "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": None}


def responses_upstream(metadata: str, last: str) -> Any:
    """An upstream Responses stream that echoes the request's ``metadata`` in its events, as
    vLLM does, and sends its last event (``last``) in 256 KiB parts, as TCP may hand it over."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        while (await receive()).get("more_body"):
            pass
        head = {**RESPONSE_HEAD, "metadata": {"k": metadata}}
        usage = {"input_tokens": 500, "input_tokens_details": {"cached_tokens": 448},
                 "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 501}
        text = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "a", "annotations": []}]}
        final = {**head, "status": last.removeprefix("response."), "usage": usage, "output": [text]}

        def event(kind: str, fields: dict[str, Any]) -> bytes:
            return b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind, **fields}))

        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for part in (event("response.created", {"response": head, "sequence_number": 0}),
                     event("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "content_index": 0,
                                                          "delta": "a", "logprobs": [], "sequence_number": 1})):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        end = event(last, {"response": final, "sequence_number": 2})
        for at in range(0, len(end), 256 << 10):
            await send({"type": "http.response.body", "body": end[at:at + (256 << 10)], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("size", [10, 3_000_000], ids=["small", "3MB"])
def test_a_responses_stream_whose_final_event_echoes_megabytes_is_still_billed(usage_dir: Path, size: int) -> None:
    """A client cannot hide its prompt by making the final event large: vLLM echoes the
    request's ``metadata`` (and ``instructions``, ``tools``) in it, and a long output with
    logprobs grows it too. It is held as a JSON body would be, then patched and read."""
    rid = uuid.uuid4().hex
    with serving_in_thread(responses_upstream("x" * size, "response.completed"), "big") as upstream:
        args = billed_front(upstream, usage_dir, "--model", MODEL)
        with running_server(args) as (front, _), sdk(front, "responses") as client:
            assert isinstance(client, openai.OpenAI)
            events = list(client.responses.create(model=MODEL, input="hi", stream=True,
                                                  extra_headers={"x-request-id": rid}))
            final = events[-1].response
            assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 448
            metrics = httpx.get(f"{front}/metrics").text
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) \
        == ("completed", 500, 448, 1)
    assert metric_value(metrics, "cachetally_prompt_tokens_total") == 500


def test_a_responses_stream_that_ends_failed_is_an_error(usage_dir: Path) -> None:
    """``response.failed`` is the Responses API's own end of a failed response: the server
    side failed, so the record says ``error``, with the figures its usage gives."""
    rid = uuid.uuid4().hex
    with serving_in_thread(responses_upstream("x", "response.failed"), "failed") as upstream:
        args = billed_front(upstream, usage_dir, "--model", MODEL)
        with running_server(args) as (front, _):
            httpx.post(f"{front}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True},
                       headers={"x-request-id": rid}).raise_for_status()
    [record] = records_for(usage_dir, {rid})[rid]
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"]) == ("error", 500, 448)


def unnamed_responses_upstream(last: str | None) -> Any:
    """A Responses stream without ``event:`` lines, as LiteLLM's proxy sends it: the ``openai``
    SDK reads each event by its data's ``type``. It ends with ``last``, or, without one, waits
    for its client to leave. It has no other route (no ``/tokenize``: LiteLLM's has none)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/v1/responses":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        head = RESPONSE_HEAD
        events = [{"type": "response.created", "response": head}] + [
            {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "delta": "a", "logprobs": []} for _ in range(3)]
        if last is not None:
            usage = {"input_tokens": 500, "input_tokens_details": {"cached_tokens": 448}, "output_tokens": 3,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 503}
            events.append({"type": last, "response": {**head, "status": "failed", "usage": usage}})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for number, event in enumerate(events):
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + orjson.dumps({**event, "sequence_number": number}) + b"\n\n"})
        if last is None:
            while (await receive())["type"] != "http.disconnect":
                pass
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("last", ["response.failed", None], ids=["failed", "client-left"])
def test_a_responses_stream_without_event_names_is_recorded_as_the_openai_sdk_reads_it(
    usage_dir: Path, last: str | None
) -> None:
    """The SDK reads a Responses event by its data's ``type``: a stream without ``event:``
    lines fails on ``response.failed``, and one its client leaves delivered its deltas."""
    rid = uuid.uuid4().hex
    with serving_in_thread(unnamed_responses_upstream(last), "unnamed") as upstream:
        args = billed_front(upstream, usage_dir, "--model", MODEL)
        with running_server(args) as (front, _), sdk(front, "responses") as client:
            assert isinstance(client, openai.OpenAI)
            with client.responses.create(model=MODEL, input="hi", stream=True,
                                         extra_headers={"x-request-id": rid}) as stream:
                seen = [event.type for _, event in zip(range(4 if last is None else 5), stream, strict=False)]
    assert seen[1:4] == ["response.output_text.delta"] * 3
    [record] = records_for(usage_dir, {rid})[rid]
    if last is None:
        assert (record["outcome"], record["completion_tokens"], record["completion_source"], record["prompt_tokens"]) == (
            "disconnected", 3, "stream", None)  # its prompt: no usage came, and nothing counts it
    else:
        assert seen[-1] == last
        assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"]) == ("error", 500, 448)
