"""SSEPatcher and patch_event: byte-exact passthrough, exact usage patches, any chunking.

The expected side is computed with a small SSE splitter written here from the spec
(WHATWG HTML, "Server-sent events", event stream interpretation), not with proxy.patching.sse.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.patching.response_budget import BUDGET_FULL, ResponseBudget, ResponseHold
from proxy.patching.sse import SSEPatcher, patch_event

# -- an independent, spec-following SSE splitter ---------------------------------------


def split_lines(raw: bytes) -> list[tuple[bytes, bytes]]:
    """(line, terminator) pairs; a final unterminated line has terminator b""."""
    out: list[tuple[bytes, bytes]] = []
    i = line_start = 0
    n = len(raw)
    while i < n:
        byte = raw[i]
        if byte == 0x0D:  # CR, or CR LF
            end = i + 2 if i + 1 < n and raw[i + 1] == 0x0A else i + 1
        elif byte == 0x0A:  # LF
            end = i + 1
        else:
            i += 1
            continue
        out.append((raw[line_start:i], raw[i:end]))
        i = line_start = end
    if line_start < n:
        out.append((raw[line_start:], b""))
    return out


def split_events(stream: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (raw bytes, up to and including their blank line) and the tail."""
    events: list[bytes] = []
    event_start = pos = 0
    for line, terminator in split_lines(stream):
        pos += len(line) + len(terminator)
        if terminator and not line:
            events.append(stream[event_start:pos])
            event_start = pos
    return events, stream[event_start:]


def event_end_offsets(stream: bytes) -> list[tuple[int, bytes]]:
    """Where each complete event ends in ``stream``, with its blank line's terminator."""
    ends: list[tuple[int, bytes]] = []
    pos = 0
    for line, terminator in split_lines(stream):
        pos += len(line) + len(terminator)
        if terminator and not line:
            ends.append((pos, terminator))
    return ends


def parse_event(raw: bytes) -> tuple[bytes | None, list[bytes]]:
    """The event's data (data lines joined by LF, or None) and its other lines, in order."""
    data: list[bytes] = []
    others: list[bytes] = []
    for line, _ in split_lines(raw):
        if not line:
            continue
        if line.startswith(b":"):
            others.append(line)
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        else:
            others.append(line)
    return (b"\n".join(data) if data else None), others


# -- the patch under test ----------------------------------------------------------------


def set_seven(payload: dict) -> bool | None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    details["cached_tokens"] = 7
    return True


def expected_patch(raw_event: bytes) -> Any | None:
    """The payload ``set_seven`` should produce for this event, or None if it leaves it."""
    data, _ = parse_event(raw_event)
    if data is None:
        return None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or set_seven(copy.deepcopy(payload)) is None:
        return None
    patched = copy.deepcopy(payload)
    set_seven(patched)
    return patched


def run(patcher: SSEPatcher, chunks: list[bytes]) -> bytes:
    return b"".join(patcher.feed(chunk) for chunk in chunks) + patcher.flush()


def assert_patched_stream(source: bytes, output: bytes) -> None:
    """Non-usage events byte-identical and in order; usage events carry exactly the patch."""
    in_events, in_tail = split_events(source)
    out_events, out_tail = split_events(output)
    assert len(out_events) == len(in_events)
    for before, after in zip(in_events, out_events, strict=True):
        want = expected_patch(before)
        if want is None:
            assert after == before
        else:
            data, others = parse_event(after)
            assert data is not None
            assert orjson.loads(data) == want
            assert others == parse_event(before)[1]
    assert out_tail == in_tail  # an unterminated last event goes out unpatched


# -- generated streams ---------------------------------------------------------------------

SPECIAL = ["\u2028", "\u2029", "\x1c", "\x1d", "\x1e", "\x85", "\x0b", "\x0c", "\r", "\n", "\x00"]
SPECIAL += ["\U0001f600", "\U0001f469\u200d\U0001f4bb", '"', "\\", "usage", '"usage"', "data:", ": "]

json_text = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=3)), max_size=6).map("".join)
line_text = json_text.map(lambda s: s.replace("\r", "").replace("\n", ""))

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_text,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(json_text.filter(lambda key: key != "usage"), children, max_size=3),
    max_leaves=8,
)


