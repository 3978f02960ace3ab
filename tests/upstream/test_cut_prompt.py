"""Upstream mode: a stream whose client hangs up before the usage chunk is billed its prompt,
as the upstream's own ``/tokenize`` counts it (:mod:`proxy.upstream.prompt_count`).

A client that reads the tokens it wants and leaves just before the final usage chunk had
its completion tokens billed and its prompt, the expensive prefill, not. cachetally runs in
a real uvicorn in front of the sim (a subprocess) or of a Starlette upstream whose
``/tokenize`` fails each way; the client is the official ``openai`` SDK, which closes the
stream after the chunks it read; what is checked is the usage record and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
from openai.types.chat import ChatCompletionChunk
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_adapter.sim.tokenizer import render_chat, tokenize
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from proxy.upstream.prompt_count import truncated
from proxy.upstream.responses_prompt import chat_ask
from proxy.upstream.reused_prompt import reused
from tests.servers import metric_value, running_server, serving_in_thread

pytestmark = pytest.mark.loopback

SIM = ["-m", "engine_adapter.sim", "--log-level", "warning", "--model", "m", "--token-delay-s", "0.02"]
COUNTS = "cachetally_upstream_prompt_counts_total"
LONG = " ".join(f"word{i}" for i in range(400))
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": LONG}]
OTHER = " ".join(f"other{i}" for i in range(150))


def records(directory: Path, expected: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The records written, once ``expected`` are (or the time is up), and a moment more for
    any written twice."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [orjson.loads(line) for path in sorted(directory.glob("*.jsonl"))
                 for line in path.read_bytes().splitlines()]
        if len(found) >= expected or time.monotonic() > deadline:
            time.sleep(0.3)
            return [orjson.loads(line) for path in sorted(directory.glob("*.jsonl"))
                    for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    """One sim for the module: each test has its own cachetally, records and counters in front
    of it, and the sim's counts depend on the prompt alone."""
    with running_server(SIM, timeout_s=20) as (url, _):
        yield url


@contextlib.contextmanager
def cachetally(upstream: str, usage_dir: Path, **overrides: Any) -> Iterator[tuple[str, CachetallyApp]]:
    settings = Settings(engine="upstream", upstream=upstream, model="m", usage_dir=str(usage_dir),
                        usage_flush_interval_s=0.05, **overrides).validate()
    app = CachetallyApp(settings)
    with serving_in_thread(app, "cachetally") as url:
        yield url, app


def counted(url: str, result: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=5).text, COUNTS, result=result)


def asks(url: str) -> float:
    """The asks of ``/tokenize`` counted, whatever their result."""
    return sum(counted(url, result) for result in ("counted", "busy", "failed", "uncountable"))


def hang_up(client: openai.OpenAI, route: str, prompt: Any, chunks: int = 3, **extra: Any) -> str:
    """Stream 500 tokens at most, read ``chunks`` chunks (Responses: text deltas), close: what
    the client read."""
    if route == "chat":
        stream: Any = client.chat.completions.create(model="m", messages=prompt, max_tokens=500, stream=True, **extra)
    elif route == "responses":
        stream = client.responses.create(model="m", input=prompt, max_output_tokens=500, stream=True, **extra)
    else:
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=500, stream=True, **extra)
    read = []
    for chunk in stream:
        if route != "responses" or chunk.type == "response.output_text.delta":
            read.append(chunk)
        if len(read) == chunks:
            break
    stream.close()
    if route == "responses":
        return "".join(event.delta for event in read)
    return "".join((c.choices[0].delta.content or "") if route == "chat" else c.choices[0].text
                   for c in read if c.choices)


#: Responses input items as vLLM renders them: messages of string and input_text content.
ITEMS = [{"role": "developer", "content": "You are terse."}, {"type": "message", "role": "user", "content": [
    {"type": "input_text", "text": LONG}, {"type": "input_text", "text": OTHER}]}]


@pytest.mark.parametrize(("route", "prompt", "extra", "expected"), [
    ("chat", MESSAGES, {}, len(tokenize(render_chat(MESSAGES)))),
    ("completions", LONG, {}, len(tokenize(LONG))),
    ("completions", [LONG], {}, len(tokenize(LONG))),  # one prompt in a list
    ("completions", list(range(1, 301)), {}, 300),  # token ids: counted without asking
    # several prompts: asked one by one and summed, as vLLM's usage sums them
    ("completions", [LONG, OTHER], {}, len(tokenize(LONG)) + len(tokenize(OTHER))),
    ("completions", [list(range(1, 51)), list(range(1, 31))], {}, 80),
    # Responses: the chat its route renders, instructions first as a system message
    ("responses", LONG, {}, len(tokenize(render_chat([{"role": "user", "content": LONG}])))),
    ("responses", LONG, {"instructions": "You are terse."}, len(tokenize(render_chat(MESSAGES)))),
    ("responses", ITEMS, {}, len(tokenize(render_chat([ITEMS[0], {"role": "user", "content": f"{LONG}\n{OTHER}"}])))),
], ids=["chat", "completions", "one-in-a-list", "token-ids", "two-prompts", "two-of-token-ids",
        "responses", "responses-instructions", "responses-items"])
