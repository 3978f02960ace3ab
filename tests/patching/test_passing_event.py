"""The usage of a stream event too large to hold, read as it passes, against an SSE parser that
is not ours: the ``openai`` SDK's (the WHATWG algorithm: lines on ``\\r\\n``, ``\\r`` or ``\\n``,
data lines joined with ``\\n``, comments and other fields skipped), then ``json.loads``."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder

from proxy.bench.processes import rss_kib
from proxy.patching.passing_event import PassingEvent, oversized_reader
from proxy.patching.shapes.messages import SHAPE as MESSAGES
from proxy.patching.shapes.responses import SHAPE as RESPONSES, TERMINAL
from proxy.patching.sse import SSEPatcher

RESPONSE_EVENTS = RESPONSES.event_holders

#: Strings full of what could pass for structure, in JSON and in SSE: quotes, brackets, line
#: ends (escaped in the JSON: they never end a line), "usage", "data:" and a blank line.
_TEXT = st.lists(st.sampled_from(['a', '"', '\\', 'usage', '"usage":', '{', '}', ':', ',', ' ', 'é', '\n', '\r',
                                  'data: ', '\n\n', ': c', 'response', '\u2028']), max_size=6).map("".join)
_VALUE = st.recursive(
    st.one_of(st.integers(-5, 10**6), st.integers(-(2**70), 2**70), st.none(), st.booleans(), _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(_TEXT, st.sampled_from(["usage", "model", "type"])), inner,
                                            max_size=3)),
    max_leaves=12,
)
_USAGE = st.none() | st.fixed_dictionaries(
    {"input_tokens": st.integers(0, 10**9)},
    optional={"output_tokens": st.integers(0, 10**6), "input_tokens_details": st.fixed_dictionaries(
        {"cached_tokens": st.integers(0, 10**6)}), "cost": st.floats(0, 10, allow_nan=False)})
_TYPES = st.sampled_from(["response.completed", "response.incomplete", "response.failed", "response.created"])


@st.composite
def _payloads(draw: st.DrawFn) -> dict[str, Any]:
    """A Responses event: the response echoes the client's objects (any keys: "usage",
    "model", "type" too) before, or after, its own model and usage."""
    response = draw(st.dictionaries(_TEXT.filter(lambda k: k not in ("usage", "model")), _VALUE, max_size=3))
    if draw(st.booleans()):
        response["model"] = draw(_TEXT | st.integers(0, 3))
    response["usage"] = draw(_USAGE | _VALUE)
    response["metadata"] = draw(_VALUE)
    order = draw(st.permutations(list(response)))
    event = {"type": draw(_TYPES | _VALUE), "sequence_number": 3, "response": {k: response[k] for k in order}}
    return {k: event[k] for k in draw(st.permutations(list(event)))}


#: Lines an event may hold beside its data: comments, other fields, "data" look-alikes that
#: are other fields, and (spoiling the JSON, so nothing is billed) a data line of its own.
_OTHER_LINES = st.sampled_from([b": usage", b":", b"event: response.completed", b"id: 7", b"retry: 5",
                                b"dat: x", b"data : x", b"Data: x", b"datax", b"data", b"data:", b"data: x",
                                b'data: {"usage": {"input_tokens": 1}}'])
_ENDS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def _events(draw: st.DrawFn) -> bytes:
    """One event's bytes: its JSON on one data line or over several, ``data:`` with a space or
    none, other lines among them, each line ended as the server likes, then its blank line."""
    text = json.dumps(draw(_payloads()), ensure_ascii=draw(st.booleans()),
                      indent=draw(st.none() | st.integers(0, 2))).encode()
    lines = [draw(st.sampled_from([b"data:", b"data: ", b"data:  "])) + line for line in text.split(b"\n")]
    for _ in range(draw(st.integers(0, 3))):
        lines.insert(draw(st.integers(0, len(lines))), draw(_OTHER_LINES))
    return b"".join(line + draw(_ENDS) for line in lines) + draw(_ENDS)


def _expected(data: str) -> dict[str, Any] | None:
    """What billing should get of one dispatched event: its type, if a terminal one, its
    response's model and usage (the reduced payload :class:`PassingEvent` hands over), or ``None``."""
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    response = payload.get("response") if isinstance(payload, dict) else None
    kind = payload.get("type") if isinstance(payload, dict) else None
    if not (isinstance(response, dict) and isinstance(response.get("usage"), dict) and isinstance(kind, str)
            and kind in TERMINAL):
        return None
    model = response.get("model")
    return {"type": payload["type"], "response": {"object": "response", **({"model": model} if isinstance(
        model, str) else {}), "usage": response["usage"]}}


