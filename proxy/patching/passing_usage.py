"""The top-level ``usage`` member of a JSON body too large to hold, read as the body passes.

A JSON response past ``max_response_bytes`` goes out unpatched, as it comes: it is not held
whole. Its usage still says what the request cost, and were it not read a client could keep
its prompt and its completion off the bill by asking for an answer that large: vLLM's
``prompt_logprobs`` (20 entries a prompt token) takes a prompt of some 50,000 tokens past the
64 MiB default, and in front of an upstream the record then had no prompt at all. So the
body is scanned in bounded memory as it passes: each part's strings are cut out with one
regular expression (no object built), the nesting outside them is counted with
``bytes.count``, and the value of a ``"usage"`` key at the top level, once found, is read
alone, up to :data:`MAX_USAGE_BYTES`.

A ``"usage"`` string token is told from the same letters inside a string by the quote before
it: inside a string that quote is escaped. Each part but the last keeps for the next the bytes
a token may have begun in, so that a key is read whole whatever the cut; its colon may come
in the next part.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any

from starlette.types import Send

#: The usage object itself is small; a value past this is not one to read.
MAX_USAGE_BYTES = 64 * 1024

_USAGE_TOKEN = re.compile(rb'(?<!\\)"usage"')
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: The rest of a string begun in an earlier part: what it holds, and its closing quote if here.
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*')
_TOKEN = b'"usage"'
_SPAN = len(_TOKEN)
_MARK = b"\x00"  # no JSON text holds a raw NUL: it stands for a "usage" token once strings are cut
_SPACE = b" \t\r\n"
_DECODER = json.JSONDecoder()


class PassingUsage:
    """Feed a JSON body's parts in order (:meth:`feed`); :attr:`usage` is its top-level
    ``usage`` object once read, else ``None``. ``kind``: the top-level fields that name such a
    body of its API (a shape's ``body_kind``), for :meth:`payload`."""

    __slots__ = ("usage", "_kind", "_depth", "_in_string", "_carry", "_key_pending", "_value", "_done")

    def __init__(self, kind: Mapping[str, str] = {}) -> None:
        self.usage: dict[str, Any] | None = None
        self._kind = kind
        self._depth = 0  # objects and arrays open before the part's first byte
        self._in_string = False  # the part starts inside a string
        self._carry = b""
        self._key_pending = False  # a top-level "usage" ended the last part: its colon comes next
        self._value: bytearray | None = None  # the usage value's bytes so far
        self._done = False

    async def pass_on(self, parts: list[bytes], send: Send) -> None:
        """Send the parts held so far, reading each: the loop serves other requests between them."""
        for part in parts:
            self.feed(part)
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0)

    def payload(self) -> dict[str, Any] | None:
        """The body as far as its figures go (its kind and usage), once its usage was read."""
        return None if self.usage is None else {**self._kind, "usage": self.usage}

    def feed(self, part: bytes, last: bool = False) -> None:
        if self._done:
            return
        if self._value is not None:
            self._take_value(part)
            return
        data = self._carry + part
        end = len(data)
        if not last:  # a "usage" token begun at the end is read whole with the next part
            end = max(0, end - _SPAN + 1)
            if 0 <= (token := data.find(_TOKEN, max(0, end - _SPAN + 1), end + _SPAN - 1)) < end:
                end = token
        self._carry = data[end:]
        self._scan(data[:end])

    def _scan(self, data: bytes) -> None:
        start = 0
        if self._in_string:
            rest = _STRING_REST.match(data)
            assert rest is not None  # it matches the empty string
            closed = rest.end()
            if data[closed : closed + 1] != b'"':  # the string goes on; a backslash left escapes the next byte
                self._carry = data[closed:] + self._carry
                return
            start, self._in_string = closed + 1, False
        part = data[start:]
        if self._key_pending:
            head = part.lstrip(_SPACE)
            if not head:
                return
            self._key_pending = False
            if head.startswith(b":"):
                self._take_value(head[1:] + self._carry)
                return
        marked = _USAGE_TOKEN.sub(_MARK, part) if _TOKEN in part else part
        bare = _STRING.sub(b"", marked)
        if (opened := bare.find(b'"')) >= 0:  # a string still open at the part's end
            bare = bare[:opened]
            self._in_string = True
            if (len(part) - len(part.rstrip(b"\\"))) % 2:  # its last backslash escapes the next byte
                self._carry = b"\\" + self._carry
                part = part[:-1]
        found = bare.find(_MARK)
        tokens = 0
        while found >= 0:
            before = bare[:found]
            depth = self._depth + before.count(b"{") + before.count(b"[") - before.count(b"}") - before.count(b"]")
            after = bare[found + 1 :].lstrip(_SPACE)
            if depth == 1 and after.startswith(b":"):
                token = [m for _, m in zip(range(tokens + 1), _USAGE_TOKEN.finditer(part))][-1]
                value = part[token.end() :].lstrip(_SPACE)[1:]  # past the colon
                self._take_value(value + self._carry)
                return
            if depth == 1 and not after and not self._in_string:
                self._key_pending = True
            tokens += 1
            found = bare.find(_MARK, found + 1)
        self._depth += bare.count(b"{") + bare.count(b"[") - bare.count(b"}") - bare.count(b"]")

    def _take_value(self, more: bytes) -> None:
        """The usage value's bytes so far; read once they hold a whole JSON value."""
        value = self._value or bytearray()
        value += more[: MAX_USAGE_BYTES + 1 - len(value)]  # what follows the value is not kept
        self._value, self._carry = value, b""
        try:
            usage, end = _DECODER.raw_decode(value.decode("utf-8", "replace").lstrip())
        except ValueError:  # not whole yet
            if len(value) > MAX_USAGE_BYTES:
                self._done, self._value = True, None
            return
        self._done, self._value = True, None
        if end > MAX_USAGE_BYTES:
            return
        if isinstance(usage, dict):
            self.usage = usage
