"""Upstream mode in front of servers whose answers are not stock vLLM's: what the client,
the usage record, the counters and the OTLP collector get from each.

The upstream is a Starlette app on 127.0.0.1 answering the bytes a test names (the request's
first message picks them); cachetally runs in a real uvicorn; the client is the official
``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.server.app import CachetallyApp
from proxy.server.cli import main
from proxy.server.settings import Settings
from tests.otlp_receiver import otlp_receiver
from tests.servers import metric_value, serving_in_thread

pytestmark = pytest.mark.loopback

#: A count past int64 (an OTLP integer attribute), and past what orjson writes (u64).
PAST_INT64, PAST_U64 = 1 << 63, 10**23
MAX_INT64 = PAST_INT64 - 1
FAIR = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}}


def dumps(value: Any) -> bytes:
    """JSON as Python writes it: integers of any size (orjson stops at 64 bits)."""
    return json.dumps(value, separators=(",", ":")).encode()


def completion(usage: dict[str, Any]) -> bytes:
    return dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": usage,
    })


def stream(usage: dict[str, Any]) -> bytes:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**head, "choices": [], "usage": usage},
    ]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def huge(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "completion_tokens": n, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": n}}


def llama_cpp_stream() -> bytes:
    """llama.cpp server's stream (b6097): the usage and timings ride on the finishing chunk,
    whose delta is empty; no usage-only chunk, whatever ``stream_options`` asked."""
    head = {"created": 1, "id": "chatcmpl-1", "model": "m", "system_fingerprint": "b6097-9515c613",
            "object": "chat.completion.chunk"}
    chunks = [
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}], **head},
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hel"}}], **head},
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "lo"}}], **head},
        {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], **head,
         "usage": {"completion_tokens": 2, "prompt_tokens": 10, "total_tokens": 12},
         "timings": {"cache_n": 6, "prompt_n": 4, "prompt_ms": 2.1, "predicted_n": 2, "predicted_ms": 9.5}},
    ]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def per_choice_usage_stream() -> bytes:
    """Two choices, each chunk with its own choice's usage (vLLM's continuous usage), cut
    before the usage-only chunk: no chunk covers the whole request."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [{**head, "choices": [{"index": i % 2, "delta": {"content": text}, "finish_reason": None}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 1 + i // 2, "total_tokens": 11 + i // 2}}
              for i, text in enumerate(["a", "b", "c", "d"])]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def per_prompt_usage_stream() -> bytes:
    """vLLM's completions stream for two prompts (``prompt`` and ``prompt_embeds``), one choice
    each, each chunk with its own choice's usage (continuous usage), cut before the usage-only
    chunk."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    chunks = [{**head, "choices": [{"index": i % 2, "text": text, "logprobs": None, "finish_reason": None}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 1 + i // 2, "total_tokens": 11 + i // 2}}
              for i, text in enumerate(["a", "b", "c", "d"])]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def ollama_stream() -> bytes:
    """Ollama's OpenAI endpoint: every chunk's delta names the role, its token beside it; here
    without a usage chunk (a client that left before it gets none either)."""
    head = {"id": "chatcmpl-86", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "system_fingerprint": "fp_ollama"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}
              for text in ["Hel", "lo", " there"]]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def failing_stream() -> bytes:
    """vLLM's shape of a chat stream that fails after a token: an error object as an event, then ``[DONE]``."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    token = {**head, "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
    error = {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}
    return b"data: " + dumps(token) + b"\n\ndata: " + dumps(error) + b"\n\ndata: [DONE]\n\n"


