"""The top-level ``usage`` of a JSON body too large to hold, read as it passes, against the
standard library's parse of the whole body."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.accounting.metrics import Metrics
from proxy.patching.context import PatchConfig
from proxy.patching.ledger import UsageLedger
from proxy.patching.middleware import UsagePatchMiddleware
from proxy.patching.passing_usage import PassingUsage
from proxy.patching.short_strings import KEPT, ShortStrings
from tests.patching.test_middleware import _Records as Records
from tests.servers import serving_in_thread

#: Strings full of what could pass for structure: quotes, backslashes, brackets, "usage".
_TEXT = st.lists(st.sampled_from(['a', '"', '\\', 'usage', '"usage"', '"usage":', '{', '}', '[', ']', ':', ',', ' ',
                                  'é', '\n']), max_size=6).map("".join)
_VALUE = st.recursive(
    st.one_of(st.integers(-5, 10**6), st.integers(-(2**70), 2**70), st.none(), st.booleans(), _TEXT),  # past int64 too
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(_TEXT, st.just("usage")), inner, max_size=4)),
    max_leaves=20,
)
_USAGE = st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens", "usage", "cost"]),
                         st.integers(0, 10**9) | st.floats(allow_nan=False, allow_infinity=False), max_size=3)


def _fed(body: bytes, cuts: list[int]) -> PassingUsage:
    scanner, done = PassingUsage(), 0
    for cut in [*cuts, len(body)]:
        scanner.feed(body[done:cut], last=cut == len(body))
        done = cut
    return scanner


@settings(max_examples=500)
@given(st.dictionaries(_TEXT.filter(lambda key: key != "usage"), _VALUE, max_size=5), st.none() | _USAGE,
       st.integers(0, 6), st.randoms(), st.booleans(), st.booleans())
def test_the_top_level_usage_is_read_wherever_the_body_is_cut(
        members: dict[str, Any], usage: dict[str, int] | None, at: int, rnd: random.Random, ascii_only: bool,
        spaced: bool) -> None:
    """Nested ``"usage"`` keys (a client's echoed objects), the letters inside strings and
    escaped quotes are never taken for it; a key, its colon and its value cut anywhere are."""
    items = list(members.items())
    if usage is not None:
        items.insert(min(at, len(items)), ("usage", usage))
    body = json.dumps(dict(items), ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":")).encode()
    cuts = sorted(rnd.sample(range(1, len(body)), min(len(body) - 1, rnd.randint(0, 8))))
    assert _fed(body, cuts).usage == json.loads(body).get("usage") == usage


def test_bytes_that_are_not_json_after_the_usage_keep_it_and_before_it_end_the_read() -> None:
    """vLLM writes ``usage`` before ``prompt_logprobs``: the rest is read on for a usage written
    again, and bytes after it that are not JSON end that read with the usage read before them;
    before it, they end the read with none."""
    usage = {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    head = json.dumps({"usage": usage, "prompt_logprobs": ["x" * 100] * 10_000}).encode()
    assert _fed(head[:-1] + b"\x00 not json", [len(head) // 2]).usage == usage
    # ... in whichever part they come: the usage and what ends the parse in one (a socket read)
    assert _fed(head[:-1] + b"\x00 not json", []).usage == usage
    assert _fed(b'{"usage": {"prompt_tokens": 1}, "prompt_logprobs": [', []).usage == {"prompt_tokens": 1}
    assert _fed(b'{"id": \x00, "usage": {"prompt_tokens": 1}}', [5]).usage is None
    assert _fed(b'{"id": "x", "usage": {"prompt_tokens": 1', []).usage is None  # cut short


def test_an_empty_part_is_no_end_of_the_body() -> None:
    """ASGI lets an app send an empty body part before the last (``more_body``): to the
    parser an empty buffer is the end of its input, after which the usage was never read."""
    scanner = PassingUsage()
    for part, last in ((b'{"id": "x", ', False), (b"", False), (b'"usage": {"prompt_tokens": 5}}', False), (b"", True)):
        scanner.feed(part, last)
    assert scanner.usage == {"prompt_tokens": 5}


def test_the_model_is_the_top_levels_not_one_a_client_echoed_before_it() -> None:
    """A Responses body echoes the client's ``metadata`` (``"model"`` keys too) before its own."""
    body = json.dumps({"id": "resp_1", "metadata": {"model": "m-client"}, "instructions": '"model": "m-text"',
                       "model": "m-served", "output": [], "usage": {"input_tokens": 3}}).encode()
    for cut in range(1, len(body)):
        scanner = _fed(body, [cut])
        assert (scanner.model, scanner.usage) == ("m-served", {"input_tokens": 3}), cut
        assert scanner.payload() == {"model": "m-served", "usage": {"input_tokens": 3}}
    assert _fed(b'{"model": 5, "usage": {"input_tokens": 3}}', []).payload() == {"usage": {"input_tokens": 3}}


#: Strings past ShortStrings.KEPT, of escapes and characters of every width, and short ones.
_LONG = st.sampled_from(["x" * 5000, "é" * 3000, "\"\\" * 2100, "\u2028\U0001f600" * 1500, "\x01" * 800])
_ANY_TEXT = _TEXT | _LONG


def _same_but_long_strings_emptied(got: Any, sent: Any) -> bool:
    if isinstance(sent, str):
        return got == sent or (got == "" and len(json.dumps(sent, ensure_ascii=False).encode()) - 2 > KEPT)
    if isinstance(sent, list):
        return isinstance(got, list) and len(got) == len(sent) and all(
            map(_same_but_long_strings_emptied, got, sent))
    if isinstance(sent, dict):  # keys too may be emptied, so compared in order
        return isinstance(got, list) and len(got) == len(sent) and all(
            _same_but_long_strings_emptied(k, sk) and _same_but_long_strings_emptied(v, sv)
            for (k, v), (sk, sv) in zip(got, sent.items()))
    return got == sent


@settings(max_examples=300)
@given(st.recursive(st.one_of(st.integers(), st.none(), _ANY_TEXT),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_ANY_TEXT, inner, max_size=3),
                    max_leaves=12),
       st.randoms(), st.booleans())
