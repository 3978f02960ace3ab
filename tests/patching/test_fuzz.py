"""Fuzzing the response patchers: no exception escapes, and the output equals the input
except for valid usage patches.

``test_sse`` generates well-formed streams; here the input is hostile: arbitrary bytes,
byte soup built from SSE and JSON fragments, tiny event caps (the oversize path),
arbitrary JSON documents for the JSON body patcher (through the middleware, message
level), and, when ``atheris`` is installed, a short coverage-guided run of the SSE
patcher (``tests/patching/fuzz_sse_atheris.py``; longer with ``CACHETALLY_SOAK=1``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message

from engine_adapter.events import Scheduled, current_request_key
from proxy.accounting.metrics import Metrics
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.patching.sse import SSEPatcher
from tests.load import count, report
from tests.servers import ROOT
from tests.patching.test_sse import expected_patch, parse_event, set_seven, split_events

EXAMPLES = count(300, 20_000)

FRAGMENTS = [
    b"data: ", b"data:", b"\n", b"\r", b"\r\n", b"\n\n", b": comment", b"event: x", b"id: 1",
    b'{"usage":', b'{"usage": {"prompt_tokens": 5}}', b'"usage"', b"null", b"{", b"}", b"[", b"]",
    b'"prompt_tokens_details":', b'{"cached_tokens": "7"}', b"[DONE]", b"\xff\xfe", b"\xe2\x80\xa8",
    b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}', b"1e999", b"\x00",
]

soup = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=8)), max_size=60).map(b"".join)
streams = st.one_of(st.binary(max_size=400), soup)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def assert_only_usage_patches(source: bytes, output: bytes) -> None:
    in_events, in_tail = split_events(source)
    out_events, out_tail = split_events(output)
    assert len(out_events) == len(in_events)
    for before, after in zip(in_events, out_events, strict=True):
        if after == before:
            continue  # untouched (or passed unpatched: oversize, malformed)
        want = expected_patch(before)
        assert want is not None, (before, after)
        data, others = parse_event(after)
        assert data is not None and orjson.loads(data) == want
        assert others == parse_event(before)[1]
    assert out_tail == in_tail


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams, st.lists(st.integers(0, 400), max_size=12), st.sampled_from([8, 32, 1 << 20]))
def test_sse_patcher_on_hostile_bytes_only_ever_applies_usage_patches(
    data: bytes, cuts: list[int], cap: int
) -> None:
    oversize: list[int] = []
    patcher = SSEPatcher(set_seven, max_event_bytes=cap, on_oversize=lambda reason: oversize.append(reason))
    output = b"".join(patcher.feed(chunk) for chunk in chunked(data, cuts)) + patcher.flush()
    assert_only_usage_patches(data, output)
    if cap == 1 << 20:
        assert not oversize


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
usage_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": json_values | st.integers(0, 10_000),
        "completion_tokens": json_values,
        "prompt_tokens_details": json_values | st.fixed_dictionaries({}, optional={"cached_tokens": json_values}),
        "timings": json_values | st.fixed_dictionaries({}, optional={"cache_n": json_values}),
    },
)
documents = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={"usage": usage_like | json_values, "model": json_values}),
)


async def through_middleware(body: bytes, engine: Scheduled | None) -> tuple[list[Message], UsageLedger]:
    ledger = UsageLedger()

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if engine is not None:
            ledger.publish(dataclasses.replace(engine, request_id=current_request_key.get()))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    app = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), config=PatchConfig())
    sent: list[Message] = []
    request = [{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}]

    async def receive() -> Message:
        return request.pop() if request else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    await app(scope, receive, send)
    return sent, ledger


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(documents.map(orjson.dumps), st.binary(max_size=64)), st.booleans())
def test_json_body_patcher_only_ever_writes_cached_tokens(body: bytes, with_event: bool) -> None:
    engine = Scheduled(request_id="", prompt_tokens=9, cached_tokens=4, source="engine") if with_event else None
    sent, ledger = asyncio.run(through_middleware(body, engine))
    assert len(ledger) == 0
    start, out = sent[0], sent[1]["body"]
    assert dict(start["headers"])[b"content-length"] == str(len(out)).encode()
    try:
        before = orjson.loads(body)
    except orjson.JSONDecodeError:
        assert out == body  # not JSON: untouched
        return
    if not isinstance(before, dict) or not isinstance(before.get("usage"), dict):
        assert out == body
        return
    after = orjson.loads(out)
    want = copy.deepcopy(before)
    usage = want["usage"]
    if not isinstance(usage.get("prompt_tokens_details"), dict):
        usage["prompt_tokens_details"] = {}
    details = usage["prompt_tokens_details"]
    actual = after["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(actual, int) and actual >= 0
    details["cached_tokens"] = actual  # the only field that may differ
    assert after == want
    prompt_tokens = usage.get("prompt_tokens")
    if with_event and (not isinstance(prompt_tokens, int) or prompt_tokens == 9):
        assert actual == 4  # the engine's figure wins whenever it matches the usage object


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_atheris_run_over_the_sse_patcher_finds_nothing() -> None:
    runs = count(20_000, 2_000_000)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fuzz_sse_atheris.py")), f"-runs={runs}", "-max_len=2048"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report("atheris-sse", runs=runs, tail=proc.stderr.strip().splitlines()[-1][:200])