def test_a_stream_cut_before_its_usage_chunk_is_billed_the_prompt_the_upstream_counts(
        sim: str, tmp_path: Path, route: str, prompt: Any, extra: dict[str, Any], expected: int) -> None:
    """In front of the sim: the record bills the prompt the sim's usage would have reported
    (the sim's ``/tokenize`` counts as its routes do), its cache unknown, never 0; the
    counters count the request as one whose cache is unknown."""
    with cachetally(sim, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        assert hang_up(client, route, prompt, **extra)  # it read tokens, then left
        (record,) = records(tmp_path, 1)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert (record["outcome"], record["status"], record["route"]) == ("disconnected", 200, route)
    assert (record["prompt_tokens"], record["cached_tokens"], record["source"]) == (expected, None, "tokenize")
    assert 0 < record["completion_tokens"] < 500
    assert metric_value(metrics, COUNTS, result="counted") == 1
    # Counted as the record says: a request whose cache is unknown, out of the token counters.
    assert metric_value(metrics, "cachetally_requests_total", cache="unknown") == 1


TOOL = {"type": "function", "function": {"name": "f", "description": LONG, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("route", "prompt", "extra"), [
    ("completions", LONG, {"suffix": "end"}),  # rendered for fill-in-the-middle
    ("completions", LONG, {"extra_body": {"prompt_embeds": "AAAA"}}),  # one more prompt, of embeddings
    # Responses: a tool field vLLM's types may drop or keep (none it knows), an earlier
    # response (history read from vLLM's store), an item other than a plain message (status
    # in_progress: continued)
    ("responses", LONG, {"tools": [{"type": "function", "name": "f", "x": 1}]}),
    ("responses", LONG, {"previous_response_id": "resp_1"}),
    ("responses", [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Sure",
                                                          "status": "in_progress"}], {}),
], ids=["suffix", "prompt-embeds", "responses-tools", "responses-previous", "responses-continued"])
def test_a_prompt_no_ask_counts_exactly_is_left_unknown_and_counted(
        sim: str, tmp_path: Path, route: str, prompt: Any, extra: dict[str, Any]) -> None:
    """Never a guess: a cut stream whose prompt ``/tokenize`` cannot count as the route does
    keeps its prompt unknown, as before, and is counted ``uncountable``."""
    with cachetally(sim, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        assert hang_up(client, route, prompt, **extra)
        (record,) = records(tmp_path, 1)
        uncountable = counted(url, "uncountable")
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"]) == ("disconnected", None, None)
    assert uncountable == 1


def test_a_stream_read_whole_is_billed_its_usage_not_a_count(sim: str, tmp_path: Path) -> None:
    """The ask is made for cut streams only: a stream read to its end is billed the usage
    chunk (the sim reports no cache: ``source`` unknown), and ``/tokenize`` is not asked."""
    with cachetally(sim, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, stream=True))  # type: ignore[arg-type]
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == (
        "completed", len(tokenize(render_chat(MESSAGES))), None)


# -- an upstream whose /tokenize fails -------------------------------------------------------


#: The stub upstreams' stream: 50 tokens 20 ms apart, time for a client to read 3 and leave.
TOKENS = 50


class Upstream:
    """A chat (or completions) stream of :data:`TOKENS` slow tokens and its usage chunk, and a
    ``/tokenize`` that answers as ``mode`` says: ``count`` 42 (to the upstream's key alone if
    ``key``; ``slow``: after 0.2 s), none (404), a 500, a count that is no integer, or never.
    ``late_s``: the stream answered that late;
    ``end``: what the tokens end with: the usage chunk, nothing (an upstream that sends none) or
    vLLM's error event; ``done_s``: how long after it ``[DONE]`` comes."""

    def __init__(self, mode: str, key: str | None = None, late_s: float = 0.0, end: str = "usage",
                 done_s: float = 0.0) -> None:
        self.mode, self.key, self.late_s, self.end, self.done_s = mode, key, late_s, end, done_s
        self.asked = threading.Event()
        self.asked_bodies: list[dict[str, Any]] = []
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.chat, methods=["POST"]),
                  Route("/invocations", self.chat, methods=["POST"]),  # SageMaker's: a chat body here
                  Route("/v1/messages", self.messages, methods=["POST"])]
        if mode != "missing":
            routes.append(Route("/tokenize", self.tokenize, methods=["POST"]))
        self.app = Starlette(routes=routes)

    @staticmethod
    def reported_prompt(body: bytes) -> int:
        """The prompt its usage chunk reports for ``body``."""
        return 42

    async def chat(self, request: Request) -> Response:
        body = await request.body()
        prompt = self.reported_prompt(body)
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        choice = {"index": 0, "delta": {"content": "tok"}, "finish_reason": None}
        if request.url.path == "/v1/completions":
            head, choice = {**head, "object": "text_completion"}, {"index": 0, "text": "tok", "finish_reason": None}
        await asyncio.sleep(self.late_s)
        if not orjson.loads(body).get("stream"):
            return self.answer(prompt)

        async def events() -> AsyncIterator[bytes]:
            for _ in range(TOKENS):
                chunk = {**head, "choices": [choice]}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                await asyncio.sleep(0.02)
            if self.end == "usage":
                usage = {"prompt_tokens": prompt, "completion_tokens": TOKENS, "total_tokens": prompt + TOKENS}
                yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            elif self.end == "error":
                error = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
                yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
            await asyncio.sleep(self.done_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def answer(self, prompt: int) -> Response:
        """A chat answer not streamed, its JSON cut in two :attr:`done_s` apart."""
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
        answer = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "tok"}, "finish_reason": "stop"}], "usage": usage})

        async def halves() -> AsyncIterator[bytes]:
            yield answer[:20]
            await asyncio.sleep(self.done_s)
            yield answer[20:]

        return StreamingResponse(halves(), media_type="application/json")

    async def messages(self, request: Request) -> Response:
        """A Messages stream started (200) whose ``message_start``, which carries the prompt as
        vLLM's does, comes :attr:`done_s` later."""
        start = {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 42, "output_tokens": 0}}}

        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(self.done_s)
            yield b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(self, request: Request) -> Response:
        self.asked_bodies.append(orjson.loads(await request.body()))
        self.asked.set()
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"error": {"message": "Unauthorized"}}, 401)
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "slow":
            await asyncio.sleep(0.2)
        if self.mode == "error":
            return JSONResponse({"error": {"message": "boom", "code": 500}}, 500)
        # A template that renders tools makes them part of the prompt: 100 tokens more.
        rendered = 42 + 100 * ("tools" in self.asked_bodies[-1])
        count: Any = {"not-a-count": "42", "a-float": 42.0}.get(self.mode, rendered)
        return JSONResponse({"count": count, "max_model_len": 4096, "tokens": [1] * 42})


