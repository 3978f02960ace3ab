"""A streamed answer whose usage event is too large to hold, through real HTTP, in upstream mode.

cachetally runs in a real uvicorn on 127.0.0.1 in front of a fake upstream that streams a
Responses answer as vLLM does: its terminal event holds the whole response object, the
output's logprobs and what it echoes of the request (``instructions``, ``metadata``) with it.
``top_logprobs`` on some 55,000 output tokens takes that event past ``max_response_bytes``
(64 MiB); here the bound is 256 KiB. The event goes out unpatched, as it comes, and was
unread: the record had no prompt, so a client could keep its prompt off the bill. Its usage
is read as it passes (:mod:`proxy.patching.passing_event`), in whatever framing the upstream
chose: ``\\n`` or ``\\r\\n`` line ends, the JSON over several ``data:`` lines. The same for
chat, completions and Messages streams whose every event an upstream (llama.cpp) makes too
large by echoing the client's ``model``; and a JSON answer with its ``usage`` written twice
is billed the one its client's parser keeps.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from proxy.accounting.records.report import read
from proxy.server.app import CachetallyApp
from proxy.server.settings import Settings
from tests.servers import serving_in_thread

pytestmark = pytest.mark.loopback

SERVED = "m-real"
KEY = "sk-acme-0123456789"
LIMIT = 256 << 10
USAGE = {"input_tokens": 700, "output_tokens": 9, "total_tokens": 709,
         "input_tokens_details": {"cached_tokens": 512}, "output_tokens_details": {"reasoning_tokens": 0}}
#: What the client echoes, which the response carries before its own usage: "usage" and "model"
#: keys and text, none of them the response's.
ECHOED = {"metadata": {"model": "m-client", "usage": '{"input_tokens": 1}'},
          "instructions": 'data: {"usage": {"input_tokens": 1}}\n\n"model": "m-text"'}


def _event(kind: str, fields: dict[str, Any], framing: str) -> bytes:
    data = {"type": kind, **fields}
    if framing == "multiline":  # the JSON over many data lines, joined with "\n" by the client
        lines = json.dumps(data, indent=1).encode().split(b"\n")
        return b"event: %s\n%s\n\n" % (kind.encode(), b"\n".join(b"data: " + line for line in lines))
    end = b"\r\n" if framing == "crlf" else b"\n"
    return b"event: %s%sdata: %s%s%s" % (kind.encode(), end, orjson.dumps(data), end, end)


def responses_upstream(framing: str, last: str = "response.completed") -> Any:
    """Streams ``response.created``, 9 text deltas, then ``response.output_item.done`` and
    ``last`` with 9 tokens' logprobs of 20 alternatives each, repeated past :data:`LIMIT`, sent
    in 8 KiB parts as TCP may hand them over."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if await _request_body(scope, receive, send) is None:
            return
        head = {"id": "resp_1", "object": "response", "created_at": 1, "model": SERVED, "status": "in_progress",
                "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": None, **ECHOED}
        logprobs = [{"token": "a", "logprob": -0.5, "bytes": [97],
                     "top_logprobs": [{"token": "\"usage\":" * 40, "logprob": -1.5, "bytes": [34]}] * 20}] * 9
        # The output's logprobs: 9 tokens', repeated, stand in for tens of thousands of tokens'.
        text = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "a" * 9, "annotations": [],
                             "logprobs": logprobs * (LIMIT // 10_000)}]}
        final = {**head, "status": last.removeprefix("response."), "usage": USAGE, "output": [text]}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        opening = _event("response.created", {"response": head, "sequence_number": 0}, framing)
        await send({"type": "http.response.body", "body": opening, "more_body": True})
        for n in range(9):
            delta = _event("response.output_text.delta", {
                "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "a", "logprobs": [],
                "sequence_number": n + 1}, framing)
            await send({"type": "http.response.body", "body": delta, "more_body": True})
        # vLLM's output_item.done holds the item, logprobs and all: as large, and no usage.
        item = _event("response.output_item.done", {"output_index": 0, "item": text, "sequence_number": 10}, framing)
        end = _event(last, {"response": final, "sequence_number": 11}, framing)
        assert len(end) > len(item) > LIMIT
        for at in range(0, len(item + end), 8 << 10):
            await send({"type": "http.response.body", "body": (item + end)[at:at + (8 << 10)], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _request_body(scope: Scope, receive: Receive, send: Send) -> bytes | None:
    """The request's body, or ``None`` where the stub upstream answered it here: its lifespan,
    and the model list cachetally reads as it starts."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return None
    body = b""
    while (message := await receive()).get("more_body"):
        body += message.get("body", b"")
    if scope["path"] != "/v1/models":
        return body + message.get("body", b"")
    models = orjson.dumps({"object": "list", "data": [{"id": SERVED, "object": "model"}]})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": models})
    return None


def _proxy(upstream: str, usage_dir: Path, tmp_path: Path) -> Iterator[str]:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'"{KEY}" = "acme"\n')
    keys.chmod(0o600)
    settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                        api_keys_file=str(keys), max_response_bytes=LIMIT).validate()
    return serving_in_thread(CachetallyApp(settings))


def _records(usage_dir: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for f in sorted(usage_dir.glob("*.jsonl")) for line in f.read_bytes().splitlines()]


@pytest.mark.parametrize(("framing", "last"), [("lf", "response.completed"), ("crlf", "response.incomplete"),
                                               ("multiline", "response.completed"), ("lf", "response.failed")])
def test_a_responses_stream_whose_final_event_is_too_large_to_hold_is_still_billed_its_prompt(
        tmp_path: Path, framing: str, last: str) -> None:
    """The terminal event past ``max_response_bytes`` reaches the client as the upstream sent
    it, and the record, the counters and ``cachetally report`` bill its usage: the prompt,
    its cache reads and the completion, labelled by the response's model, not the echoed one
    (``response.failed``: a failed request, its tokens billed as its usage says)."""
    usage_dir = tmp_path / "usage"
    with serving_in_thread(responses_upstream(framing, last)) as upstream, \
            _proxy(upstream, usage_dir, tmp_path) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as client:
            events = list(client.responses.create(model=SERVED, input="hi", stream=True, top_logprobs=20))
        metrics = httpx.get(f"{url}/metrics").text
    final = events[-1]
    assert final.type == last and final.response.usage is not None
    assert final.response.usage.input_tokens == 700  # as it came: the event went out unpatched
    assert final.response.metadata == ECHOED["metadata"]
    billed = [(r["route"], r["tenant"], r["model"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"],
               r["completion_source"], r["source"], r["outcome"]) for r in _records(usage_dir)]
    outcome = "error" if last == "response.failed" else "completed"
    assert billed == [("responses", "acme", SERVED, 700, 512, 9, "usage", "upstream", outcome)]
    assert 'cachetally_patch_skipped_total{reason="event_too_large"} 2.0' in metrics
    assert 'cachetally_prompt_tokens_total{model="m-real",tenant="acme"} 700.0' in metrics
    totals = read(sorted(usage_dir.glob("*.jsonl"))).total()
    assert (totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens) == (700, 512, 9)


def _echoing_upstream(route: str) -> Any:
    """Streams a chat, completions or Messages answer as llama.cpp does: the request's ``model``
    echoed in each chunk (in Messages' ``message_start``), the usage in the last one (in
    ``message_start`` and ``message_delta``), sent in 8 KiB parts."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if (body := await _request_body(scope, receive, send)) is None:
            return
        model = orjson.loads(body)["model"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        if route == "messages":
            usage = {"input_tokens": 188, "cache_read_input_tokens": 512, "cache_creation_input_tokens": 0}
            start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": model,
                     "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
            events = [_event("message_start", {"message": start}, "lf"),
                      _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}, "lf"),
                      *[_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "a"}}, "lf")]
                      * 9, _event("content_block_stop", {"index": 0}, "lf"),
                      _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                               "usage": {"output_tokens": 9}}, "lf"),
                      _event("message_stop", {}, "lf")]
        else:
            kind = "chat.completion.chunk" if route == "chat" else "text_completion"
            head = {"id": "c1", "object": kind, "created": 1, "model": model}
            choice = {"index": 0, "delta": {"content": "a"}} if route == "chat" else {"index": 0, "text": "a"}
            events = [b"data: " + orjson.dumps({**head, "choices": [{**choice, "finish_reason": None}]}) + b"\n\n"] * 8
            events.append(b"data: " + orjson.dumps({**head, "choices": [{**choice, "finish_reason": "length"}]}) + b"\n\n")
            usage = {"prompt_tokens": 700, "completion_tokens": 9, "total_tokens": 709,
                     "prompt_tokens_details": {"cached_tokens": 512}}
            events += [b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n", b"data: [DONE]\n\n"]
        stream = b"".join(events)
        for at in range(0, len(stream), 8 << 10):
            await send({"type": "http.response.body", "body": stream[at:at + (8 << 10)], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_a_usage_event_made_too_large_by_the_model_name_it_echoes_is_still_billed(tmp_path: Path, route: str) -> None:
    """An upstream that echoes the request's ``model`` (llama.cpp) makes each of its events as
    large as the name a client sends: past ``max_event_bytes`` (here 64 KiB) the usage chunk,
    and Messages' ``message_start``, went out unread, and the record had no prompt
    (``prompt_tokens`` ``null``, the completion counted from the chunks: 11 for 9 tokens). Read
    as they pass, they are billed as the client reads them."""
    usage_dir = tmp_path / "usage"
    keys = tmp_path / "keys.toml"
    keys.write_text(f'"{KEY}" = "acme"\n')
    keys.chmod(0o600)
    name = "m" * (512 << 10)
    with serving_in_thread(_echoing_upstream(route)) as upstream:
        settings = Settings(engine="upstream", upstream=upstream, usage_dir=str(usage_dir), usage_flush_interval_s=0.05,
                            api_keys_file=str(keys), max_event_bytes=64 << 10).validate()
        with serving_in_thread(CachetallyApp(settings)) as url:
            if route == "messages":
                with anthropic.Anthropic(base_url=url, api_key=KEY) as messages_client, messages_client.messages.stream(
                        model=name, max_tokens=9, messages=[{"role": "user", "content": "hi"}]) as stream:
                    got = stream.get_final_message().usage
                read = (got.input_tokens + (got.cache_read_input_tokens or 0), got.cache_read_input_tokens,
                        got.output_tokens)
            else:
                with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as client:
                    chunks = list(client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": "hi"}], stream=True,
                        stream_options={"include_usage": True}) if route == "chat" else client.completions.create(
                        model=name, prompt="hi", stream=True, stream_options={"include_usage": True}))
                usage = chunks[-1].usage
                assert usage is not None and usage.prompt_tokens_details is not None
                read = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens)
            metrics = httpx.get(f"{url}/metrics").text
    assert read == (700, 512, 9)
    assert 'cachetally_patch_skipped_total{reason="event_too_large"}' in metrics
    billed = [(r["route"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["completion_source"],
               r["source"]) for r in _records(usage_dir)]
    assert billed == [(route, 700, 512, 9, "usage", "upstream")]


def _twice_upstream(content: int) -> Any:
    """Answers a chat completion of ``content`` bytes of text with ``usage`` written twice at its
    top level, a figure of 5 prompt tokens before the choices and one of 700 after them."""
    first = b'{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":0}}'
    last = b'{"prompt_tokens":700,"completion_tokens":9,"total_tokens":709,"prompt_tokens_details":{"cached_tokens":512}}'
    answer = (b'{"id":"c1","object":"chat.completion","created":1,"model":"m-real","usage":' + first
              + b',"choices":[{"index":0,"message":{"role":"assistant","content":"' + b"a" * content
              + b'"},"finish_reason":"length"}],"usage":' + last + b"}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if await _request_body(scope, receive, send) is None:
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        for at in range(0, len(answer), 8 << 10):
            await send({"type": "http.response.body", "body": answer[at:at + (8 << 10)], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("content", [10, 2 * LIMIT], ids=["held", "too_large_to_hold"])
def test_a_usage_written_twice_in_a_json_answer_bills_the_one_its_client_reads(tmp_path: Path, content: int) -> None:
    """The client's parser (the ``openai`` SDK's ``json.loads``) keeps the last of two top-level
    ``usage`` members. An answer past ``max_response_bytes`` was billed the first, read as it
    passed and its read stopped there: 5 prompt tokens for the 700 its client read."""
    usage_dir = tmp_path / "usage"
    with serving_in_thread(_twice_upstream(content)) as upstream, _proxy(upstream, usage_dir, tmp_path) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as client:
            answer = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    read = (answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens, answer.usage.completion_tokens)
    assert read == (700, 512, 9)
    billed = [(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["source"]) for r in _records(usage_dir)]
    assert billed == [(700, 512, 9, "upstream")]