def obfuscated_stream(options: dict[str, Any]) -> bytes:
    """OpenAI's stream: an ``obfuscation`` field on each chunk unless ``stream_options`` turns
    it off with ``include_obfuscation: false``, and the usage chunk when it asks for one."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks: list[dict[str, Any]] = [{**head, "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]},
                                    {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    if options.get("include_usage"):
        chunks.append({**head, "choices": [], "usage": FAIR})
    if options.get("include_obfuscation", True):
        chunks = [{**chunk, "obfuscation": "kD3h"} for chunk in chunks]
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


ANSWERS: dict[str, Callable[[bool], bytes]] = {
    "error-event": lambda streamed: failing_stream(),
    "no-usage": lambda streamed: completion({}).replace(b',"usage":{}', b""),
    "ollama": lambda streamed: ollama_stream(),
    "error-200": lambda streamed: dumps({"error": {"message": "model overloaded", "type": "server_error", "code": 503}}),
    "per-choice": lambda streamed: per_choice_usage_stream(),
    "llama.cpp": lambda streamed: llama_cpp_stream(),
    "fair": lambda streamed: (stream if streamed else completion)(FAIR),
    **{f"writes-{name}": (lambda details: lambda streamed: (stream if streamed else completion)(
        {**FAIR, "prompt_tokens_details": {"cached_tokens": 4, **details}}))(details)
       for name, details in (("openai", {"cache_write_tokens": 5}), ("vllm", {"created_cache_tokens": 5}),
                             ("both", {"cache_write_tokens": 5, "created_cache_tokens": 6}),
                             ("past-the-prompt", {"cache_write_tokens": 7}))},
    "past-int64": lambda streamed: (stream if streamed else completion)(huge(PAST_INT64)),
    "past-u64": lambda streamed: (stream if streamed else completion)(huge(PAST_U64)),
}


async def answer(request: Request) -> Response:
    body = await request.json()
    streamed = bool(body.get("stream"))
    case = body["messages"][0]["content"]
    if case == "obfuscated":
        return StreamingResponse(iter([obfuscated_stream(body.get("stream_options") or {})]),
                                 media_type="text/event-stream")
    if case == "slow-end":
        return StreamingResponse(ended_late(), media_type="text/event-stream")
    if case == "slow-end-no-usage":
        return StreamingResponse(ended_late(with_usage=False), media_type="text/event-stream")
    media_type = "text/event-stream" if streamed else "application/json"
    if case == "gzipped":  # whatever Accept-Encoding said
        return Response(gzip.compress(ANSWERS["fair"](streamed)), media_type=media_type,
                        headers={"content-encoding": "gzip"})
    return Response(ANSWERS[case](streamed), media_type=media_type)


def message(usage: dict[str, Any]) -> bytes:
    return dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                  "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn",
                  "stop_sequence": None, "usage": usage})


async def answer_message(request: Request) -> Response:
    body = await request.json()
    fair = {"input_tokens": 4, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 2, "output_tokens": 3}
    usage = fair if body["messages"][0]["content"] == "fair" else {
        "input_tokens": MAX_INT64, "cache_read_input_tokens": MAX_INT64, "cache_creation_input_tokens": MAX_INT64,
        "output_tokens": 3}
    return Response(message(usage), media_type="application/json")


def two_prompts_answer(streamed: bool) -> bytes:
    """vLLM 0.32's completions for two prompts with ``--enable-prompt-tokens-details`` (its
    bytes, trimmed): ``cached_tokens`` is one prompt's reads, not their sum: the last
    prompt's in JSON, the first to answer's in a stream; ``created_cache_tokens`` null or
    absent."""
    head = {"id": "cmpl-b6c0", "object": "text_completion", "created": 1, "model": "m"}
    usage = {"prompt_tokens": 184, "total_tokens": 186, "completion_tokens": 2}
    choices = [{"index": i, "text": "a", "logprobs": None, "finish_reason": "length", "stop_reason": None}
               for i in range(2)]
    if not streamed:
        details = {"cached_tokens": 128, "created_cache_tokens": None, "multimodal_tokens": None}
        return dumps({**head, "choices": choices, "system_fingerprint": "vllm-0.32.0",
                      "usage": {**usage, "prompt_tokens_details": details, "completion_tokens_details": None}})
    chunks = [{**head, "choices": [choice]} for choice in choices]
    chunks.append({**head, "choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 128}},
                   "system_fingerprint": "vllm-0.32.0"})
    return b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def answer_completion(request: Request) -> Response:
    body = await request.json()
    if isinstance(body.get("prompt"), list) or ("prompt_embeds" in body and not body.get("stream")):
        streamed = bool(body.get("stream"))
        return Response(two_prompts_answer(streamed), media_type="text/event-stream" if streamed else "application/json")
    return Response(per_prompt_usage_stream(), media_type="text/event-stream")


async def ended_late(with_usage: bool = True) -> AsyncIterator[bytes]:
    """A whole stream, ``[DONE]`` and all, whose HTTP body ends a moment later (a server that
    cleans up after its last event, or a busy one). cachetally asks every stream for usage;
    ``with_usage`` false: a server that sends none all the same."""
    events = [event + b"\n\n" for event in stream(FAIR).split(b"\n\n") if event]
    yield b"".join(event for event in events if with_usage or b'"choices":[]' not in event)
    await asyncio.sleep(0.5)


@contextlib.contextmanager
def proxied(tmp_path: Path, **overrides: Any) -> Iterator[tuple[openai.OpenAI, CachetallyApp]]:
    upstream = Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"]),
                                  Route("/v1/completions", answer_completion, methods=["POST"]),
                                  Route("/v1/messages", answer_message, methods=["POST"])])
    with serving_in_thread(upstream, "upstream") as upstream_url:
        settings = Settings(engine="upstream", upstream=upstream_url, model="m", usage_dir=str(tmp_path),
                            usage_flush_interval_s=0.05, **overrides).validate()
        app = CachetallyApp(settings)
        with serving_in_thread(app, "cachetally") as url, openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10
        ) as client:
            yield client, app


def ask(client: openai.OpenAI, case: str, streamed: bool) -> tuple[str, Any]:
    """The text and the usage the client got."""
    messages = [{"role": "user", "content": case}]
    if not streamed:
        response = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        return response.choices[0].message.content or "", response.usage
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.usage for c in chunks if c.usage is not None)


def records(directory: Path, expected: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [orjson.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_bytes().splitlines()]
        if len(found) >= expected or time.monotonic() > deadline:
            return found


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("case", "seen", "recorded"), [
    ("writes-openai", (5, 5), 5),
    ("writes-vllm", (5, 5), 5),
    ("writes-both", (5, 5), 5),  # they disagree: OpenAI's name wins, as its cached_tokens wins
    ("writes-past-the-prompt", (7, None), None),  # 4 reads + 7 writes > 10: as it came, and unknown
], ids=["openai", "vllm", "both", "past-the-prompt"])
def test_an_upstreams_cache_writes_under_either_name_reach_the_client_under_both_and_the_record(
        tmp_path: Path, case: str, seen: tuple[int, int | None], recorded: int | None, streamed: bool) -> None:
    """Cache writes under OpenAI's name (``cache_write_tokens``, what the ``openai`` SDK reads)
    or vLLM's (``created_cache_tokens``): the client reads the believed figure under both, and
    the record keeps it."""
    with proxied(tmp_path) as (client, app):
        _, usage = ask(client, case, streamed)
    details = usage.prompt_tokens_details
    assert (details.cache_write_tokens, details.model_dump().get("created_cache_tokens")) == seen
    (record,) = records(tmp_path, 1)
    metrics = app.metrics.exposition().decode()  # counted before its record was handed over
    assert (record["source"], record["cached_tokens"], record["cache_creation_tokens"]) == ("upstream", 4, recorded)
    assert metric_value(metrics, "cachetally_cache_write_tokens_total", source="upstream") == (recorded or 0)


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", ["past-int64", "past-u64"])
def test_figures_no_record_can_hold_are_unknown_and_lose_no_record(tmp_path: Path, case: str, streamed: bool) -> None:
    """An upstream reporting token counts past 64 bits: the client gets its answer, and the
    request, and the fair one beside it, each leave one record, in the file and at the
    collector; the bill takes none of the hostile figures (unknown, never 2**63 or 10**23)."""
    with otlp_receiver() as collector:
        with proxied(tmp_path, otlp_endpoint=collector.url) as (client, app):
            text, usage = ask(client, case, streamed)
            assert text == "Hello"
            assert usage.prompt_tokens_details.cached_tokens == 0  # the missing policy: zero
            assert ask(client, "fair", streamed)[1].prompt_tokens_details.cached_tokens == 4
        spans = collector.snapshot()
    hostile, fair = records(tmp_path, 2)
    metrics = app.metrics.exposition().decode()  # counted before its record was handed over
    assert (fair["prompt_tokens"], fair["cached_tokens"], fair["completion_tokens"]) == (10, 4, 3)
    assert (hostile["prompt_tokens"], hostile["cached_tokens"], hostile["source"]) == (None, None, None)
    assert hostile["completion_tokens"] < 1 << 63
    assert hostile["completion_source"] == ("stream" if streamed else "unknown")
    assert sorted(span.attributes["cachetally.record_id"] for span in spans) == sorted(
        r["record_id"] for r in (hostile, fair))
    assert metric_value(metrics, "cachetally_cached_tokens_total", tier="all") == 4
    assert metric_value(metrics, "cachetally_prompt_tokens_total") == 10


def test_a_messages_prompt_whose_three_parts_add_up_past_int64_is_unknown_and_loses_no_record(tmp_path: Path) -> None:
    """Anthropic's prompt is the sum of three figures: each one a record can hold, their sum
    past 2**63 - 1 is no count of the prompt, and the request and the fair one beside it each
    leave one record, in the file and at the collector."""
    with otlp_receiver() as collector:
        with proxied(tmp_path, otlp_endpoint=collector.url) as (openai_client, _), anthropic.Anthropic(
                base_url=str(openai_client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0,
                timeout=10) as client:
            for case in ("hostile", "fair"):
                answer = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": case}])
                assert answer.content[0].text == "Hello"  # type: ignore[union-attr]
        spans = collector.snapshot()
    hostile, fair = records(tmp_path, 2)
    assert (fair["prompt_tokens"], fair["cached_tokens"], fair["cache_creation_tokens"]) == (10, 4, 2)
    assert (hostile["prompt_tokens"], hostile["cached_tokens"], hostile["source"]) == (None, None, None)
    assert sorted(span.attributes["cachetally.record_id"] for span in spans) == sorted(
        r["record_id"] for r in (hostile, fair))


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_an_answer_encoded_against_the_request_is_delivered_and_its_tokens_are_unknown(
        tmp_path: Path, streamed: bool) -> None:
    """cachetally asks for ``Accept-Encoding: identity``; an upstream that gzips anyway goes
    out as it came, unread: the client decodes it, and the record says its tokens are
    unknown, never that it delivered none."""
    with proxied(tmp_path) as (client, app):
        text, usage = ask(client, "gzipped", streamed)
        assert (text, usage.prompt_tokens_details.cached_tokens) == ("Hello", 4)  # the upstream's own
        metrics = app.metrics.exposition().decode()
    (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["completion_tokens"], record["completion_source"]) == ("completed", 0, "unknown")
    assert (record["prompt_tokens"], record["cached_tokens"]) == (None, None)
    assert metric_value(metrics, "cachetally_patch_skipped_total", reason="encoded") == 1


def test_the_bill_says_how_many_answers_went_out_with_their_tokens_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Such an answer's record bills 0 tokens, prompt and completion; ``cachetally report``
    showed one request that cost nothing, and said nothing of it."""
    with proxied(tmp_path) as (client, _):
        assert ask(client, "gzipped", False)[0] == "Hello"
        assert ask(client, "fair", False)[0] == "Hello"
        records(tmp_path, 2)
    (tmp_path / "prices.toml").write_text("[default]\ninput = 1\ncached_input = 0.1\noutput = 2\n")
    assert main(["report", str(tmp_path), "--prices", str(tmp_path / "prices.toml"), "--json"]) == 0
    out, err = capsys.readouterr()
    bill = json.loads(out)
    assert (bill["total"]["requests"], bill["total"]["completion_tokens"], bill["unknown_completions"]) == (2, 3, 1)
    assert "1 record(s) went out with their completion tokens unknown" in err


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_the_client_read_to_its_done_is_completed_though_it_hangs_up_before_the_body_ends(
        tmp_path: Path, include_usage: bool) -> None:
    """The ``openai`` SDK closes its connection at ``[DONE]``; an upstream that ends its HTTP
    body a moment later must not make the record of a stream the client got whole say it
    left early."""
    with proxied(tmp_path) as (client, _):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "slow-end"}], stream=True, **options))  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
        assert [c.usage.prompt_tokens_details.cached_tokens for c in chunks if c.usage] == ([4] if include_usage else [])
        (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["status"]) == ("completed", 200)
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == (10, 4, 3)