@st.composite
def usage_payload(draw: st.DrawFn) -> dict:
    prompt = draw(st.integers(0, 1 << 20))
    completion = draw(st.integers(0, 4096))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = draw(st.sampled_from(["absent", "null", "empty", "other", "cached"]))
    if details == "null":
        usage["prompt_tokens_details"] = None
    elif details == "empty":
        usage["prompt_tokens_details"] = {}
    elif details == "other":
        usage["prompt_tokens_details"] = {"audio_tokens": 0, "note": draw(json_text)}
    elif details == "cached":
        usage["prompt_tokens_details"] = {"cached_tokens": draw(st.integers(0, prompt))}
    continuous = draw(st.booleans())
    choices = [{"index": 0, "delta": {"content": draw(json_text)}}] if continuous else []
    payload: dict[str, Any] = {"id": draw(json_text), "choices": choices, "usage": usage}
    payload.update(draw(st.dictionaries(st.sampled_from(["model", "x", "\u2028"]), json_values, max_size=2)))
    return payload


@st.composite
def null_usage_payload(draw: st.DrawFn) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": draw(json_text)}}], "usage": None}


@st.composite
def non_usage_payload(draw: st.DrawFn) -> Any:
    return draw(json_values)


def serialize(payload: Any, style: str) -> list[str]:
    """JSON text split into data-line values; multi-line JSON is valid once joined by LF."""
    if style == "orjson":
        return [orjson.dumps(payload).decode()]
    if style == "spaced":  # `"usage": null` with a space, as json.dumps writes it
        return [json.dumps(payload, ensure_ascii=False)]
    return json.dumps(payload, ensure_ascii=False, indent=1).split("\n")


@st.composite
def event_lines(draw: st.DrawFn) -> list[str]:
    kind = draw(st.sampled_from(["usage", "usage", "null_usage", "json", "text", "done", "comment"]))
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        lines.append(
            draw(
                st.sampled_from([": ping", ":", "event: message", "event:usage", "id: 42", "retry: 1000"])
                | line_text.map(lambda s: ": " + s)
            )
        )
    if kind == "comment":
        return lines + [": " + draw(line_text)]
    if kind == "done":
        return lines + ["data: [DONE]"]
    if kind == "text":  # not JSON; may mention "usage" and carry U+2028, \x1c ... raw
        values = draw(st.lists(line_text, min_size=1, max_size=3))
    else:
        strategy = {"usage": usage_payload(), "null_usage": null_usage_payload(), "json": non_usage_payload()}
        payload = draw(strategy[kind])
        values = serialize(payload, draw(st.sampled_from(["orjson", "spaced", "indented"])))
    data = [draw(st.sampled_from(["data: ", "data:"])) + value for value in values]
    if len(data) > 1 and draw(st.booleans()):
        data.insert(draw(st.integers(1, len(data) - 1)), ": between data lines")
    return lines + data


TERMINATORS = st.sampled_from(["\r\n", "\r", "\n"])


@st.composite
def sse_event(draw: st.DrawFn, *, blank: bool = True) -> bytes:
    lines = draw(event_lines())
    out = [line + draw(TERMINATORS) for line in lines]
    if blank:
        end = draw(TERMINATORS)
        if out[-1].endswith("\r") and end == "\n":
            end = "\r\n"  # "\r" + "\n" would be one terminator, not a blank line
        out.append(end)
    elif draw(st.booleans()):
        out[-1] = out[-1].rstrip("\r\n")  # unterminated last line
    return "".join(out).encode()


@st.composite
def sse_stream(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(sse_event(), min_size=1, max_size=8))
    if draw(st.booleans()):
        events.append(b"data: [DONE]\n\n")
    if draw(st.integers(0, 4)) == 0:
        events.append(draw(sse_event(blank=False)))
    return b"".join(events)


@st.composite
def stream_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    stream = draw(sse_stream())
    cuts = sorted(set(draw(st.lists(st.integers(0, len(stream)), max_size=20))))
    bounds = [0, *cuts, len(stream)]
    return stream, [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_and_cuts())
