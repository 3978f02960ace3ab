"""Ghost usage: the client's stream must be what it would be without the proxy's usage chunk.

In upstream mode the proxy asks for ``include_usage`` the client did not ask for, so every
streamed request is counted, and drops the usage-only chunk. One more thing moves with
that flag in vLLM 0.32: ``system_fingerprint`` is stamped on the chunks that carry a
``finish_reason`` only when ``include_usage`` is off; with it on, the usage chunk carries
it instead. So from the first finishing chunk on, the output is held (those chunks and the
usage chunk are produced in one engine step, so the hold costs no latency), and when the
dropped usage chunk had a fingerprint, it is written back where vLLM would have put it:
the last field of each finishing chunk, inserted as bytes, nothing re-serialized. A stream
that ends without a usage chunk releases what was held unchanged.
"""

from __future__ import annotations

import re

import orjson

_FINISH = re.compile(rb'"finish_reason":\s*"')
_LINE_END = re.compile(rb"[\r\n]")


class GhostHold:
    __slots__ = ("_held", "_holding", "_done", "_fingerprint", "_usage_dropped")

    def __init__(self) -> None:
        self._held = bytearray()
        self._holding = False
        self._done = False  # released after the usage chunk: nothing more to hold
        self._fingerprint: str | None = None
        self._usage_dropped = False

    def usage_dropped(self, payload: dict) -> None:
        """The middleware dropped the ghost usage chunk ``payload``."""
        fingerprint = payload.get("system_fingerprint")
        self._fingerprint = fingerprint if isinstance(fingerprint, str) else None
        self._usage_dropped = True

    def filter(self, out: bytes) -> bytes:
        """Feed the patcher's output (whole events); returns what may go to the client now."""
        if not self._holding and (self._done or not _FINISH.search(out)):
            return out
        self._holding = True
        self._held += out
        return self.release() if self._usage_dropped else b""

    def release(self) -> bytes:
        """Everything held, with the fingerprint restored if the usage chunk had one."""
        held = bytes(self._held)
        self._held.clear()
        self._holding = False
        self._done = self._usage_dropped
        if self._fingerprint is None:
            return held
        return _stamp(held, b',"system_fingerprint":' + orjson.dumps(self._fingerprint))


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