def test_a_client_that_leaves_while_the_done_is_held_is_disconnected(tmp_path: Path) -> None:
    """An upstream that sends no usage chunk though cachetally asked for one: the finishing
    chunk and ``[DONE]`` wait for it, held until the body ends. A client that leaves after its
    text and before that never got ``[DONE]``: its stream was not whole."""
    with proxied(tmp_path) as (client, _):
        body = {"model": "m", "messages": [{"role": "user", "content": "slow-end-no-usage"}], "stream": True}
        with httpx.Client(base_url=str(client.base_url), timeout=10) as http, \
                http.stream("POST", "chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert '"Hello"' in next(line for line in lines if line.startswith("data: {"))
        (record,) = records(tmp_path, 1)
    assert record["outcome"] == "disconnected"


@pytest.mark.parametrize("n", [None, 1], ids=["no-n", "n-1"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_llama_cpp_stream_is_billed_the_tokens_its_final_chunk_reports(
    tmp_path: Path, include_usage: bool, n: int | None
) -> None:
    """llama.cpp reports usage on its finishing chunk, an event with an empty delta: the
    record takes the completion tokens it reports (2), not its events (3, the finishing one
    too), and the cached tokens of ``timings.cache_n``. An explicit ``n`` of 1 (many clients
    send it) is one choice too."""
    with proxied(tmp_path) as (client, app):
        options: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
        if n is not None:
            options["n"] = n
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "llama.cpp"}], stream=True, **options))  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
        # llama.cpp sends it unasked too; the client gets what it sends, the standard field added
        assert [(c.usage.completion_tokens, c.usage.prompt_tokens_details.cached_tokens) for c in chunks if c.usage] == [
            (2, 6)]
        (record,) = records(tmp_path, 1)
        metrics = app.metrics.exposition().decode()
    assert (record["completion_tokens"], record["completion_source"]) == (2, "usage")
    assert (record["prompt_tokens"], record["cached_tokens"], record["source"]) == (10, 6, "upstream")
    assert metric_value(metrics, "cachetally_completion_tokens_total") == 2