def _oracle(stream: bytes) -> list[dict[str, Any] | None]:
    return [_expected(event.data) for event in SSEDecoder().iter_bytes(iter([stream]))]


def _cut(data: bytes, rnd: random.Random, most: int = 10) -> list[bytes]:
    cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, rnd.randint(0, most))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def _billed(parts: Iterable[bytes]) -> list[dict[str, Any]]:
    """What one event's reader bills, fed ``parts`` in order."""
    billed: list[dict[str, Any]] = []
    reader = PassingEvent(RESPONSE_EVENTS, {"object": "response"}, billed.append)
    for part in parts:
        reader.feed(part)
    return billed


@settings(max_examples=600, deadline=None)
@given(_events(), st.randoms())
def test_an_events_usage_is_read_as_the_client_parses_it_wherever_its_bytes_are_cut(
        event: bytes, rnd: random.Random) -> None:
    billed = _billed(_cut(event, rnd))
    dispatched = _oracle(event)  # a "\r" before the blank line's "\n" fuses into one line end: none
    assert billed == [e for e in dispatched[:1] if e is not None]


@settings(max_examples=300, deadline=None)
@given(st.lists(_events() | st.sampled_from([b": keep-alive\n\n", b"data: [DONE]\n\n", b"data: x\r\n\r\n",
                                              b"data:\n\n", b"\n", b"event: ping\ndata: {}\n\n"]),
                min_size=1, max_size=5), st.integers(16, 400), st.randoms())
def test_a_stream_bills_what_its_client_reads_whichever_events_are_too_large_to_hold(
        events: list[bytes], bound: int, rnd: random.Random) -> None:
    """Through the SSE patcher: an event held whole is patched (here only read), one past its
    bound is read as it passes; together they are each usage the client's parser reads, and
    the stream goes out byte for byte however it was cut."""
    stream = b"".join(events)
    seen: list[dict[str, Any]] = []

    def held(payload: dict[str, Any]) -> None:
        seen.append(payload)

    patcher = SSEPatcher(held, max_event_bytes=bound,
                         read_oversized=lambda: PassingEvent(RESPONSE_EVENTS, {"object": "response"}, seen.append).feed)
    out = b"".join(patcher.feed(part) for part in _cut(stream, rnd, 30)) + patcher.flush()
    assert out == stream
    read = [_expected(json.dumps(payload)) for payload in seen]
    assert [e for e in read if e is not None] == [e for e in _oracle(stream) if e is not None]


def test_a_bare_data_line_and_a_value_split_after_its_colon_are_data() -> None:
    """``data`` alone is a data line with an empty value (joined with ``\\n``: JSON whitespace);
    a value may start in the part after its colon, with the space the client drops there."""
    parts = (b"da", b"ta", b"\r", b"\ndata:", b" ", b'{"type": "response.completed", "response":\r',
             b'data: {"model": "m", "usage": {"input_tokens": 3}}}\r', b"\r")
    assert _billed(parts) == [{"type": "response.completed",
                       "response": {"object": "response", "model": "m", "usage": {"input_tokens": 3}}}]


def test_a_line_end_cut_after_its_cr_is_one_line_end_and_the_next_ones_count() -> None:
    """A ``\\r\\n`` cut between its bytes is one line end; the ``\\n`` of a later part, after a
    part with no line end, is a line end of its own: were it taken for the same ``\\r\\n``,
    the blank line would be missed and the event not billed."""
    event = b'data: {"type": "response.completed",\r\ndata: "response": {"usage": {"input_tokens": 3}}}\n\n'
    parts = (event[:37], event[37:-2], b"\n", b"\n")
    assert parts[0].endswith(b"\r") and b"".join(parts) == event
    assert _billed(parts) == [e for e in _oracle(event) if e is not None] == [
        {"type": "response.completed", "response": {"object": "response", "usage": {"input_tokens": 3}}}]


def test_a_usage_written_twice_is_the_last_as_the_client_reads_it() -> None:
    """No server writes a key twice, but a wrong figure is worse than none: where one did, the
    client's ``json.loads`` keeps the last, and so does the bill."""
    data = b'{"type": "response.completed", "response": {"usage": {"input_tokens": 5}, "usage": {"input_tokens": 7}}}'
    billed = _billed((b"data: ", data[:70], data[70:], b"\n", b"\n"))
    assert [_expected(json.dumps(payload)) for payload in billed] == _oracle(b"data: " + data + b"\n\n")
    assert billed[0]["response"]["usage"] == {"input_tokens": 7}