def test_any_chunking_patches_usage_events_exactly_and_passes_the_rest_byte_for_byte(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    whole = run(SSEPatcher(set_seven), [stream])
    assert_patched_stream(stream, whole)

    patcher = SSEPatcher(set_seven)
    ends = event_end_offsets(stream)
    fed = 0
    out = b""
    for chunk in chunks:
        out += patcher.feed(chunk)
        fed += len(chunk)
        # Every event complete in what was fed has gone out, and nothing else: a blank
        # line that is a lone "\r" at the very end may yet be the first half of "\r\n".
        done = sum(1 for end, term in ends if end < fed or (end == fed and term != b"\r"))
        out_events, out_tail = split_events(out)
        assert len(out_events) == done
        assert out_tail == b""
    out += patcher.flush()
    assert out == whole  # independent of how the input was chunked



@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(usage_payload(), null_usage_payload(), non_usage_payload()), min_size=1, max_size=6),
    st.sampled_from([b"data: ", b"data:"]),
)
@example([{"choices": [], "usage": {"prompt_tokens": 0}, "model": 3.43723854294319e-05}], b"data: ")
def test_engine_framed_chunks_are_patched_byte_exact_one_event_at_a_time(payloads: list[Any], prefix: bytes) -> None:
    """vLLM, SGLang and OpenAI send each chunk as one ``data:`` line and a blank line, LF
    only: a usage event comes back as one compact ``data:`` line of exactly its patched
    JSON, every other event as it was. Compared as the client's ``json`` reads it: a float's
    text may change form (``0.0000343723854294319`` and ``3.43723854294319e-05`` are one
    number; a run of 19 digits sends the text through the standard library, json_exact.py)."""
    patcher = SSEPatcher(set_seven)
    for payload in payloads:
        event = prefix + orjson.dumps(payload) + b"\n\n"
        want = expected_patch(event)
        out = patcher.feed(event)
        if want is None:
            assert out == event
        else:
            line = out.removeprefix(b"data: ").removesuffix(b"\n\n")
            assert out == b"data: " + line + b"\n\n" and b"\n" not in line and b"\r" not in line
            assert json.loads(line) == want
    assert patcher.flush() == b""


# -- examples ------------------------------------------------------------------------------

USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":2,"total_tokens":32}}\n\n'
PATCHED_USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 7},
    },
}
TOKEN_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'


def test_usage_event_is_patched_and_neighbours_untouched() -> None:
    stream = TOKEN_EVENT + USAGE_EVENT + b"data: [DONE]\n\n"
    out = run(SSEPatcher(set_seven), [stream])
    events, tail = split_events(out)
    assert tail == b""
    assert events[0] == TOKEN_EVENT
    assert orjson.loads(parse_event(events[1])[0] or b"") == PATCHED_USAGE
    assert events[2] == b"data: [DONE]\n\n"


def test_first_complete_non_usage_event_is_returned_immediately() -> None:
    patcher = SSEPatcher(set_seven)
    assert patcher.feed(TOKEN_EVENT) == TOKEN_EVENT
    first = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\r\n\r\n'
    assert patcher.feed(first) == first
    assert patcher.feed(b"data: partial") == b""
    assert patcher.feed(b"\n\n") == b"data: partial\n\n"
    assert patcher.flush() == b""


@pytest.mark.parametrize("blank", [b"\n", b"\r\n"])
def test_a_stream_that_opens_with_a_blank_line_passes_it_at_once(blank: bytes) -> None:
    """A blank line before any field is an empty event (a keep-alive some servers send
    first): complete, so nothing of it is held; the event after it is patched."""
    patcher = SSEPatcher(set_seven)
    assert patcher.feed(blank) == blank
    assert patcher.feed(USAGE_EVENT[:9]) == b""
    out = patcher.feed(USAGE_EVENT[9:])
    assert orjson.loads(out.removeprefix(b"data: ").removesuffix(b"\n\n")) == PATCHED_USAGE
    assert patcher.flush() == b""


def test_usage_event_is_returned_as_soon_as_its_blank_line_arrives() -> None:
    patcher = SSEPatcher(set_seven)
    assert patcher.feed(USAGE_EVENT[:-1]) == b""
    out = patcher.feed(USAGE_EVENT[-1:])
    assert orjson.loads(out.removeprefix(b"data: ").removesuffix(b"\n\n")) == PATCHED_USAGE