def test_a_choices_own_usage_is_not_taken_for_the_requests_when_several_stream(tmp_path: Path) -> None:
    """With ``n`` 2, a chunk's usage counts its choice alone: the record counts the four
    token events, not the last chunk's 2."""
    with proxied(tmp_path) as (client, _):
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "per-choice"}], n=2, stream=True))
        assert sorted(c.choices[0].delta.content for c in chunks) == ["a", "b", "c", "d"]
        (record,) = records(tmp_path, 1)
    assert (record["completion_tokens"], record["completion_source"]) == (4, "stream")


def test_a_prompts_own_usage_is_not_taken_for_the_requests_when_prompt_embeds_add_a_prompt(tmp_path: Path) -> None:
    """vLLM's completions run ``prompt_embeds`` as prompts of their own, before ``prompt``'s:
    with ``n`` 1, a ``prompt`` and an embedding two choices stream, and a chunk's usage counts
    its own choice. The record counts the four token events, not the last chunk's 2."""
    with proxied(tmp_path) as (client, _):
        chunks = list(client.completions.create(
            model="m", prompt="two prompts", n=1, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"prompt_embeds": "UEsDBAAAAAAAAA=="}))
        assert sorted(c.choices[0].text for c in chunks) == ["a", "b", "c", "d"]
        (record,) = records(tmp_path, 1)
    assert (record["completion_tokens"], record["completion_source"]) == (4, "stream")


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_an_upstreams_one_figure_for_several_prompts_is_unknown_not_billed(tmp_path: Path, streamed: bool) -> None:
    """vLLM reports one prompt's cache reads for a completions request of several (its JSON
    the last prompt's, its stream the first to answer's): no upstream's figure there is
    taken for the request's. The client gets the ``missing`` policy's 0, the record says
    unknown, and no reads are counted."""
    with proxied(tmp_path) as (client, app):
        if streamed:
            chunks = list(client.completions.create(model="m", prompt=["cold", "warm"], stream=True,
                                                    stream_options={"include_usage": True}))
            usage = next(c.usage for c in chunks if c.usage is not None)
        else:
            usage = client.completions.create(model="m", prompt=["cold", "warm"]).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (184, 0)
    (record,) = records(tmp_path, 1)
    metrics = app.metrics.exposition().decode()  # counted before its record was handed over
    assert (record["prompt_tokens"], record["cached_tokens"], record["cache_creation_tokens"]) == (184, None, None)
    assert record["source"] is None
    assert metric_value(metrics, "cachetally_requests_total", cache="unknown") == 1
    assert metric_value(metrics, "cachetally_cached_tokens_total") == 0