def test_short_strings_keep_json_whole_and_empty_only_long_strings(value: Any, rnd: random.Random,
                                                                   ascii_only: bool) -> None:
    """Cut anywhere (inside an escape, a character of several bytes), the text stays JSON, each
    string kept whole or, past ``KEPT``, left empty."""
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    cuts = sorted(rnd.sample(range(1, len(body)), min(len(body) - 1, rnd.randint(0, 12)))) if len(body) > 1 else []
    short, done, out = ShortStrings(), 0, []
    for cut in [*cuts, len(body)]:
        out.append(short.cut(body[done:cut]))
        done = cut
    assert _same_but_long_strings_emptied(json.loads(b"".join(out), object_pairs_hook=list), value)


def test_read_on_to_the_end_an_escape_a_part_cuts_after_the_usage_is_still_json() -> None:
    """Read whole (an SSE event's data), the parse goes on past the usage to the end: the text
    after it is cut as before it, so a string's escape split by a part's end stays an escape."""
    body = b'{"model": "m", "usage": {"input_tokens": 3}, "note": "a\\"b"}'
    assert json.loads(body)["note"] == 'a"b'
    for cut in range(1, len(body)):
        read, done = PassingUsage(whole=True), 0
        for end in (cut, len(body)):
            read.feed(body[done:end], last=end == len(body))
            done = end
        assert read.payload() == {"model": "m", "usage": {"input_tokens": 3}}, cut


