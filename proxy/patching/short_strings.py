"""JSON text fed in parts, with every string that a part cuts and that is long left empty.

yajl, under ijson's incremental parser (:mod:`proxy.patching.passing_usage`), buffers a token
a part cuts until the token ends: a body that passes unheld because it is too large, or does
not fit in the process's budget (:mod:`proxy.patching.response_budget`), still had each of its
long strings held whole, one copy in yajl's buffer and one as the ``str`` it builds. Twelve
answers of one 24 MiB string held 290 MiB passing, as many as held whole. The usage and the
model are short: a string longer than :data:`KEPT` is never one the read keeps, so its text
is left out; a string a part holds whole is passed on as it is (the part holds it anyway).
The text stays JSON: a string is kept whole or left as ``""``, never cut inside an escape or
a character. What is not JSON stays so: a string with a control character, an escape JSON has
not, or bytes that are not UTF-8, which yajl and the client's parser refuse, is one that yajl
refuses here too, so that an SSE event its client cannot parse is not billed either
(:mod:`proxy.patching.passing_event`).
"""

from __future__ import annotations

import codecs
import re

#: The longest string, cut by a part's end, that is held until its end and read.
KEPT = 4096

#: Text outside strings and whole strings, possessively: no backtracking state in a long part.
_WHOLE = re.compile(rb'(?:[^"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
#: A run of string content, JSON's escapes included; it stops at the closing quote, a control
#: character, or a backslash that no whole escape of JSON follows in the part.
_CONTENT = re.compile(rb'[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+')
#: An escape that the part's end cut: read again with the next part.
_CUT_ESCAPE = re.compile(rb'\\(?:u[0-9a-fA-F]{0,3})?')
#: What yajl is handed for a string that is not JSON: a byte it refuses inside a string.
_REFUSED = b"\x00"
_QUOTE, _BACKSLASH = 0x22, 0x5C


class ShortStrings:
    """:meth:`cut` each part in order; what it returns, in order, is the text with the long
    strings that parts cut left empty."""

    __slots__ = ("_open", "_cut", "_held", "_utf8", "_refused")

    def __init__(self) -> None:
        self._open = False  # inside a string a part cut
        self._cut = b""  # the escape the last part's end cut
        self._held: bytearray | None = None  # that string's content so far; None once too long
        # That string's bytes are UTF-8 so far; its last are decoded as final, which leaves the
        # decoder empty for the next string (one that fails is the last read).
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._refused = False  # a string was not JSON: yajl was handed what it refuses, and no more

    def cut(self, part: bytes) -> bytes:
        if self._refused:
            return b""
        if self._cut:
            part, self._cut = self._cut + part, b""
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
            stop = _CONTENT.match(part, pos).end()  # type: ignore[union-attr]
            if stop < end and part[stop] == _BACKSLASH and _CUT_ESCAPE.fullmatch(part, stop):
                self._cut, end = part[stop:], stop  # the escape goes on in the next part
            closes = stop < end and part[stop] == _QUOTE
            if not self._keep(part[pos:stop], closes) or (stop < end and not closes):
                out.append(_REFUSED)  # a control character, an escape JSON has not, or not UTF-8
                self._refused = True
                break
            if stop == end:
                break
            if self._held is not None:
                out.append(bytes(self._held))
            out.append(b'"')
            self._open, self._held, pos = False, None, stop + 1
        return b"".join(out)

    def _keep(self, content: bytes, closes: bool) -> bool:
        """Take ``content`` of the open string (the last of it where it ``closes``): ``False``
        where its bytes are not UTF-8."""
        try:
            self._utf8.decode(content, closes)
        except UnicodeDecodeError:
            return False
        if self._held is not None:
            if len(self._held) + len(content) > KEPT:
                self._held = None  # too long to be a figure: left out
            else:
                self._held += content
        return True