@pytest.mark.parametrize(("extra", "several"), [
    ({"prompt_embeds": "AAAA"}, False),
    ({"prompt_embeds": ["AAAA"]}, False),
    ({"prompt_embeds": ["AAAA", "BBBB"]}, True),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, True),
], ids=["one-embedding", "a-list-of-one", "two-embeddings", "a-prompt-and-an-embedding"])
def test_an_upstreams_figure_is_the_requests_only_where_prompt_embeds_make_one_prompt(
    tmp_path: Path, extra: dict[str, Any], several: bool
) -> None:
    """vLLM's completions run each of ``prompt_embeds`` (one, or a list) as a prompt of its
    own, then ``prompt``'s: the upstream's cache figure is billed for one prompt, and left
    unknown for several (one prompt's reads, not the request's)."""
    with proxied(tmp_path) as (client, _), httpx.Client(base_url=str(client.base_url), timeout=10) as http:
        http.post("completions", json={"model": "m", "max_tokens": 2, **extra}).raise_for_status()
        (record,) = records(tmp_path, 1)
    expected = (184, None, None) if several else (184, 128, "upstream")
    assert (record["prompt_tokens"], record["cached_tokens"], record["source"]) == expected


def test_a_200_whose_body_is_an_error_is_recorded_as_an_error(tmp_path: Path) -> None:
    """Some servers and gateways answer a failure with a 200 and an error object: the client
    gets it as it came, and the record says the request failed, with no tokens, as it says
    of a stream that carried an error event."""
    with proxied(tmp_path) as (client, _):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "error-200"}])
        assert raw.http_response.json() == {"error": {"message": "model overloaded", "type": "server_error", "code": 503}}
        (record,) = records(tmp_path, 1)
    assert (record["status"], record["outcome"]) == (200, "error")
    assert (record["completion_tokens"], record["completion_source"], record["prompt_tokens"]) == (0, "none", None)


