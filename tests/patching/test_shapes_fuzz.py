"""Fuzzing the Responses and Messages stream shapes through the middleware, message level.

Hypothesis draws a stream of each API (its usage events with hostile usage values, other
events, comments, any line ends) and cuts it at random points. Through
``UsagePatchMiddleware`` with an engine event, the output must be the same whatever the
cuts; events without usage go out byte for byte; in each usage event only the cache
fields (and Anthropic's ``input_tokens``) may change, to the engine's figures whenever the
usage object's prompt matches the engine's; the slot is closed."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message

from engine_adapter.events import Scheduled, current_request_key
from proxy.accounting.metrics import Metrics
from proxy.accounting.records.record import MAX_COUNT
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from tests.load import count
from tests.patching.test_fuzz import chunked, json_values
from tests.patching.test_sse import parse_event, split_events

EXAMPLES = count(200, 10_000)
ENGINE = Scheduled(request_id="", prompt_tokens=90, cached_tokens=64, cache_creation_tokens=16)
PATHS = {"messages": "/v1/messages", "responses": "/v1/responses"}

hostile = st.one_of(json_values, st.integers(0, 200))
anthropic_usage = st.fixed_dictionaries({}, optional={
    "input_tokens": hostile, "output_tokens": hostile,
    "cache_read_input_tokens": hostile, "cache_creation_input_tokens": hostile})
responses_usage = st.fixed_dictionaries({}, optional={
    "input_tokens": hostile | st.just(90), "output_tokens": hostile,
    "input_tokens_details": json_values | st.fixed_dictionaries({}, optional={
        "cached_tokens": hostile, "cache_write_tokens": hostile})})


@st.composite
def payloads(draw: st.DrawFn, api: str) -> dict[str, Any]:
    if api == "messages":
        usage = draw(anthropic_usage | st.just({"input_tokens": 10, "cache_read_input_tokens": 64,
                                                 "cache_creation_input_tokens": 16}))
        kind = draw(st.sampled_from(["message_start", "message_delta", "content_block_delta", "ping"]))
        if kind == "message_start":
            return {"type": kind, "message": {"id": "msg_1", "model": "m", "usage": usage}}
        if kind == "message_delta":
            return {"type": kind, "delta": {"stop_reason": "end_turn"}, "usage": usage}
        return {"type": kind, "delta": {"text": draw(st.text(max_size=6))}}
    kind = draw(st.sampled_from(["response.created", "response.completed", "response.incomplete",
                                 "response.failed", "response.output_text.delta"]))
    if kind == "response.output_text.delta":
        return {"type": kind, "delta": draw(st.text(max_size=6))}
    usage = None if kind == "response.created" else draw(responses_usage)
    return {"type": kind, "response": {"id": "resp_1", "object": "response", "usage": usage}}


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, bytes]:
    api = draw(st.sampled_from(list(PATHS)))
    out = b""
    for _ in range(draw(st.integers(1, 8))):
        end = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
        payload = draw(payloads(api))
        if draw(st.booleans()):
            out += b": keep-alive" + end
        out += b"event: " + payload["type"].encode() + end + b"data: " + orjson.dumps(payload) + end + end
    return api, out


async def through(api: str, chunks: list[bytes]) -> tuple[bytes, UsageLedger]:
    ledger = UsageLedger()

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        ledger.publish(dataclasses.replace(ENGINE, request_id=current_request_key.get()))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    app = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), config=PatchConfig())
    request = [{"type": "http.request", "body": b'{"stream": true}', "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        return request.pop() if request else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": PATHS[api], "headers": [], "query_string": b""}
    await app(scope, receive, send)
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), ledger


def holder(api: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    if api == "messages":
        return payload.get("message") if payload.get("type") == "message_start" else payload
    return payload.get("response")


ANTHROPIC_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def sent_figures(usage: dict[str, Any]) -> dict[str, Any]:
    """The input figures a usage object sends: a ``null`` one is not sent (the SDK keeps the earlier)."""
    return {k: usage[k] for k in ANTHROPIC_INPUT if usage.get(k) is not None}


def expected_usage(api: str, usage: Any, opening: dict[str, Any] | None = None) -> Any:
    """What the patched usage must be, given the engine's 90 prompt, 64 reads, 16 writes.
    ``opening``: a ``message_delta``'s ``message_start`` figures, which those it omits keep."""
    if not isinstance(usage, dict):
        return usage
    want = copy.deepcopy(usage)
    if api == "messages":
        sent = sent_figures(usage)
        figures = opening | sent if opening and sent else usage
        counts = [v if type(v) is int and 0 <= v <= MAX_COUNT else None for v in (figures.get(k) for k in ANTHROPIC_INPUT)]
        prompt = None if counts[0] is None else counts[0] + (counts[1] or 0) + (counts[2] or 0)
        if prompt is not None and prompt > MAX_COUNT:
            prompt = None  # parts that a record holds, their sum not: no count of the prompt
        if prompt in (None, 90):
            # The engine knows the prompt: input_tokens excludes its reads and writes.
            want |= {"input_tokens": 10, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 16}
        else:
            # Another prompt: its reported figures, written whole; no reads reported: the `zero` policy.
            want |= {"input_tokens": counts[0], "cache_read_input_tokens": counts[1] or 0}
            if counts[2] is not None:
                want["cache_creation_input_tokens"] = counts[2]
        return want
    prompt = usage.get("input_tokens")
    details = want.get("input_tokens_details")
    details = details if isinstance(details, dict) else {}
    if type(prompt) is not int or prompt < 0 or prompt == 90:
        want["input_tokens_details"] = {**details, "cached_tokens": 64, "cache_write_tokens": 16}
    elif not (type(reads := details.get("cached_tokens")) is int and 0 <= reads <= prompt):
        # another prompt, and no report of it (none, or more reads than it has): `zero`
        want["input_tokens_details"] = {**details, "cached_tokens": 0}
    return want


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.lists(st.integers(0, 2000), max_size=10))
def test_any_chunking_patches_only_the_cache_fields_to_the_engines_figures(
    stream: tuple[str, bytes], cuts: list[int]
) -> None:
    api, source = stream
    whole, ledger = asyncio.run(through(api, [source]))
    cut, _ = asyncio.run(through(api, chunked(source, cuts)))
    assert cut == whole
    assert len(ledger) == 0
    in_events, in_tail = split_events(source)
    out_events, out_tail = split_events(whole)
    assert (len(out_events), out_tail) == (len(in_events), in_tail)
    opening: dict[str, Any] | None = None  # the last message_start's figures
    for before, after in zip(in_events, out_events, strict=True):
        data, others = parse_event(before)
        payload = orjson.loads(data) if data is not None else None
        place = holder(api, payload) if isinstance(payload, dict) else None
        if place is None or not isinstance(place.get("usage"), dict):
            assert after == before
            continue
        kind = payload.get("type")  # type: ignore[union-attr]
        if kind == "message_start":
            opening = sent_figures(place["usage"])
        out_data, out_others = parse_event(after)
        assert out_others == others
        assert out_data is not None
        got = orjson.loads(out_data)
        want = copy.deepcopy(payload)
        holder(api, want)["usage"] = expected_usage(  # type: ignore[index]
            api, place["usage"], opening if kind == "message_delta" else None)
        assert got == want
