"""Incremental, byte-exact Server-Sent Events patching.

Lines end with ``\\r\\n``, ``\\r`` or ``\\n`` (and nothing else: ``str.splitlines`` would
also split on U+2028 or ``\\x1c``, which may sit inside JSON); a blank line ends an event.
A terminator is never split across chunks: a trailing ``\\r`` is rescanned with the next
chunk, since it may be the first half of ``\\r\\n``.

Every event goes out byte for byte unless it mentions ``"usage"`` and the event patcher
rewrites it. At most one partial event is held back, and only until its blank line
arrives; a partial event larger than ``max_event_bytes`` is flushed unpatched (and the
rest of it passed through as it comes), and ``on_oversize`` is called once for it. With a
``budget``, its bytes past the free bound the budget names are counted in its process's
:class:`~proxy.patching.response_budget.ResponseBudget`: one they do not fit in goes the
same way, as ``on_oversize`` is told. Its bytes are handed, as they go out, to a reader that
``read_oversized`` makes for it, when given (:mod:`proxy.patching.passing_event`: the usage
such an event carries is still read).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from proxy.patching import json_exact
from proxy.patching.response_budget import BUDGET_FULL, ResponseHold

_TERMINATOR = re.compile(rb"\r\n|\r|\n")
# Substrings are looked up with ``bytes.find``, not ``in``: CPython's ``bytes.__contains__``
# first reads its operand as an integer, so a bytes operand costs a TypeError built and
# dropped each time (``_Py_bytes_contains``), about twice the time of the search. These run
# on every chunk of every stream.
_USAGE = b'"usage"'
_NULL_USAGE = (b'"usage":null', b'"usage": null')

#: Rewrites one parsed event payload. Returns ``None`` to leave the event as it was,
#: ``False`` to drop the event, or ``True`` when it changed the payload in place.
PayloadPatcher = Callable[[dict], bool | None]


def patch_event(event: bytes, patch_payload: PayloadPatcher) -> bytes | None:
    """Patch one complete event (with its terminators). ``None`` means unchanged."""
    if _one_line(event):
        return _patch_one_line(event, patch_payload)
    if _null_usage_only(event):
        return None
    lines: list[tuple[bytes, bytes]] = []
    data: list[bytes] = []
    last_data = -1
    start = 0
    for match in _TERMINATOR.finditer(event):
        line = event[start : match.start()]
        lines.append((line, match.group()))
        if line[:4] == b"data" and (len(line) == 4 or line[4:5] == b":"):
            value = line[5:]
            data.append(value[1:] if value[:1] == b" " else value)
            last_data = len(lines) - 1
        start = match.end()
    patched = _patched(b"\n".join(data), patch_payload) if data else None
    if patched is None:
        return None
    if patched is False:
        return b""
    out = bytearray()
    for index, (line, terminator) in enumerate(lines):
        if line[:4] == b"data" and (len(line) == 4 or line[4:5] == b":"):
            # Multi-line data collapses into one re-serialized line, in the place of the
            # last data line: the line before the blank line stays the one it was, so a
            # "\r" before a "\n" blank line never fuses into one "\r\n" terminator.
            if index == last_data:
                out += b"data: " + patched + terminator
        else:
            out += line + terminator
    out += event[start:]
    return bytes(out)


def _patch_one_line(event: bytes, patch_payload: PayloadPatcher) -> bytes | None:
    """:func:`patch_event` for one line and its blank line (:func:`_one_line`), how engines
    frame every chunk: the bytes the general rule writes, without its line scan."""
    if not event.startswith(b"data:") or _null_usage_only(event):
        return None  # a comment or another field alone carries no payload
    value = event[5:-2]
    patched = _patched(value[1:] if value[:1] == b" " else value, patch_payload)
    if patched is None:
        return None
    return b"" if patched is False else b"data: " + patched + b"\n\n"


def _null_usage_only(event: bytes) -> bool:
    """`"usage": null`, OpenAI style on every chunk, and no other usage: nothing to patch."""
    return event.count(_USAGE) == 1 and (event.find(_NULL_USAGE[0]) >= 0 or event.find(_NULL_USAGE[1]) >= 0)


def _one_line(event: bytes) -> bool:
    """``event`` is one non-empty line and a blank line, both ending in LF, with no CR anywhere."""
    return len(event) > 2 and event.find(b"\n") == len(event) - 2 and event[-1:] == b"\n" and event.find(b"\r") < 0


def _patched(data: bytes, patch_payload: PayloadPatcher) -> bytes | Literal[False] | None:
    """The event's data, a JSON object, patched and written back exactly
    (:mod:`proxy.patching.json_exact`); ``False`` to drop the event; ``None`` to leave it
    as it was (not JSON, not an object, or unchanged)."""
    try:
        payload, encode = json_exact.loads(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or (verdict := patch_payload(payload)) is None:
        return None
    return False if verdict is False else encode(payload)


class SSEPatcher:
    """Feed it response chunks; send what it returns, then what ``flush`` returns."""

    __slots__ = ("_patch", "_max", "_budget", "_on_oversize", "_read_oversized", "_pending", "_scanned",
                 "_line_start", "_oversize", "_reader")

    def __init__(
        self,
        patch_payload: PayloadPatcher,
        *,
        max_event_bytes: int = 1 << 20,
        budget: tuple[ResponseHold, int] | None = None,
        on_oversize: Callable[[str], None] | None = None,
        read_oversized: Callable[[], Callable[[bytes], None]] | None = None,
    ) -> None:
        """``budget``: the response's share of what its process may hold, and the bytes of a
        partial event held without it; ``on_oversize`` is called with the reason an event went
        out unpatched (``event_too_large``, or the budget's)."""
        self._patch = patch_payload
        self._max = max_event_bytes
        self._budget = budget
        self._on_oversize = on_oversize
        self._read_oversized = read_oversized
        self._reader: Callable[[bytes], None] | None = None  # the oversized event's, fed what goes out
        self._pending = bytearray()  # bytes of the one partial event (or its oversize tail)
        self._scanned = 0  # offset in _pending up to which terminators were scanned
        self._line_start = 0  # offset in _pending where the current line starts (may be < 0)
        self._oversize = False  # the partial event already went out unpatched

    def feed(self, chunk: bytes) -> bytes:
        if not self._pending and not self._oversize and chunk.endswith(b"\n\n") and chunk.find(b"\r") < 0:
            # Whole events, LF-terminated (how engines send them): nothing to hold back.
            return chunk if chunk.find(_USAGE) < 0 else self._patch_events(chunk)
        self._pending += chunk
        return self._drain(final=False)

    def flush(self) -> bytes:
        """End of stream: whatever is left goes out (an unterminated event, unpatched)."""
        out = self._drain(final=True)
        rest = bytes(self._pending)
        self._pending.clear()
        self._scanned = self._line_start = 0
        self._oversize, self._reader = False, None  # an event cut short is not dispatched: not read
        if self._budget is not None:
            self._fits(0)
        return out + rest

    def _fits(self, n: int) -> bool:
        """The partial event may be held at ``n`` bytes: within the budget, where one was given."""
        return self._budget is None or self._budget[0].holds(max(0, n - self._budget[1]))

    def _drain(self, *, final: bool) -> bytes:
        buf = self._pending
        first = last = -1
        line_start = self._line_start
        scanned = len(buf)
        for match in _TERMINATOR.finditer(buf, self._scanned):
            if not final and match.end() == len(buf) and match.group() == b"\r":
                scanned = match.start()  # maybe half of "\r\n": decide with the next chunk
                break
            if match.start() == line_start:
                last = match.end()
                if first < 0:
                    first = last
            line_start = match.end()
        self._scanned, self._line_start = scanned, line_start

        out: list[bytes] = []
        if last >= 0:
            complete = bytes(buf[:last])
            del buf[:last]
            self._scanned -= last
            self._line_start -= last
            if self._oversize:
                out.append(self._read(complete[:first]))  # the tail of the oversized event
                complete = complete[first:]
                self._oversize, self._reader = False, None
            out.append(self._patch_events(complete))
        if self._oversize or len(buf) > self._max or (self._budget is not None and not self._fits(len(buf))):
            if not self._oversize:
                self._oversize = True
                if self._on_oversize is not None:
                    self._on_oversize("event_too_large" if len(buf) > self._max else BUDGET_FULL)
                if self._read_oversized is not None:
                    self._reader = self._read_oversized()
            # Pass the partial event on now, all but an unresolved trailing "\r".
            sent = self._scanned
            out.append(self._read(bytes(buf[:sent])))
            del buf[:sent]
            self._line_start -= sent
            self._scanned = 0
            self._fits(len(buf))  # what is left: at most an unresolved "\r"
        return b"".join(out)

    def _read(self, oversized: bytes) -> bytes:
        """Some of the oversized event's bytes, read on their way out."""
        if self._reader is not None:
            self._reader(oversized)
        return oversized

    def _patch_events(self, region: bytes) -> bytes:
        if region.find(_USAGE) < 0:
            return region
        if _one_line(region):  # one event, as engines send them: no scan for its end
            patched = _patch_one_line(region, self._patch)
            return region if patched is None else patched
        out: list[bytes] = []
        event_start = line_start = 0
        for match in _TERMINATOR.finditer(region):
            if match.start() == line_start:
                event = region[event_start : match.end()]
                patched = patch_event(event, self._patch) if event.find(_USAGE) >= 0 else None
                out.append(event if patched is None else patched)
                event_start = match.end()
            line_start = match.end()
        out.append(region[event_start:])
        return b"".join(out)