@pytest.mark.parametrize("mode", ["missing", "hang", "error", "not-a-count", "a-float"])
def test_an_upstream_whose_tokenize_fails_leaves_the_prompt_unknown_and_one_record(tmp_path: Path, mode: str) -> None:
    upstream = Upstream(mode)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        app.engine.prompts.timeout_s = 0.5  # type: ignore[attr-defined]
        assert hang_up(client, "chat", MESSAGES)
        (record,) = records(tmp_path, 1)
        failed = counted(url, "failed")
        # No crash: the next request is served and billed.
        assert len(list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))) == TOKENS  # type: ignore[arg-type]
        assert [r["prompt_tokens"] for r in records(tmp_path, 2)] == [None, 42]
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["source"]) == (
        "disconnected", None, None, None)
    assert record["completion_tokens"] > 0
    assert failed == 1  # where an operator sees it


def test_past_the_cap_a_cut_stream_is_left_unknown_and_counted_busy(tmp_path: Path) -> None:
    """A flood of hang-ups asks the upstream no more than the cap at once: one ask in flight
    (a ``/tokenize`` that never answers), the next cut stream is not asked about."""
    upstream = Upstream("hang")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        app.engine.prompts.max_asking, app.engine.prompts.timeout_s = 1, 3.0  # type: ignore[attr-defined]
        hang_up(client, "chat", MESSAGES)
        assert upstream.asked.wait(5)
        hang_up(client, "chat", MESSAGES)
        found = records(tmp_path, 2)
        assert (counted(url, "busy"), counted(url, "failed")) == (1, 1)
    assert len(upstream.asked_bodies) == 1
    assert [(r["outcome"], r["prompt_tokens"], r["cached_tokens"]) for r in found] == [
        ("disconnected", None, None)] * 2


def test_a_cut_stream_of_one_prompt_sent_many_times_is_billed_every_copy_with_one_ask(tmp_path: Path) -> None:
    """A completions stream of the same prompt 100 times, cut before its usage: vLLM runs (and
    its usage counts) every copy. Each prompt was asked in turn within the count's 5 s, so a
    client that repeated its prompt enough kept all of them off the bill (``null``; here 100
    asks of 0.2 s). Each distinct prompt is asked once."""
    upstream = Upstream("slow")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        assert hang_up(client, "completions", ["Say hi.", *["Repeat me."] * 99]) == "tok" * 3
        (record,) = records(tmp_path, 1, timeout_s=15)
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == ("disconnected", 100 * 42, "tokenize")
    assert sorted(body["prompt"] for body in upstream.asked_bodies) == ["Repeat me.", "Say hi."]


@pytest.mark.parametrize("keyed", [False, True], ids=["clients-key", "upstreams-key"])
def test_the_ask_carries_the_credentials_the_request_was_forwarded_with(tmp_path: Path, keyed: bool) -> None:
    """The client's own key, or, behind cachetally's keys, the upstream's (``--upstream-api-key``):
    as the request itself went. The ask is the chat's prompt fields, as vLLM's
    ``TokenizeChatRequest`` takes them."""
    overrides: dict[str, Any] = {}
    if keyed:
        keys = tmp_path / "keys.toml"
        keys.write_text('"sk-tenant-acme-0123456789" = "acme"\n')
        keys.chmod(0o600)
        overrides = {"api_keys_file": str(keys), "upstream_api_key": "sk-upstream-0123456789"}
    upstream = Upstream("count", key="sk-upstream-0123456789" if keyed else "sk-tenant-acme-0123456789")
    usage = tmp_path / "usage"
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, usage, **overrides) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-tenant-acme-0123456789", max_retries=0,
                          timeout=10) as client:
        hang_up(client, "chat", MESSAGES)
        (record,) = records(usage, 1)
    assert (record["prompt_tokens"], record["source"]) == (42, "tokenize")
    assert upstream.asked_bodies == [{"model": "m", "messages": MESSAGES}]