def test_trailing_cr_across_chunks_is_one_crlf() -> None:
    patcher = SSEPatcher(set_seven)
    # "data: x\r" might end with "\r\n": nothing can go out yet.
    assert patcher.feed(b"data: x\r") == b""
    # It was "\r\n", then a CRLF blank line: one event "data: x".
    assert patcher.feed(b"\n\r\n") == b"data: x\r\n\r\n"
    assert patcher.flush() == b""


def test_lone_cr_blank_line_is_held_until_the_next_byte_decides() -> None:
    patcher = SSEPatcher(set_seven)
    assert patcher.feed(b"data: a\r\r") == b""  # the second "\r" may be half of "\r\n"
    assert patcher.feed(b"data: b\n\n") == b"data: a\r\rdata: b\n\n"


def test_unterminated_final_event_goes_out_on_flush_unpatched() -> None:
    patcher = SSEPatcher(set_seven)
    partial = USAGE_EVENT.removesuffix(b"\n\n")
    assert patcher.feed(TOKEN_EVENT + partial) == TOKEN_EVENT
    assert patcher.flush() == partial


def test_unterminated_final_cr_goes_out_on_flush() -> None:
    patcher = SSEPatcher(set_seven)
    assert patcher.feed(b"data: x\n\r") == b""
    assert patcher.flush() == b"data: x\n\r"


def test_drop_verdict_removes_the_event_entirely() -> None:
    def drop_usage_only(payload: dict) -> bool | None:
        if payload.get("choices") == [] and isinstance(payload.get("usage"), dict):
            return False
        return None

    stream = TOKEN_EVENT + b": keepalive\n\n" + USAGE_EVENT + b"data: [DONE]\n\n"
    for chunks in ([stream], [bytes([b]) for b in stream]):
        out = run(SSEPatcher(drop_usage_only), chunks)
        assert out == TOKEN_EVENT + b": keepalive\n\n" + b"data: [DONE]\n\n"
    assert patch_event(USAGE_EVENT, drop_usage_only) == b""


def test_patch_event_keeps_comments_fields_and_terminators() -> None:
    event = (
        b"event: chunk\r\n: note\r\n"
        b'data: {"choices": [],\r\ndata:  "usage": {"prompt_tokens": 5}}\r\nid: 9\r\n\r\n'
    )
    out = patch_event(event, set_seven)
    assert out == (
        b"event: chunk\r\n: note\r\n"
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":7}}}\r\n'
        b"id: 9\r\n\r\n"
    )


def test_multi_line_data_after_a_lone_cr_keeps_its_blank_line() -> None:
    # Found by the Hypothesis test: collapsing data lines into the first one's place put
    # its "\r" right before the "\n" blank line, and "\r\n" is one terminator: the event
    # never ended and swallowed the next one.
    patched_line = (
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":7}}}'
    )
    event = b'data: {"choices": [],\rdata: "usage": {"prompt_tokens": 5}}\r\n\n'
    assert patch_event(event, set_seven) == patched_line + b"\r\n\n"
    with_comment = b'data: {"choices": [],\r: c\rdata: "usage": {"prompt_tokens": 5}}\n\n'
    assert patch_event(with_comment, set_seven) == b": c\r" + patched_line + b"\n\n"

    out = run(SSEPatcher(set_seven), [event + TOKEN_EVENT])
    events, tail = split_events(out)
    assert len(events) == 2 and tail == b""
    assert events[1] == TOKEN_EVENT


def test_patch_event_leaves_null_usage_non_json_and_unchanged_verdicts_alone() -> None:
    assert patch_event(TOKEN_EVENT, set_seven) is None
    assert patch_event(b'data: {"usage": null}\n\n', set_seven) is None
    assert patch_event(b'data: "usage" is not json\n\n', set_seven) is None
    assert patch_event(b'data: ["usage"]\n\n', set_seven) is None
    assert patch_event(b': "usage"\n\n', set_seven) is None
    assert patch_event(USAGE_EVENT, lambda payload: None) is None


NOT_DATA = [b": ab", b"id:1", b":    ", b"id:  ", b"name:", b"data_: ", b"datax", b"dat: ", b"event:"]