def test_a_model_a_part_cuts_is_read_up_to_kept_bytes() -> None:
    """A string a part cuts is kept up to ``KEPT`` bytes: a model name that long is the label
    read; one byte longer it is left out (no model is ever that long), the usage still read."""
    for size, model in ((KEPT, "m" * KEPT), (KEPT + 1, "")):
        body = json.dumps({"model": "m" * size, "usage": {"input_tokens": 3}}).encode()
        assert _fed(body, [20]).payload() == {"model": model, "usage": {"input_tokens": 3}}, size


def test_a_body_of_long_strings_passing_holds_none_of_them() -> None:
    """Twelve answers of one 24 MiB string each passed unheld held 290 MiB, as many as held
    whole: yajl kept each string a part cut until its end. Four parses stopped inside one hold
    a few MiB now, and the usage after it is read."""
    body = json.dumps({"id": "c", "choices": [{"message": {"content": "x" * (24 << 20)}}],
                       "usage": {"prompt_tokens": 5}}).encode()
    parts = [body[k : k + (1 << 20)] for k in range(0, len(body), 1 << 20)]
    before = _rss_mib()
    reads = [PassingUsage() for _ in range(4)]
    for read in reads:
        for part in parts[:-1]:
            read.feed(part)
    assert _rss_mib() - before < 16  # 113 MiB before
    reads[0].feed(parts[-1], last=True)
    assert reads[0].usage == {"prompt_tokens": 5}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_usage_written_over_and_over_holds_only_the_last() -> None:
    """The usage is read on to the body's end, for one written again, and each read was kept
    until then: an answer of 8 MiB of top-level ``usage`` members held some 100 MiB (yajl's
    values, in a list that grew with the body). Only the last, the one billed, is kept now."""
    member = b'"usage":{"prompt_tokens":1},'
    body = b'{"model":"m",' + member * ((8 << 20) // len(member)) + b'"usage":{"prompt_tokens":700}}'
    tracemalloc.start()
    try:
        read = _fed(body, list(range(1 << 16, len(body), 1 << 16)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read.usage == json.loads(body)["usage"] == {"prompt_tokens": 700}
    assert peak < 2 << 20


def test_a_usage_written_twice_in_the_last_part_is_read_as_json_loads_reads_it() -> None:
    """Found in the part that ends the body, the first of two was taken: it is read on only
    while more is to come."""
    body = b'{"model":"m","choices":[],"usage":{"prompt_tokens":5},"usage":{"prompt_tokens":700}}'
    for cuts in ([], [10]):
        assert _fed(body, cuts).usage == json.loads(body)["usage"] == {"prompt_tokens": 700}, cuts


@pytest.mark.loopback
def test_an_answer_too_large_to_hold_whose_last_part_writes_its_usage_twice_bills_the_one_its_client_reads() -> None:
    """An inner app that sends data in its last part (ASGI allows it, as Starlette's ``Response``
    does): both usages in it, past ``max_response_bytes``, billed 5 prompt tokens for the 700
    the ``openai`` client read."""
    pad = b'{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":' \
          b'{"role":"assistant","content":"' + b"a" * (64 << 10) + b'"},"finish_reason":"length"}]'
    usages = b',"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6},' \
             b'"usage":{"prompt_tokens":700,"completion_tokens":9,"total_tokens":709}}'

    class Engine:
        """The chat route, as an ASGI app of its own (Starlette's routes serve it as sent)."""

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": pad, "more_body": True})
            await send({"type": "http.response.body", "body": usages})

    ledger, records = UsageLedger(), Records()
    inner = Starlette(routes=[Route("/v1/chat/completions", Engine(), methods=["POST"])])
    app = UsagePatchMiddleware(inner, ledger=ledger, metrics=Metrics(ledger), recorder=records,
                               config=PatchConfig(max_response_bytes=16 << 10))
    with serving_in_thread(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.prompt_tokens == 700
    assert [(r.prompt_tokens, r.completion_tokens) for r in records.records] == [(700, 9)]