def test_a_stream_read_whole_without_a_usage_chunk_is_not_asked_about(tmp_path: Path) -> None:
    """Only a stream whose client left is asked about: one read to its end from an upstream
    that sends no usage chunk keeps its prompt unknown, its completion counted from the stream."""
    upstream = Upstream("count", end="none")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert len(chunks) == TOKENS
    assert (record["outcome"], record["prompt_tokens"], record["completion_tokens"], record["source"]) == (
        "completed", None, TOKENS, None)
    assert upstream.asked_bodies == []


def test_a_client_that_leaves_before_the_upstream_answers_is_not_asked_about(tmp_path: Path) -> None:
    """The ask is for a stream the upstream started (200): a client that gives up before the
    upstream answered at all leaves its prompt unknown, and ``/tokenize`` is not asked."""
    upstream = Upstream("count", late_s=2.0)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=0.5) as client:
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == ("disconnected", None, None)
    assert upstream.asked_bodies == []


def test_a_client_that_leaves_after_the_usage_chunk_is_billed_it_and_not_asked_about(tmp_path: Path) -> None:
    """A client that asked for usage, read it and left before ``[DONE]`` is billed the usage
    its upstream reported, and ``/tokenize`` is not asked."""
    upstream = Upstream("count", done_s=5.0)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True})
        usage = next(chunk.usage for chunk in stream if chunk.usage is not None)
        stream.close()
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert usage.prompt_tokens == 42
    assert (record["outcome"], record["prompt_tokens"], record["completion_tokens"], record["source"]) == (
        "disconnected", 42, TOKENS, None)
    assert upstream.asked_bodies == []


def test_a_client_that_leaves_after_an_error_event_is_recorded_an_error_and_not_asked_about(tmp_path: Path) -> None:
    """A stream the upstream ended with an error event failed: its client leaving before
    ``[DONE]`` makes it no cut stream, and ``/tokenize`` is not asked."""
    upstream = Upstream("count", end="error", done_s=5.0)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), httpx.Client(timeout=10) as client:
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert any(line.startswith('data: {"error"') for line in lines)
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"], record["completion_tokens"]) == ("error", None, TOKENS)
    assert upstream.asked_bodies == []


def test_a_client_that_leaves_an_answer_not_streamed_is_not_asked_about(tmp_path: Path) -> None:
    """The ask is for streams: a client that leaves while the upstream's answer not streamed
    is still coming (its usage in the part not sent) leaves the prompt unknown, nothing asked."""
    upstream = Upstream("count", done_s=5.0)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1) as client:
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == ("disconnected", None, None)
    assert upstream.asked_bodies == []


def test_a_cut_decode_leg_bills_its_handed_prefill_and_is_not_asked_about(tmp_path: Path) -> None:
    """A P/D decode leg (``pd_legs`` on) whose client left before its usage chunk bills the
    figures its prefill leg handed over, cache reads included; ``/tokenize`` is not asked."""
    upstream = Upstream("count")
    handed = {"prompt_tokens": 300, "cached_tokens": 100, "source": "upstream"}
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path, pd_legs=True) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        hang_up(client, "chat", MESSAGES,
                extra_body={"kv_transfer_params": {"do_remote_prefill": True, "cachetally_prefill": handed}})
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["source"]) == (
        "disconnected", 300, 100, "upstream")
    assert upstream.asked_bodies == []


def test_a_messages_stream_cut_before_its_message_start_is_not_asked_about(tmp_path: Path) -> None:
    """A Messages stream needs no ask (its ``message_start`` carries the prompt): one whose
    client leaves before it leaves the prompt unknown, and ``/tokenize`` is not asked."""
    upstream = Upstream("count", done_s=5.0)
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), httpx.Client(timeout=0.5) as client:
        body = {"model": "m", "max_tokens": 50, "messages": MESSAGES[1:], "stream": True}
        with pytest.raises(httpx.ReadTimeout), client.stream("POST", f"{url}/v1/messages", json=body) as response:
            response.read()
        (record,) = records(tmp_path, 1)
        assert asks(url) == 0
    assert (record["outcome"], record["prompt_tokens"]) == ("disconnected", None)
    assert upstream.asked_bodies == []


@pytest.mark.parametrize("excluded", [False, True], ids=["vllms-default", "exclude-tools-when-tool-choice-none"])
def test_tools_beside_tool_choice_none_are_counted_as_the_upstream_renders_them(tmp_path: Path, excluded: bool) -> None:
    """A client that adds a tool it never lets be called (``tool_choice`` ``"none"``, the one
    choice a vLLM without a tool parser takes beside tools) is billed the prompt as its upstream
    renders it: with the tools by vLLM's default, without them where the upstream runs
    ``--exclude-tools-when-tool-choice-none`` and cachetally is told so. It was left unknown."""
    upstream = Upstream("count")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path, exclude_tools_when_tool_choice_none=excluded) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        hang_up(client, "chat", MESSAGES, tools=[TOOL], tool_choice="none")
        (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["source"]) == (
        "disconnected", 42 if excluded else 142, None, "tokenize")
    assert [("tools" in asked, asked.get("tool_choice")) for asked in upstream.asked_bodies] == [(not excluded, None)]


