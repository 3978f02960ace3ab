"""The usage of one stream event too large to hold, read as the event's bytes pass.

A Responses stream's terminal event (``response.completed``, ``response.incomplete``,
``response.failed``) holds the whole response object: its output, with logprobs when asked
(``top_logprobs`` on some 55,000 tokens passes the 64 MiB ``max_response_bytes``), and what
it echoes of the request. Past that bound the SSE patcher passes the event on as it comes
(:mod:`proxy.patching.sse`); were it not read, a client could keep its prompt off the bill.

So its bytes are read as they go out, as a JSON body's are (:mod:`proxy.patching.passing_usage`):
the event is split into lines on ``\\r\\n``, ``\\r`` or ``\\n`` (a ``\\r`` ending one part and
a ``\\n`` starting the next are one line end), and the value of each ``data`` field (after
``data:``, or none for a bare ``data`` line) goes to ijson, a ``\\n`` between two such values,
which is the data the WHATWG algorithm and the client's SSE parser build and ``json.loads``
(the one space the client drops after ``data:`` is read: it stands where JSON may have a
space, or in a string that the ``\\n`` before it already made no JSON). Other fields and
comments (``:``) are skipped. What is read: the data's top-level ``type``, and its
``response`` object's ``model`` and ``usage`` (the event's other top-level keys are the
server's own; ``"usage"`` keys the client echoes sit deeper). The event is billed at its
blank line, as the client dispatches it, and only if its data is one JSON value throughout,
as the client parses it (the usage's parser reads on to the end: the usage comes last, or
nearly, in a response object; a usage written twice is the last, as ``json.loads`` keeps
it, a model the first); an event the stream cuts short is not dispatched, so not billed
either, as one held whole and cut is not. A wrong figure is worse
than none: such an event's tokens stay unknown.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import ijson

from proxy.patching.passing_usage import UNREADABLE, PassingUsage
from proxy.patching.shapes.base import Shape
from proxy.patching.short_strings import ShortStrings

_TERMINATOR = re.compile(rb"\r\n|\r|\n")
_DATA = b"data:"
#: Where the current line stands: its first bytes still read, in a data value, or skipped.
_HEAD, _VALUE, _SKIP = 0, 1, 2

#: Where the reader hands the event's payload, as far as it was read: the same call that
#: patches an event held whole, so the figures are resolved and noted the same way.
Bill = Callable[[dict[str, Any]], object]


class PassingEvent:
    """Feed one event's bytes in order, through its blank line (:meth:`feed`); at that line,
    ``bill`` is called with ``{"type": ..., holder: {**kind, "model": ..., "usage": ...}}``
    once the data's ``holder.usage`` was read (``kind``: a shape's ``body_kind``), in an event
    of one of ``types``. The others are read no further than their type: a long output with
    logprobs makes several events that large (vLLM's ``response.output_text.done``,
    ``response.output_item.done``), none with a usage. vLLM writes ``type`` last (its fields
    in the order of OpenAI's models), so its events are read to their end all the same."""

    __slots__ = ("_usage", "_billed_types", "_holder", "_bill", "_short", "_type_parser", "_type_read", "_state",
                 "_head", "_data_lines", "_cr", "_done")

    def __init__(self, holder: str, kind: Mapping[str, str], bill: Bill, types: frozenset[str]) -> None:
        self._usage: PassingUsage | None = PassingUsage(kind, at=holder, whole=True)  # None: no usage to read
        self._billed_types = types
        self._holder, self._bill = holder, bill
        # Both parsers read the data with its long strings left out: else yajl holds each one a
        # part cuts whole (vLLM writes ``type`` last, so its parser reads the whole event).
        self._short = ShortStrings()
        self._type_read = ijson.sendable_list()
        self._type_parser: Any = ijson.items_coro(self._type_read, "type")  # None once read or past reading
        self._state = _HEAD
        self._head = b""  # the line's first bytes, until they tell whether it is a data line
        self._data_lines = 0
        self._cr = False  # the last part ended with "\r": a "\n" next is the same line end
        self._done = False  # the blank line came

    def feed(self, part: bytes) -> None:
        at = 1 if self._cr and part[:1] == b"\n" else 0
        self._cr = False
        while at < len(part) and not self._done:
            end = _TERMINATOR.search(part, at)
            self._line(part[at:] if end is None else part[at:end.start()])
            if end is None:
                return
            self._line_end()
            self._cr = end.group() == b"\r" and end.end() == len(part)
            at = end.end()

    def _line(self, text: bytes) -> None:
        """Some of the current line's bytes, up to its end or the part's."""
        if self._state == _HEAD:
            head = self._head + text[:len(_DATA) - len(self._head)]
            text = text[len(head) - len(self._head):]
            self._head = head
            if not _DATA.startswith(head):
                self._state = _SKIP  # another field or a comment: skipped to its end
                return
            if head != _DATA:
                return  # "data" so far: it ends the line (a bare data line) or goes on to its colon
            self._data_started()
            self._state = _VALUE
        if self._state == _VALUE:
            self._read(text)

    def _line_end(self) -> None:
        if self._state == _HEAD and not self._head:
            self._dispatch()  # a blank line
        elif self._state == _HEAD and self._head == b"data":
            self._data_started()  # a bare "data" line: an empty value
        self._state, self._head = _HEAD, b""

    def _data_started(self) -> None:
        if self._data_lines:
            self._read(b"\n")  # the data's lines are joined with "\n"
        self._data_lines += 1

    def _read(self, data: bytes, last: bool = False) -> None:
        if not (data or last) or self._usage is None:
            return
        data = self._short.cut(data)
        self._usage.read(data, last)
        if self._type_parser is None:
            return
        try:
            if data:
                self._type_parser.send(data)
            if last:
                self._type_parser.close()
        except UNREADABLE:  # not JSON from here: no type to read
            self._type_parser = None
        if self._type_read:
            self._type_parser = None
            kind = self._type_read[0]
            if not isinstance(kind, str) or kind not in self._billed_types:
                self._usage = None

    def _dispatch(self) -> None:
        self._done = True
        if not self._data_lines:
            return  # no data: the client dispatches nothing
        self._read(b"", last=True)
        read = None if self._usage is None else self._usage.payload()
        if read is not None and self._type_read:
            self._bill({"type": self._type_read[0], self._holder: read})


def oversized_reader(shape: Shape | None, bill: Bill) -> Callable[[], Callable[[bytes], None]] | None:
    """What makes a reader for each event of ``shape``'s stream too large to hold, or ``None``
    where its events carry no usage so large (chat, completions, Messages: a small usage chunk)."""
    if shape is None or (holder := shape.event_holder) is None:
        return None
    return lambda: PassingEvent(holder, shape.body_kind, bill, shape.final_events).feed