@pytest.mark.parametrize(("case", "streamed", "counted"), [
    ("error-200", False, 0), ("error-event", True, 0), ("no-usage", False, 1), ("ollama", True, 1)])
def test_the_records_tell_which_requests_the_counter_counts(
        tmp_path: Path, case: str, streamed: bool, counted: int) -> None:
    """docs/ACCOUNTING.md: ``cachetally_requests_total`` leaves out exactly the records with
    ``prompt_tokens`` null whose outcome is not ``completed``. A 200 whose body is an error
    object and a stream that ended in an error event went out whole, and were counted
    (``cache="unknown"``) though their records said they failed."""
    with proxied(tmp_path) as (client, app):
        body = {"model": "m", "messages": [{"role": "user", "content": case}], "stream": streamed}
        with httpx.Client(base_url=str(client.base_url), timeout=10) as http:
            assert http.post("chat/completions", json=body).status_code == 200
        (record,) = records(tmp_path, 1)
        metrics = app.metrics.exposition().decode()
    assert record["prompt_tokens"] is None
    assert (record["outcome"] == "completed") == bool(counted)
    assert metric_value(metrics, "cachetally_requests_total") == counted
    assert metric_value(metrics, "cachetally_completion_tokens_total") == record["completion_tokens"]


def test_a_stream_whose_every_chunk_names_the_role_is_billed_its_tokens(tmp_path: Path) -> None:
    """Ollama names the role in every chunk: only the events that carry a role and no content
    open a stream, so its three tokens are billed three, not 0."""
    with proxied(tmp_path) as (client, _):
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "ollama"}], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there"
        (record,) = records(tmp_path, 1)
    assert (record["completion_tokens"], record["completion_source"]) == (3, "stream")


def test_a_json_answer_without_usage_has_unknown_tokens_not_none(tmp_path: Path) -> None:
    """A server that sends no usage with its answer delivered tokens nobody counted: the
    record says ``unknown``, never that it delivered none."""
    with proxied(tmp_path) as (client, _):
        text, usage = ask(client, "no-usage", streamed=False)
        assert (text, usage) == ("Hello", None)
        (record,) = records(tmp_path, 1)
    assert (record["outcome"], record["completion_tokens"], record["completion_source"]) == ("completed", 0, "unknown")


def test_the_clients_own_stream_options_reach_the_upstream_beside_the_usage_chunk_asked_for(tmp_path: Path) -> None:
    """OpenAI's ``include_obfuscation: false`` (the ``openai`` SDK's ``stream_options``): asking
    for the usage chunk the client did not replaced its ``stream_options`` whole, so its stream
    came with the ``obfuscation`` field it turned off."""
    with proxied(tmp_path) as (client, _):
        answer = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "obfuscated"}], stream=True,
            stream_options={"include_obfuscation": False}).http_response
        raw = answer.read()
        (record,) = records(tmp_path, 1)
    events = [json.loads(event.removeprefix(b"data: ")) for event in raw.split(b"\n\n")[:-2]]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert [(event["choices"], "obfuscation" in event, "usage" in event) for event in events] == [
        ([{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}], False, False),
        ([{"index": 0, "delta": {}, "finish_reason": "stop"}], False, False),
    ]
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_source"]) == (10, 4, "usage")