def test_a_cut_stream_whose_tool_schema_nests_1000_levels_is_billed_its_count(tmp_path: Path) -> None:
    """A tool's JSON schema nested 1,000 levels, which orjson reads and the upstream's parser
    too. Written back by the standard library past orjson's 254 levels, from the depth of the
    server's stack, it raised RecursionError: the body rewritten to ask for the usage chunk
    failed the request with a 500, and then the ``/tokenize`` ask failed, leaving the cut
    stream's prompt unbilled. The body is built as text: the client's own encoder stops at
    that depth."""
    upstream = Upstream("count")
    deep = "[" * 1000 + "]" * 1000
    body = ('{"model":"m","stream":true,"max_tokens":500,"messages":' + orjson.dumps(MESSAGES).decode()
            + ',"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","x":' + deep
            + '}}}],"tool_choice":"none"}').encode()
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app):
        with httpx.stream("POST", f"{url}/v1/chat/completions", content=body, timeout=10,
                          headers={"content-type": "application/json"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # it read a token, then left
        (record,) = records(tmp_path, 1)
        assert counted(url, "counted") == 1
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == ("disconnected", 142, "tokenize")


def test_a_graceful_stop_during_the_ask_writes_the_record_once_with_the_prompt_unknown(tmp_path: Path) -> None:
    """SIGTERM while the upstream's ``/tokenize`` is asked about a cut stream (it never
    answers): the stop ends the ask, and the record is written once, before the recorder's
    final drain, as the client left it (``disconnected``, not the stop's ``error``: no one was
    there to tell), its prompt unknown; no traceback, no prompt text in the log."""
    upstream = Upstream("hang")
    usage, log = tmp_path / "usage", tmp_path / "serve.log"
    secret = f"a secret prompt {LONG}"
    with serving_in_thread(upstream.app, "upstream") as upstream_url, running_server(
            ["-m", "proxy.server.cli", "serve", "--upstream", upstream_url, "--usage-dir", str(usage),
             "--usage-flush-interval", "0.05"], env={"CACHETALLY_SHUTDOWN_TIMEOUT_S": "0.3"},
            log_path=log) as (url, proc):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
            assert hang_up(client, "chat", [{"role": "user", "content": secret}])
        assert upstream.asked.wait(5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    found = records(usage, 1, timeout_s=0)
    assert [(r["outcome"], r["prompt_tokens"], r["cached_tokens"]) for r in found] == [("disconnected", None, None)]
    text = log.read_text()
    assert "Traceback" not in text and "dropped" not in text and "secret" not in text, text[-3000:]


class ReusingUpstream(Upstream):
    """vLLM 0.32's chat route with ``kv_transfer_params.prompt_token_ids`` (a P/D decode side's
    reuse, renderers/online_renderer.py ``_reused_prompt_token_ids``): those ids are the prompt,
    the messages not rendered; its usage reports their count. Its ``/tokenize`` counts the
    messages (42)."""

    @staticmethod
    def reported_prompt(body: bytes) -> int:
        ids = orjson.loads(body).get("kv_transfer_params", {}).get("prompt_token_ids")
        return len(ids) if ids else 42


REUSED = list(range(1, 3001))


@pytest.mark.parametrize(("extra", "pd_legs", "expected", "asked"), [
    ({}, True, 3000, False),
    ({"truncate_prompt_tokens": 50}, True, 3000, False),  # vLLM runs the ids as they are
    ({"echo": "yes"}, True, 42, True),  # an echo renders the messages: vLLM ignores the ids
    ({}, False, 42, True),  # the ids never reach the upstream: the messages are its prompt
], ids=["reused", "reused-truncation-not-applied", "echo-renders-the-messages", "without-pd-legs-dropped"])
def test_a_cut_stream_whose_prompt_is_reused_token_ids_is_billed_their_number(
        tmp_path: Path, extra: dict[str, Any], pd_legs: bool, expected: int, asked: bool) -> None:
    """With ``pd_legs`` on, a client's ``kv_transfer_params`` reach the upstream; one that is no
    leg but carries ``prompt_token_ids`` has vLLM run those ids and not render the messages. A
    client sent 3000 ids beside a short message and hung up: the first version billed the 42 that
    ``/tokenize`` counted for the messages, the next left the prompt unknown (``null``). It is
    billed the 3000 ids, unasked; where vLLM renders the messages instead (``echo``), theirs.
    Without ``pd_legs`` cachetally drops the client's ``kv_transfer_params``: its ids, whatever
    their number, bill nothing, and the messages the upstream ran are billed."""
    upstream = ReusingUpstream("count")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path, pd_legs=pd_legs) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        hang_up(client, "chat", [{"role": "user", "content": "hi"}],
                extra_body={"kv_transfer_params": {"prompt_token_ids": REUSED}, **extra})
        (record,) = records(tmp_path, 1)
        results = {result: counted(url, result) for result in ("counted", "uncountable")}
    assert (record["outcome"], record["prompt_tokens"], record["cached_tokens"], record["source"]) == (
        "disconnected", expected, None, "tokenize")
    assert results == {"counted": 1, "uncountable": 0}
    assert bool(upstream.asked_bodies) == asked


_PART = st.fixed_dictionaries(
    {}, optional={"type": st.sampled_from(["text", "input_text", "refusal", "thinking", "image_url", "input_image",
                                           "video", "file"]) | st.integers(0, 1),
                  "text": st.just("hi"), "refusal": st.just("no"), "thinking": st.just("hm"),
                  "image_url": st.just({"url": "data:image/png;base64,AA=="}), "input_image": st.just("x")})
_CONTENT = st.just("hi") | st.lists(_PART | st.just("hi"), min_size=1, max_size=3)
_IDS = (st.none() | st.lists(st.integers(0, 31), min_size=1, max_size=3)
        | st.lists(st.integers(-1, 40) | st.booleans() | st.just(2.0), max_size=3) | st.just("12"))


@pytest.mark.vllm
@settings(max_examples=400, deadline=None)
@given(role=st.sampled_from(["user", "assistant", "system"]), content=_CONTENT, ids=_IDS,
       echo=st.sampled_from([None, True, False, "yes", "off", 1, 0, "maybe"]), truncate=st.none() | st.just(1))
def test_a_chats_reused_ids_are_its_prompt_where_the_installed_vllm_runs_them(
        role: str, content: Any, ids: Any, echo: Any, truncate: int | None) -> None:
    """A chat body's ``kv_transfer_params.prompt_token_ids`` are billed as its prompt, their number,
    exactly where the installed vLLM's chat route runs them (its model's validators, then
    ``_reused_prompt_token_ids``); where it renders the messages, they are asked as before."""
    with warnings.catch_warnings():  # torch, imported by vLLM, deprecates its own torch.jit
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMClientError
        from vllm.renderers.online_renderer import _reused_prompt_token_ids

    payload: dict[str, Any] = {"model": "m", "messages": [{"role": role, "content": content}],
                               "kv_transfer_params": {} if ids is None else {"prompt_token_ids": ids}}
    payload |= {key: value for key, value in (("echo", echo), ("truncate_prompt_tokens", truncate)) if value is not None}
    ours = reused("chat", copy.deepcopy(payload))
    try:
        request = ChatCompletionRequest.model_validate(payload)  # its validators pop ids beside media
        vllms = _reused_prompt_token_ids(request, _Vocabulary(), request.messages)
    except (ValidationError, VLLMClientError):
        return  # answered 400: no stream to cut
    assert ours == ((False, None) if vllms is None else (True, len(vllms)))


#: A conversation sent back as Responses input items: messages, an assistant's as written or
#: as a response's output item (a refusal first, which vLLM fails to read), function calls
#: (with an id, status or namespace or not) and custom tools' calls, their outputs (text, or
#: parts), reasoning items. ``x``, an output with a part other than text, and a custom call's
#: output of parts are what the prompt is left unknown for.
_STATUS = st.none() | st.sampled_from(["in_progress", "completed", "incomplete"])
_OUTPUT_TEXT = {"type": "output_text", "text": "ok", "annotations": []}
_ITEMS = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                           "content": st.sampled_from(["hi", [{"type": "input_text", "text": "hi"}]])},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.sampled_from(
        ["ok", "", [_OUTPUT_TEXT], [_OUTPUT_TEXT, {**_OUTPUT_TEXT, "text": "more"}], [{"type": "input_text", "text": "ok"}],
         [{"type": "refusal", "refusal": "no"}]])},
        optional={"type": st.just("message"), "id": st.just("msg_1"), "status": _STATUS}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.sampled_from(["c1", "c2"]),
                           "name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(["{}", '{"a": 1}'])},
                          optional={"id": st.just("fc_1"), "status": _STATUS, "namespace": st.sampled_from(["ns", ""]),
                                    "x": st.just(1)}),
    st.fixed_dictionaries({"type": st.just("custom_tool_call"), "call_id": st.sampled_from(["c1", "c2"]),
                           "name": st.sampled_from(["f", "g"]), "input": st.sampled_from(["", "print('é')", 'a"\\\n'])},
                          optional={"id": st.just("ctc_1"), "namespace": st.just("ns"), "x": st.just(1)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
                           "call_id": st.sampled_from(["c1", "c2"]),
                           "output": st.sampled_from(["sunny", [{"type": "input_text", "text": "sunny"}],
                                                      [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                                                      [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]])},
                          optional={"id": st.just("fco_1"), "x": st.just(1)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c1"), "output": st.just("sunny"),
                           "status": _STATUS}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.sampled_from(
        [[], [{"type": "summary_text", "text": "sum"}]])},
        optional={"id": st.just("rs_1"), "status": _STATUS, "encrypted_content": st.sampled_from([None, "", "xyz"]),
                  "content": st.sampled_from([None, [], [{"type": "reasoning_text", "text": "think"}],
                                              [{"type": "reasoning_text", "text": "a"},
                                               {"type": "reasoning_text", "text": "b"}]])}),
)


