"""JSON text fed in parts, with every string that a part cuts and that is long left empty.

yajl, under ijson's incremental parser (:mod:`proxy.patching.passing_usage`), buffers a token
a part cuts until the token ends: a body that passes unheld because it is too large, or does
not fit in the process's budget (:mod:`proxy.patching.response_budget`), still had each of its
long strings held whole, one copy in yajl's buffer and one as the ``str`` it builds. Twelve
answers of one 24 MiB string held 290 MiB passing, as many as held whole. The usage and the
model are short: a string longer than :data:`KEPT` is never one the read keeps, so its text
is left out; a string a part holds whole is passed on as it is (the part holds it anyway).
The text stays JSON: a string is kept whole or left as ``""``, never cut inside an escape or
a character.
"""

from __future__ import annotations

import re

#: The longest string, cut by a part's end, that is held until its end and read.
KEPT = 4096

#: Text outside strings and whole strings, possessively: no backtracking state in a long part.
_WHOLE = re.compile(rb'(?:[^"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
#: A run of string content, escapes included; it stops at the closing quote, or at a
#: backslash the part cut from the byte it escapes.
_CONTENT = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)


class ShortStrings:
    """:meth:`cut` each part in order; what it returns, in order, is the text with the long
    strings that parts cut left empty."""

    __slots__ = ("_open", "_escaped", "_held")

    def __init__(self) -> None:
        self._open = False  # inside a string a part cut
        self._escaped = False  # the last part ended with the backslash of an escape
        self._held: bytearray | None = None  # that string's content so far; None once too long

    def cut(self, part: bytes) -> bytes:
        out: list[bytes] = []
        pos, end = 0, len(part)
        while pos < end:
            if not self._open:
                stop = _WHOLE.match(part, pos).end()  # type: ignore[union-attr]
                out.append(part[pos : stop + 1])  # and the quote of a string the part cuts
                if stop == end:
                    break
                self._open, self._held, pos = True, bytearray(), stop + 1
                continue
            start = pos
            if self._escaped:  # the byte the last part's backslash escapes
                self._escaped, pos = False, pos + 1
            stop = _CONTENT.match(part, pos).end()  # type: ignore[union-attr]
            if stop < end and part[stop] == 0x5C:  # a backslash, its byte in the next part
                self._escaped, stop = True, end
            self._keep(part[start:stop])
            if stop == end:
                break
            if self._held is not None:
                out.append(bytes(self._held))
            out.append(b'"')
            self._open, self._held, pos = False, None, stop + 1
        return b"".join(out)

    def _keep(self, content: bytes) -> None:
        if self._held is not None:
            if len(self._held) + len(content) > KEPT:
                self._held = None  # too long to be a figure: left out
            else:
                self._held += content
