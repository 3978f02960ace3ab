"""Ghost usage: the client's stream must be what it would be without the proxy's usage chunk.

In upstream mode the proxy asks for ``include_usage`` the client did not ask for, so every
streamed request is counted, and drops the usage-only chunk. One more thing moves with
that flag in vLLM 0.32: ``system_fingerprint`` is stamped on the chunks that carry a
``finish_reason`` only when ``include_usage`` is off; with it on, the usage chunk carries
it instead. So a finishing chunk is held until the usage chunk comes, and when the dropped
usage chunk had a fingerprint, it is written back where vLLM would have put it: the last
field of each finishing chunk, inserted as bytes, nothing re-serialized.

Only what must wait is held: a finishing chunk, and, while one is held, anything that is
not a choice's chunk (``[DONE]``, which must stay after it). With ``n > 1`` the choices
that are still generating stream on as they come, past a choice that finished first; each
choice's own chunks keep their order. For ``n = 1`` (the finishing chunk, then the usage
chunk, in one engine step) the stream is byte-identical and nothing waits. A stream that
ends without a usage chunk releases what was held unchanged. An event too large to patch
goes out in parts as they come (``max_event_bytes``); once its first part went out, the
rest of it follows unheld, or another chunk would land inside it.

An upstream may send usage the client did not ask for: vLLM's ``--enable-force-include-usage``
puts it on every chunk, whatever ``continuous_usage_stats`` says, and sends the usage chunk to
every client. A choice's chunk with usage on it shows that, and the hold stands down: it
releases what it held, and drops and moves nothing, so the client gets what that upstream
sends.
"""

from __future__ import annotations

import re

import orjson

_FINISH = re.compile(rb'"finish_reason":\s*"')
_LINE_END = re.compile(rb"[\r\n]")
_TERMINATOR = re.compile(rb"\r\n|\r|\n")
#: A chunk with at least one choice in it (not ``[DONE]``, an error, or a usage-only chunk).
_CHOICE = re.compile(rb'"choices":\s*\[\s*\{')


class GhostHold:
    __slots__ = ("_held", "_all", "_open", "_done", "_fingerprint", "_usage_dropped", "_unasked")

    def __init__(self) -> None:
        self._held = bytearray()
        self._all = False  # part of an unfinished event is held: hold everything after it too
        #: Part of an unfinished event went out: the rest of it goes out next, and this is what
        #: to scan before that rest (``b"x"``: it starts inside a line).
        self._open: bytes | None = None
        self._done = False  # released after the usage chunk: nothing more to hold
        self._fingerprint: str | None = None
        self._usage_dropped = False
        self._unasked = False  # the upstream sends usage unasked: stand down (module docstring)

    def drops(self, payload: dict) -> bool:
        """Whether the middleware drops the event ``payload``: the ghost usage chunk."""
        choices = payload.get("choices")
        if self._unasked or payload.get("usage") is None or not isinstance(choices, list):
            return False
        if choices:  # a choice's chunk with usage on it
            self._unasked = True
            return False
        fingerprint = payload.get("system_fingerprint")
        self._fingerprint = fingerprint if isinstance(fingerprint, str) else None
        self._usage_dropped = True
        return True

    @property
    def holding(self) -> bool:
        """Something is held: a ``[DONE]`` the patcher passed may not have reached the client."""
        return bool(self._held)

    def filter(self, out: bytes) -> bytes:
        """Feed the patcher's output (whole events, but for an oversized or last one's
        part); returns what may go to the client now."""
        if self._open is None:
            return self._filter(out)
        if not out:
            return out
        lead = self._open
        rest, whole = _events(lead + out)[0]
        if not whole:
            self._open = _resume(lead + out)
            return out
        self._open = None
        rest = rest[len(lead) :]
        return rest + self._filter(out[len(rest) :])

    def _filter(self, out: bytes) -> bytes:
        if self._unasked:
            return self.release() + out if self._held else out
        if self._done or (not self._held and not _FINISH.search(out)):
            if out and not self._done and not out.endswith(b"\n\n"):
                last, whole = _events(out)[-1]
                self._open = None if whole else _resume(last)
            return out
        passed: list[bytes] = []
        for event, whole in _events(out):
            if self._all or _FINISH.search(event) or (self._held and not _CHOICE.search(event)):
                self._held += event
                self._all = self._all or not whole
            else:
                passed.append(event)
                self._open = None if whole else _resume(event)
        if self._usage_dropped and self._open is None:
            passed.append(self.release())
        return b"".join(passed)

    def release(self) -> bytes:
        """Everything held, with the fingerprint restored if the usage chunk had one."""
        held = bytes(self._held)
        self._held.clear()
        self._all = False
        self._done = self._usage_dropped
        if self._fingerprint is None:
            return held
        return _stamp(held, b',"system_fingerprint":' + orjson.dumps(self._fingerprint))


def _events(out: bytes) -> list[tuple[bytes, bool]]:
    """``out`` cut into events (each with its blank line), and whether each is whole: only
    a last part that no blank line ends is not."""
    events: list[tuple[bytes, bool]] = []
    event_start = line_start = 0
    for match in _TERMINATOR.finditer(out):
        if match.start() == line_start:
            events.append((out[event_start : match.end()], True))
            event_start = match.end()
        line_start = match.end()
    if event_start < len(out):
        events.append((out[event_start:], False))
    return events


def _resume(part: bytes) -> bytes:
    """What to scan before the rest of an event of which ``part`` went out (``_open``)."""
    return b"" if part.endswith((b"\n", b"\r")) else b"x"


def _stamp(events: bytes, field: bytes) -> bytes:
    out: list[bytes] = []
    start = 0
    for match in _FINISH.finditer(events):
        end_match = _LINE_END.search(events, match.end())
        end = end_match.start() if end_match else len(events)
        line_start = max(events.rfind(b"\n", 0, match.start()), events.rfind(b"\r", 0, match.start())) + 1
        line = events[line_start:end]
        if end <= start or b'"system_fingerprint"' in line or not line.endswith(b"}"):
            continue
        out.append(events[start : end - 1])
        out.append(field)
        start = end - 1
    out.append(events[start:])
    return b"".join(out)