@pytest.mark.vllm
@settings(max_examples=300, deadline=None)
@given(given_input=st.just("hi") | st.lists(st.fixed_dictionaries(
           {"role": st.sampled_from(["user", "system"]),
            "content": st.just("hi") | st.lists(st.sampled_from([{"type": "input_text", "text": "hi"},
                                                                  {"type": "input_image", "image_url": "x"}]),
                                                min_size=1, max_size=2)},
           optional={"type": st.just("message")}), min_size=1, max_size=2) | st.lists(_ITEMS, min_size=1, max_size=3),
       ids=_IDS, instructions=st.none() | st.just("Be brief."))
def test_a_responses_bodys_reused_ids_are_its_prompt_where_the_installed_vllm_runs_them(
        given_input: Any, ids: Any, instructions: str | None) -> None:
    """A Responses body's reused ids are billed their number where the installed vLLM's route
    runs them over the messages it makes of the input (``construct_input_messages``), never the
    messages' count; an input that may render them instead leaves the prompt unknown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_input_messages
        from vllm.exceptions import VLLMClientError
        from vllm.renderers.online_renderer import _reused_prompt_token_ids

    payload: dict[str, Any] = {"model": "m", "input": given_input,
                               "kv_transfer_params": {} if ids is None else {"prompt_token_ids": ids}}
    if instructions is not None:
        payload["instructions"] = instructions
    ours = reused("responses", copy.deepcopy(payload))
    try:
        request = ResponsesRequest.model_validate(payload)
        messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
        vllms = _reused_prompt_token_ids(request, _Vocabulary(), messages)
    except (ValidationError, VLLMClientError, AttributeError):  # AttributeError: a refusal read as text, a 500
        return
    if ours == (False, None):  # its messages are asked
        assert vllms is None
    elif ours[1] is not None:
        assert vllms is not None and ours[1] == len(vllms)
    if isinstance(given_input, str):
        assert ours == ((False, None) if vllms is None else (True, len(vllms)))


class _Vocabulary:
    """A renderer's token-id check, over a vocabulary of 32 ids."""

    @staticmethod
    def validate_token_ids(ids: list[int], parameter: str) -> None:
        from vllm.exceptions import VLLMValidationError
        if any(one >= 32 for one in ids):
            raise VLLMValidationError("out of vocabulary", parameter=parameter)