@pytest.mark.parametrize("line", NOT_DATA)
def test_only_data_lines_are_data_however_a_line_looks(line: bytes) -> None:
    """A line is data when its field name is exactly ``data`` (WHATWG: the name runs up to its
    first colon, or is the whole line): a 4-byte comment, a field whose value starts at byte
    5, a ``data_`` field, each holding usage JSON, stays as the client reads it, unpatched and
    in its place; the usage in the event's real data line is patched."""
    usage_json = USAGE_EVENT.removeprefix(b"data: ").removesuffix(b"\n\n")
    alone = line + usage_json + b"\n\n"
    beside = line + usage_json + b"\r\n" + USAGE_EVENT + b"event: usage\n" + line + b"\n\n"
    stream = alone + beside + TOKEN_EVENT
    for chunks in ([stream], [bytes([b]) for b in stream]):
        out = run(SSEPatcher(set_seven), chunks)
        assert_patched_stream(stream, out)
        events, _ = split_events(out)
        assert events[0] == alone
        assert orjson.loads(parse_event(events[1])[0] or b"") == PATCHED_USAGE


def test_a_bare_data_line_is_data_and_the_event_still_ends_where_it_did() -> None:
    """``data`` alone is a data line with an empty value (an empty line in the JSON, which
    JSON allows). As the last data line, before a blank line after a lone CR, it is where the
    patched line goes: put anywhere else, its CR would meet the blank line's LF, one line
    end, and the event would swallow the next one."""
    usage_json = USAGE_EVENT.removeprefix(b"data: ").removesuffix(b"\n\n")
    stream = (b"data: " + usage_json + b"\rdata\r\n\n" + TOKEN_EVENT
              + b"data\r: c\rdata:" + usage_json + b"\rdata\r\n\n" + TOKEN_EVENT)
    out = run(SSEPatcher(set_seven), [stream])
    assert_patched_stream(stream, out)
    events, _ = split_events(out)
    assert [events[1], events[3]] == [TOKEN_EVENT, TOKEN_EVENT]
    assert parse_event(events[2])[1] == [b": c"]


@pytest.mark.parametrize("event", [
    b'data: {"choices":[{"index":0,"delta":{},"usage":null}],"usage":{"prompt_tokens":30}}\n\n',
    b'data: {"usage": null, "choices": [], "usage": {"prompt_tokens": 30}}\n\n',  # the last key wins
    b'data: {"choices":[],\ndata: "x":{"usage":null},"usage":{"prompt_tokens":30}}\r\n\r\n',
], ids=["null-in-a-choice", "twice", "multi-line"])
def test_a_real_usage_beside_a_null_one_is_patched(event: bytes) -> None:
    """``"usage": null`` is skipped unparsed only when it is the event's one usage: a real
    usage object beside it is patched as the client reads it."""
    out = run(SSEPatcher(set_seven), [event])
    assert json.loads(parse_event(out)[0] or b"")["usage"] == {
        "prompt_tokens": 30, "prompt_tokens_details": {"cached_tokens": 7}}


def test_data_lines_join_with_a_line_feed_so_json_they_split_is_not_patched() -> None:
    """``12`` and ``34`` on two data lines are ``12\\n34`` to the client: no JSON, so the event
    goes on as it came, never read as 1234 and rewritten."""
    split = b'data: {"choices":[],"usage":{"prompt_tokens":12\ndata: 34}}\n\n'
    assert run(SSEPatcher(set_seven), [split + USAGE_EVENT])[: len(split)] == split
    assert patch_event(split, set_seven) is None


# -- oversize -----------------------------------------------------------------------------

BIG_USAGE = (
    b'data: {"choices":[],"pad":"' + b"x" * 200 + b'","usage":{"prompt_tokens":30}}\n\n'
)


def test_oversize_event_passes_through_unpatched_and_later_events_are_patched() -> None:
    calls: list[str] = []
    patcher = SSEPatcher(set_seven, max_event_bytes=128, on_oversize=calls.append)
    stream = TOKEN_EVENT + BIG_USAGE + USAGE_EVENT + b"data: [DONE]\n\n"
    chunks = [stream[i : i + 16] for i in range(0, len(stream), 16)]
    out = run(patcher, chunks)

    events, tail = split_events(out)
    assert tail == b""
    assert events[0] == TOKEN_EVENT
    assert events[1] == BIG_USAGE  # unpatched, byte for byte
    assert orjson.loads(parse_event(events[2])[0] or b"") == PATCHED_USAGE
    assert events[3] == b"data: [DONE]\n\n"
    assert calls == ["event_too_large"]


