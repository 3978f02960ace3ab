"""The usage of one stream event too large to hold, read as the event's bytes pass.

A Responses stream's terminal event (``response.completed``, ``response.incomplete``,
``response.failed``) holds the whole response object: its output, with logprobs when asked
(``top_logprobs`` on some 55,000 tokens passes the 64 MiB ``max_response_bytes``), and what
it echoes of the request. Past that bound the SSE patcher passes the event on as it comes
(:mod:`proxy.patching.sse`); were it not read, a client could keep its prompt off the bill.
The other streams' usage events are small as engines write them, but an upstream that echoes
the request's ``model`` in each (llama.cpp) makes every chat or completions chunk, and
Messages' ``message_start``, as large as the name a client sends: past ``max_event_bytes``
(1 MiB) the usage chunk went out unread, and the record had no prompt.

So its bytes are read as they go out, as a JSON body's are (:mod:`proxy.patching.passing_usage`):
the event is split into lines on ``\\r\\n``, ``\\r`` or ``\\n`` (a ``\\r`` ending one part and
a ``\\n`` starting the next are one line end), and the value of each ``data:`` field goes to
ijson, a ``\\n`` between two such values, which is the data the WHATWG algorithm and the
client's SSE parser build and ``json.loads`` (the one space the client drops after ``data:``
is read: it stands where JSON may have a space, or in a string that the ``\\n`` before it
already made no JSON). Other fields and comments (``:``) are skipped, and so is a bare
``data`` line: its empty value adds a ``\\n`` to the data, where JSON may have one or in a
string the ``\\n`` of the next join spoils, or makes data that is no JSON alone.
What is read: the data's top-level ``type``, and the ``model``
and ``usage`` of the member that holds them in an event of that type: a Responses terminal
event's ``response`` object, Messages' ``message_start``'s ``message``, and the top level of
its ``message_delta`` and of a chat or completions chunk, with its choices' ``index`` (the
event's other top-level keys are the server's own; ``"usage"`` keys the client echoes sit
deeper). The event is billed at its
blank line, as the client dispatches it, and only if its data is one JSON value throughout,
as the client parses it (the usage's parser reads on to the end: the usage comes last, or
nearly, in a response object; a usage written twice is the last, as ``json.loads`` keeps
it, and so is a type, a model the first); an event the stream cuts short is not dispatched,
so not billed either, as one held whole and cut is not. A wrong figure is worse than none:
such an event's tokens stay unknown (a terminal type written after another type is one).
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
#: Where the current line stands: its first bytes still read, or in a data value.
_HEAD, _VALUE = 0, 1

#: Where the reader hands the event's payload, as far as it was read: the same call that
#: patches an event held whole, so the figures are resolved and noted the same way.
Bill = Callable[[dict[str, Any]], object]


class PassingEvent:
    """Feed one event's bytes in order, through its blank line and no further, as the SSE
    patcher does (:meth:`feed`); at that line, ``bill`` is called with the data's payload as
    far as its figures go, once a usage was read.
    ``reads`` names, for each event ``type`` billed, the member of the data that holds its
    ``model`` and ``usage`` (``""``: the data itself; under a member, with ``kind`` beside
    them: a shape's ``body_kind``), so ``{"type": ..., holder: {**kind, "model": ...,
    "usage": ...}}``. Events of other types are read no further than their type: a long output
    with logprobs makes several events that large (vLLM's ``response.output_text.done``,
    ``response.output_item.done``), none with a usage. vLLM writes ``type`` last (its fields in
    the order of OpenAI's models), so its events are read to their end all the same. An event
    of a stream whose events have no type (chat and completions chunks: ``reads`` keyed
    ``None``) is read whole, with the ``index`` of each of its ``choices``, which tells a
    usage-only chunk (none) from a choice's (one, and which), as the held chunk's ``choices``
    tells them (:mod:`proxy.patching.usage`): ``{"model": ..., "usage": ..., "choices":
    [{"index": ...}]}``."""

    __slots__ = ("_reads", "_usages", "_bill", "_short", "_type_parser", "_type_read", "_index_parser",
                 "_indices", "_state", "_head", "_data_lines", "_cr")

    def __init__(self, reads: Mapping[str | None, str], kind: Mapping[str, str], bill: Bill) -> None:
        self._reads = reads
        # One reader a holder, each dropped once the type names another (None: no usage to read).
        self._usages: dict[str, PassingUsage] | None = {
            holder: PassingUsage(kind if holder else {}, at=holder, whole=True) for holder in set(reads.values())}
        self._bill = bill
        # The parsers read the data with its long strings left out: else yajl holds each one a
        # part cuts whole (vLLM writes ``type`` last, so its parser reads the whole event).
        self._short = ShortStrings()
        untyped = None in reads
        self._type_read = ijson.sendable_list()
        # None once read or past reading, or where the stream's events have none.
        self._type_parser: Any = None if untyped else ijson.items_coro(self._type_read, "type")
        self._indices = ijson.sendable_list()
        self._index_parser: Any = ijson.items_coro(self._indices, "choices.item.index") if untyped else None
        self._state = _HEAD
        self._head = b""  # the line's first bytes, until they tell whether it is a data line
        self._data_lines = 0
        self._cr = False  # the last part ended with "\r": a "\n" next is the same line end

    def feed(self, part: bytes) -> None:
        at = 1 if self._cr and part[:1] == b"\n" else 0
        self._cr = False
        while at < len(part):
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
            if head != _DATA:
                # "data" so far: it ends the line (a bare data line, skipped) or goes on to its
                # colon; or another field or a comment, skipped: its first bytes never become "data:"
                return
            self._data_started()
            self._state = _VALUE
        if self._state == _VALUE:
            self._read(text)

    def _line_end(self) -> None:
        if not self._head:  # a blank line (a data line's head is "data:")
            self._dispatch()
        self._state, self._head = _HEAD, b""

    def _data_started(self) -> None:
        if self._data_lines:
            self._read(b"\n")  # the data's lines are joined with "\n"
        self._data_lines += 1

    def _read(self, data: bytes, last: bool = False) -> None:
        if not (data or last) or not self._usages:
            return
        data = self._short.cut(data)
        for usage in self._usages.values():
            usage.read(data, last)
        self._index_parser = _send(self._index_parser, data)
        if self._type_parser is None:
            return
        self._type_parser = _send(self._type_parser, data)
        if self._type_read:  # the last read: a key written twice is the last to json.loads
            kind = self._type_read[-1]
            holder = self._reads.get(kind) if isinstance(kind, str) else None
            usage = None if holder is None else self._usages.get(holder)
            self._usages = None if usage is None else {holder: usage}

    def _dispatch(self) -> None:
        if not self._data_lines:
            return  # no data: the client dispatches nothing
        self._read(b"", last=True)
        if not self._usages or (None not in self._reads and not self._type_read):
            return  # no usage to read, or no type read where the events have one
        ((holder, usage),) = self._usages.items()
        if (read := usage.payload()) is None:
            return
        payload: dict[str, Any] = dict(read) if not holder else {holder: read}
        if self._type_read:
            payload = {"type": self._type_read[-1], **payload}
        if None in self._reads:
            payload["choices"] = [{"index": index} for index in self._indices]
        self._bill(payload)


def _send(parser: Any, data: bytes) -> Any:
    """``data`` fed to ``parser``: the parser, or ``None`` where the text is no JSON from here
    (nothing more to read). Never closed at the end: a type or an index sits inside the data's
    object, so it is read before the text ends, and a text that ends early is the usage's
    reader's to refuse (it reads the data whole)."""
    if parser is None:
        return None
    try:
        if data:
            parser.send(data)
    except UNREADABLE:
        return None
    return parser


#: The OpenAI shape's chunks (chat, completions): no type, the figures at the top level.
_CHUNKS: Mapping[str | None, str] = {None: ""}


def oversized_reader(shape: Shape | None, bill: Bill) -> Callable[[], Callable[[bytes], None]]:
    """What makes a reader for each event of ``shape``'s stream too large to hold (``None``: the
    OpenAI shape's chat and completions chunks)."""
    if shape is None:
        return lambda: PassingEvent(_CHUNKS, {}, bill).feed
    return lambda: PassingEvent(shape.event_holders, shape.body_kind, bill).feed