@pytest.mark.parametrize(("keep", "expected"), [("4000", 42), (4000.0, 42), ("30", 30), (True, 1), ("+00030", 30)],
                         ids=["string", "integral-float", "string-that-cuts", "true", "signed-string"])
def test_a_truncation_vllm_reads_as_an_integer_is_applied_not_left_unknown(
        tmp_path: Path, keep: Any, expected: int) -> None:
    """vLLM's pydantic reads ``truncate_prompt_tokens`` laxly ("4000", 4000.0 and ``true`` are
    4000, 4000 and 1 to it) and streams the request; a client that sent its truncation so kept
    its cut stream's prompt off the bill (``null``). It is read as vLLM reads it."""
    upstream = Upstream("count")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        hang_up(client, "chat", MESSAGES, extra_body={"truncate_prompt_tokens": keep})
        (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["prompt_tokens"], record["source"]) == ("disconnected", expected, "tokenize")


_VLLM_TRUNCATION = TypeAdapter(Annotated[int, Field(ge=-1, le=(1 << 63) - 1)] | None)  # vLLM 0.32's field


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.booleans(), st.integers(), st.floats(), st.from_regex(r"\A[ +\-0-9._e]{0,8}\Z"), st.text(max_size=6)))
def test_a_truncation_is_read_as_vllms_pydantic_reads_it_or_left_unknown(value: Any) -> None:
    """Every value read as a truncation is the one vLLM's model reads, where it takes it at all."""
    try:
        vllms = _VLLM_TRUNCATION.validate_python(value)
    except ValidationError:
        return  # answered 400: no stream to cut
    assert truncated(1 << 20, {"truncate_prompt_tokens": value}, None) in (None, min(1 << 20, vllms))


@pytest.mark.parametrize(("extra", "expected"), [({}, 42), ({"prompt": LONG, "logprobs": 3}, None)],
                         ids=["chat", "chat-or-completions"])
def test_a_cut_invocations_stream_is_billed_the_prompt_the_upstream_counts(
        tmp_path: Path, extra: dict[str, Any], expected: int | None) -> None:
    """SageMaker's ``/invocations`` runs a chat body as the chat route does, streamed too; a
    client that sent its chat there and hung up before the usage chunk was billed no prompt
    (``null``), the hole the chat route no longer has. It is counted as the chat's. A body
    with a prompt beside its messages may run as either (vLLM runs it as completions where
    the chat model refuses a field, ``logprobs`` 3): left unknown, never asked."""
    upstream = Upstream("count")
    with serving_in_thread(upstream.app, "upstream") as upstream_url, \
            cachetally(upstream_url, tmp_path) as (url, _app), \
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10) as client:
        stream = client.post("/invocations", body={"model": "m", "messages": MESSAGES, "stream": True, **extra},
                             cast_to=ChatCompletionChunk, stream=True, stream_cls=openai.Stream[ChatCompletionChunk])
        for read, _chunk in enumerate(stream, 1):
            if read == 3:
                break
        stream.close()
        (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["route"], record["prompt_tokens"], record["source"]) == (
        "disconnected", "invocations", expected, "tokenize" if expected else None)
    assert upstream.asked_bodies == ([{"model": "m", "messages": MESSAGES}] if expected else [])


_FUNCTION_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "name": st.text(max_size=3)},
    optional={"description": st.none() | st.text(max_size=3), "strict": st.none() | st.booleans(),
              "parameters": st.none() | st.just({"type": "object", "properties": {"a": {"type": "string"}}}),
              "defer_loading": st.none() | st.booleans(), "x": st.just(1)})  # x: no field vLLM knows
_CUSTOM_TOOL = st.fixed_dictionaries(
    {"type": st.just("custom"), "name": st.text(max_size=3)},
    optional={"description": st.none() | st.text(max_size=3), "format": st.sampled_from(
        [{"type": "text"}, {"type": "grammar", "syntax": "lark", "definition": "start: 'a'"}])})