def test_each_oversize_event_is_reported_once() -> None:
    calls: list[str] = []
    patcher = SSEPatcher(set_seven, max_event_bytes=128, on_oversize=calls.append)
    stream = BIG_USAGE + USAGE_EVENT + BIG_USAGE.replace(b"\n", b"\r\n")
    out = run(patcher, [bytes([b]) for b in stream])
    events, _ = split_events(out)
    assert events[0] == BIG_USAGE
    assert orjson.loads(parse_event(events[1])[0] or b"") == PATCHED_USAGE
    assert events[2] == BIG_USAGE.replace(b"\n", b"\r\n")
    assert calls == ["event_too_large"] * 2


def test_the_rest_of_an_oversize_event_passes_as_it_comes() -> None:
    """Once an event went out unpatched for its size, each later part of it goes to the
    client as it arrives, however small, not held again up to ``max_event_bytes``."""
    patcher = SSEPatcher(set_seven, max_event_bytes=128)
    assert patcher.feed(BIG_USAGE[:150]) == BIG_USAGE[:150]
    for i in range(150, len(BIG_USAGE) - 2, 7):
        part = BIG_USAGE[i : min(i + 7, len(BIG_USAGE) - 2)]
        assert patcher.feed(part) == part
    out = patcher.feed(b"\n\n" + USAGE_EVENT)  # its end, then an ordinary event: patched
    assert out[:2] == b"\n\n" and orjson.loads(out[2:].removeprefix(b"data: ")) == PATCHED_USAGE


def test_byte_by_byte_holds_at_most_the_current_partial_event() -> None:
    max_event = 48
    patcher = SSEPatcher(set_seven, max_event_bytes=max_event)
    stream = (
        TOKEN_EVENT
        + b": " + b"c" * 100 + b"\r\n"  # a long comment line, then more lines of one event
        + b"data: " + b"d" * 100 + b"\r"
        + b"id: 1\r\r"
        + b"data: short\n\n"
        + b"data: \xe2\x80\xa8\x1c\xf0\x9f\x98\x80\n\n"
    )
    ends = event_end_offsets(stream)
    out = b""
    for i in range(len(stream)):
        out += patcher.feed(stream[i : i + 1])
        fed = i + 1
        assert stream.startswith(out)  # nothing here is about usage: a prefix, in order
        complete = [end for end, term in ends if end < fed or (end == fed and term != b"\r")]
        partial_start = max(complete, default=0)
        held = fed - len(out)
        assert held <= fed - partial_start  # never more than the partial event
        assert held <= max_event  # and never more than the limit
    assert out + patcher.flush() == stream


def test_a_partial_event_within_its_free_bytes_takes_none_of_the_process_budget() -> None:
    """What a partial event holds past its free bound is counted in its process's
    budget, nothing below it: beside one within its bound, another is held (and patched) up
    to the budget's last byte, and one byte more goes on unpatched, as the budget's."""
    budget, calls = ResponseBudget(100), []

    def patcher(max_event_bytes: int = 1_000) -> SSEPatcher:
        return SSEPatcher(set_seven, max_event_bytes=max_event_bytes, budget=(ResponseHold(budget), 50),
                          on_oversize=calls.append)

    small = patcher()
    assert small.feed(USAGE_EVENT[:30]) == b""  # held, 20 bytes within its free 50
    padded = USAGE_EVENT.replace(b'{"choices"', b'{"pad":"' + b"x" * 52 + b'","choices"')
    assert len(padded) == 152  # 150 before its blank line: 100 past the free 50
    fits = patcher()
    assert fits.feed(padded[:-2]) == b""
    assert orjson.loads(fits.feed(b"\n\n").removeprefix(b"data: "))["usage"] == PATCHED_USAGE["usage"]
    wider = padded.replace(b'"pad":"', b'"pad":"x')
    past = patcher(max_event_bytes=len(wider) - 2)  # at its own bound, not past it: the budget's
    assert past.feed(wider[:-2]) + past.feed(b"\n\n") == wider  # as the upstream sent it
    assert calls == [BUDGET_FULL]
    assert small.feed(USAGE_EVENT[30:]) != USAGE_EVENT  # the small one patched all along