def test_an_event_of_long_strings_passing_holds_none_of_them() -> None:
    """vLLM writes an event's ``type`` last, so its parser reads the whole event: it held each
    long string a part cut whole (four terminal events echoing 24 MiB of instructions held 113
    MiB passing), as the usage's parser did before its strings were left out."""
    data = json.dumps({"response": {"id": "r", "instructions": "x" * (24 << 20), "model": "m",
                                    "usage": {"input_tokens": 5}},
                       "sequence_number": 9, "type": "response.completed"}).encode()
    event = b"event: response.completed\ndata: " + data + b"\n\n"
    parts = [event[k : k + (1 << 20)] for k in range(0, len(event), 1 << 20)]
    billed: list[dict[str, Any]] = []
    before = rss_kib(os.getpid())
    readers = [PassingEvent(RESPONSE_EVENTS, {"object": "response"}, billed.append) for _ in range(4)]
    for reader in readers:
        for part in parts[:-1]:
            reader.feed(part)
    assert rss_kib(os.getpid()) - before < 16 << 10  # KiB
    readers[0].feed(parts[-1])
    assert billed == [{"type": "response.completed",
                       "response": {"object": "response", "model": "m", "usage": {"input_tokens": 5}}}]


def test_an_escape_json_has_not_in_a_long_string_holds_nothing_after_it() -> None:
    """A backslash that no escape of JSON follows ends the read there (the client refuses the
    event); were it taken for an escape a part cut, to be read with the next part, the rest
    of the event would be held, part after part, to its end."""
    event = (b'data: {"type": "response.completed", "response": {"instructions": "\\q' + b"x" * (24 << 20)
             + b'", "model": "m", "usage": {"input_tokens": 5}}}\n\n')
    parts = [event[k : k + (1 << 20)] for k in range(0, len(event), 1 << 20)]
    billed: list[dict[str, Any]] = []
    before = rss_kib(os.getpid())
    readers = [PassingEvent(RESPONSE_EVENTS, {"object": "response"}, billed.append) for _ in range(4)]
    for reader in readers:
        for part in parts:
            reader.feed(part)
    assert rss_kib(os.getpid()) - before < 16 << 10  # KiB
    assert billed == []


#: A long string's bytes that the client's parser refuses (UTF-8, then ``json.loads``): an
#: escape JSON has not, whole or cut short, a control character, bytes that are not UTF-8 (an
#: encoded surrogate, a character cut short by the string's end); and some that it takes.
_REFUSED = [b"\\q", b"\\u12G4", b"\\u12", b"\x01", b"\xff", b"\xed\xa0\x80", b"\xc3"]
_TAKEN = [b"\\u00e9\\n\\\\\\/", "é😀".encode(), b"\x7f"]


@pytest.mark.parametrize("inside", _REFUSED + _TAKEN + [b"\ndata: more"])
def test_a_long_string_the_client_cannot_parse_keeps_its_event_off_the_bill(inside: bytes) -> None:
    """A string past ``ShortStrings.KEPT`` is left out of the read, but not what makes it no
    JSON: such an event was billed, though its client's parser fails on it. Cut at every byte
    around it; the last case's line break comes from joining two data lines."""
    head = b'data: {"type": "response.completed", "response": {"instructions": "' + b"x" * 5000
    event = head + inside + b'", "model": "m", "usage": {"input_tokens": 5}}}\n\n'
    try:
        expected = [e for e in _oracle(event) if e is not None]
    except UnicodeDecodeError:  # the client's SSE parser decodes each line as UTF-8
        expected = []
    assert (expected == []) is (inside not in _TAKEN)
    for at in range(len(head) - 2, len(head) + len(inside) + 2):
        assert _billed((event[:1000], event[1000:at], event[at:])) == expected, at


@pytest.mark.parametrize("last", ["response.output_text.done", "response.incomplete"])
def test_a_type_written_twice_is_the_last_as_the_client_reads_it(last: str) -> None:
    """No server writes a key twice, but where one did the client's ``json.loads`` keeps the
    last ``type``: an event it reads as ``response.output_text.done`` has no usage to it, and
    was billed as the ``response.completed`` written first."""
    data = ('{"type": "response.completed", "response": {"model": "m", "usage": {"input_tokens": 5}}, '
            f'"type": "{last}"}}').encode()
    event = b"data: " + data + b"\n\n"
    expected = [e for e in _oracle(event) if e is not None]
    assert [e["type"] for e in expected] == ([] if last.endswith(".done") else [last])
    for at in range(len(data) - 40, len(event)):
        assert _billed((event[:at], event[at:])) == expected, at