_TOOL = st.one_of(
    _FUNCTION_TOOL, _CUSTOM_TOOL,
    st.fixed_dictionaries({"type": st.just("namespace"), "name": st.text(max_size=3),
                           "tools": st.lists(_FUNCTION_TOOL | _CUSTOM_TOOL, min_size=1, max_size=2)},
                          optional={"description": st.text(max_size=3)}),
    st.sampled_from([{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                     {"type": "code_interpreter", "container": "auto"}, {"type": "image_generation"},
                     {"type": "local_shell"}, {"type": "tool_search"}]))


@pytest.mark.vllm
@settings(max_examples=300, deadline=None)
@given(tools=st.none() | st.lists(_TOOL, max_size=3), choice=st.sampled_from([None, "auto", "none", "required"]),
       excluded=st.booleans())
def test_a_responses_bodys_tools_are_asked_as_the_installed_vllm_renders_them(
        tools: list[dict[str, Any]] | None, choice: str | None, excluded: bool) -> None:
    """What ``/tokenize`` is asked for a Responses body's tools (functions, custom tools,
    namespaces, built-in tools), read by the installed vLLM's ``TokenizeChatRequest``, is the
    tools its Responses route renders (``construct_tool_dicts``, under
    ``--exclude-tools-when-tool-choice-none`` or not); a field it may render otherwise leaves
    the prompt unknown."""
    with warnings.catch_warnings():  # torch, imported by vLLM, deprecates its own torch.jit
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_tool_dicts
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest
        from vllm.exceptions import VLLMClientError

    payload: dict[str, Any] = {"model": "m", "input": "hi"}
    payload |= {key: value for key, value in (("tools", tools), ("tool_choice", choice)) if value is not None}
    try:
        request = ResponsesRequest.model_validate(payload)
    except (ValidationError, VLLMClientError):
        return  # answered 400: no stream to cut
    rendered = construct_tool_dicts(request.tools, request.tool_choice, exclude_tools_when_tool_choice_none=excluded)
    asked = chat_ask(payload, excluded)
    odd = any("x" in one for tool in tools or [] for one in [tool, *tool.get("tools", [])])
    assert (asked is not None) == (not odd or rendered is None)  # no tool rendered: nothing to render otherwise
    if asked is not None:
        read = TokenizeChatRequest.model_validate(asked)
        assert (None if read.tools is None else [tool.model_dump() for tool in read.tools]) == rendered


def _as_chat_reads(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat renderer reads them: a message item's ``type`` is not read, and
    ``input_text`` is text."""
    def part(one: Any) -> Any:
        return {**one, "type": "text"} if isinstance(one, dict) and one.get("type") == "input_text" else one

    return [{key: [part(p) for p in value] if key == "content" and isinstance(value, list) else value
             for key, value in message.items() if key != "type"} for message in messages]


@pytest.mark.vllm
@settings(max_examples=400, deadline=None)
@given(items=st.lists(_ITEMS, min_size=1, max_size=6), instructions=st.none() | st.just("Be brief."))
@example(items=[{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [
    {"type": "summary_text", "text": "sum"}], "content": [{"type": "reasoning_text", "text": "think"}]}], instructions=None)
def test_a_responses_bodys_tool_calls_and_outputs_are_asked_as_the_installed_vllm_renders_them(
        items: list[dict[str, Any]], instructions: str | None) -> None:
    """A conversation comes back as input items: an agent's loop sends its function calls and
    their outputs, a client its last response's output (an assistant's message, reasoning).
    vLLM renders them as the chat's messages, tool calls (merged into the assistant message
    before them) and tool messages. What ``/tokenize`` is asked, read by the installed vLLM's
    ``TokenizeChatRequest``, is the chat its Responses route makes of them
    (``construct_input_messages``); a field it may read otherwise, or a last message it
    continues (``should_continue_final_message``), leaves the prompt unknown. Such a cut
    stream was left unbilled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_input_messages, should_continue_final_message
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest
        from vllm.exceptions import VLLMClientError

    payload: dict[str, Any] = {"model": "m", "input": items}
    if instructions is not None:
        payload["instructions"] = instructions
    asked = chat_ask(copy.deepcopy(payload))
    refusal = {"type": "refusal", "refusal": "no"}  # vLLM fails on it, or renders the item as it is
    odd = any("x" in item or (isinstance(item.get("output"), list) and (item["type"] == "custom_tool_call_output" or any(
                  part["type"] != "input_text" for part in item["output"])))
              or (item.get("content") or [None])[:1] == [refusal]
              # an output item's fields beside text: pydantic may take it for one, whose content is parts
              or (item.get("role") == "assistant" and isinstance(item["content"], str) and item.keys() & {"id", "status"})
              for item in items)
    try:
        request = ResponsesRequest.model_validate(payload)
        rendered = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    except (ValidationError, VLLMClientError, AttributeError):
        return  # answered 400 (AttributeError: a 500, a refusal read as text): no stream to cut
    assert (asked is not None) == (not odd and not should_continue_final_message(request.input))
    if asked is not None:
        read = TokenizeChatRequest.model_validate(asked).model_dump(exclude_unset=True)["messages"]
        assert _as_chat_reads(read) == _as_chat_reads(rendered)