def test_a_control_character_in_a_long_string_is_not_taken_for_its_end() -> None:
    """The read of a long string stops at a control character as at its closing quote: were
    it taken for that quote, what follows it would be read as JSON, here a usage the client
    never reads (its parser refuses the string, so the event), and billed."""
    head = b'data: {"type": "response.completed", "response": {"instructions": "' + b"x" * 5000
    event = head + b'\x01, "usage": {"input_tokens": 99}, "x": "", "model": "m"}}\n\n'
    assert _oracle(event) == [None]
    for at in range(len(head) - 2, len(head) + 3):
        assert _billed((event[:1000], event[1000:at], event[at:])) == [], at


def test_an_event_whose_utf8_ijson_refuses_is_not_billed_and_raises_nothing() -> None:
    """A surrogate written in UTF-8 in a short string: ijson raised ``UnicodeDecodeError`` out
    of the reader, which cut the stream; the client's SSE parser refuses the line too."""
    event = (b'data: {"response": {"model": "m\xed\xa0\x80", "usage": {"input_tokens": 5}}, '
             b'"type": "response.completed"}\n\n')
    assert _billed([event]) == []


def test_data_lines_are_joined_with_a_line_end_so_a_number_they_split_is_no_number() -> None:
    """The client joins ``data: 1`` and ``data: 2`` as ``1\\n2``: two values, no JSON, so it
    reads no usage there; were the lines joined as ``12``, the bill would read 12 tokens."""
    event = b'data: {"type": "response.completed", "response": {"usage": {"input_tokens": 1\ndata: 2}}}\n\n'
    assert _oracle(event) == [None]
    assert _billed([event]) == []


def test_an_event_without_a_type_is_not_billed() -> None:
    """A usage in an event whose data has no top-level ``type`` is no terminal event's: the
    client reads none there, and the reader bills none."""
    event = b'data: {"response": {"model": "m", "usage": {"input_tokens": 12}}}\n\n'
    assert _oracle(event) == [None]
    assert _billed([event]) == []


def _read_as(shape: Any, event: bytes) -> list[dict[str, Any]]:
    """What the reader ``oversized_reader`` makes for ``shape``'s stream bills, fed ``event`` in
    parts of 7 bytes."""
    billed: list[dict[str, Any]] = []
    feed = oversized_reader(shape, billed.append)()
    for at in range(0, len(event), 7):
        feed(event[at:at + 7])
    return billed


@pytest.mark.parametrize(("chunk", "choices"), [
    ({"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 7}}, []),
    ({"id": "c", "model": "m", "choices": [{"index": 2, "delta": {"content": "a"}, "logprobs": {
        "content": [{"token": "\"index\": 9", "top_logprobs": [{"index": 5}]}]}}], "usage": {"prompt_tokens": 7}},
     [{"index": 2}]),
])
def test_a_chat_chunk_bills_its_usage_with_which_choice_it_is(chunk: dict[str, Any], choices: list[Any]) -> None:
    """A chat or completions chunk has no type: its top-level usage and model are read, with the
    ``index`` of each choice (a usage-only chunk has none), never an ``index`` deeper or in text,
    so that a choice's usage is taken for that choice's, as the held chunk's is."""
    assert _read_as(None, b"data: " + json.dumps(chunk).encode() + b"\n\n") == [
        {"model": "m", "usage": {"prompt_tokens": 7}, "choices": choices}]


def test_a_chat_chunk_without_usage_or_cut_short_bills_nothing() -> None:
    assert _read_as(None, b'data: {"model": "m", "choices": [{"index": 0}], "usage": null}\n\n') == []
    assert _read_as(None, b'data: {"model": "m", "choices": [], "usage": {"prompt_tokens": 7}\n\n') == []


def test_messages_events_bill_the_usage_where_each_type_holds_it() -> None:
    """``message_start`` holds its model and usage in ``message``, ``message_delta`` at its top
    level; a ``"usage"`` elsewhere in either is not read for them."""
    start = {"message": {"type": "message", "model": "m", "usage": {"input_tokens": 3}}, "type": "message_start",
             "usage": {"input_tokens": 99}}
    delta = {"type": "message_delta", "message": {"usage": {"output_tokens": 99}}, "usage": {"output_tokens": 9}}
    assert _read_as(MESSAGES, b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n") == [
        {"type": "message_start", "message": {"type": "message", "model": "m", "usage": {"input_tokens": 3}}}]
    assert _read_as(MESSAGES, b"event: message_delta\ndata: " + json.dumps(delta).encode() + b"\n\n") == [
        {"type": "message_delta", "usage": {"output_tokens": 9}}]
    assert _read_as(MESSAGES, b'data: {"type": "ping", "usage": {"input_tokens": 3}}\n\n') == []
