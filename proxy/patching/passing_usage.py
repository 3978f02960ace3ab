"""The top-level ``usage`` member of a JSON body too large to hold, read as the body passes.

A JSON response past ``max_response_bytes`` goes out unpatched, as it comes: it is not held
whole. Its usage still says what the request cost, and were it not read a client could keep
its prompt and its completion off the bill by asking for an answer that large: vLLM's
``prompt_logprobs`` (20 entries a prompt token) takes a prompt of some 50,000 tokens past the
64 MiB default, and in front of an upstream the record then had no prompt at all.

So each part is fed, as it passes, to ijson's incremental parser (its C backend, yajl), which
builds only the value at the prefix ``usage``: the top level's, never a ``"usage"`` key in an
object the body echoes (a Responses body's JSON schema), nor the letters in a string. The
parse goes on past that value to the end, or to the first byte that is not JSON: a usage
written twice is the last, as the client's ``json.loads`` keeps it (the ``openai`` SDK reads
that one; a body held whole is read so too), where stopping at the first billed a figure the
client never read. What it holds meanwhile is the value and the token being
read, a string that a part cuts only while it is short (:mod:`proxy.patching.short_strings`).
The top-level ``model`` is read the same way, so that the request is labelled by the
response's model on every API: a Responses body echoes the client's ``metadata`` (any keys,
``"model"`` too) before it, where the first bytes cannot be trusted for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import ijson
from starlette.types import Send

from proxy.patching.short_strings import ShortStrings

#: What ijson raises at text it cannot read: not JSON, or a string whose UTF-8 it refuses to
#: decode (a surrogate written in UTF-8, which yajl lets by and Python's ``json`` takes).
UNREADABLE = (ijson.JSONError, UnicodeDecodeError)


class PassingUsage:
    """Feed a JSON body's parts in order (:meth:`feed`); :attr:`usage` is its top-level
    ``usage`` object once read, else ``None``, and :attr:`model` its top-level ``model``
    string. ``kind``: the top-level fields that name such a body of its API (a shape's
    ``body_kind``), for :meth:`payload`. ``at``: the member that holds both instead of the
    top level. ``whole``: they count only if the whole input is one JSON value (an SSE event's
    data, which its client parses whole or drops: :mod:`proxy.patching.passing_event`)."""

    __slots__ = ("usage", "model", "_kind", "_reads", "_short", "_whole", "_rest")

    def __init__(self, kind: Mapping[str, str] = {}, at: str = "", whole: bool = False) -> None:
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self._kind = kind
        # One parser a member, the model's stopped once its value is read, and once the usage
        # is: the model comes before it in every API's body (in a Responses body after the
        # client's metadata, before its output), so its parse is short. Not use_float: its
        # numbers are yajl's int64 and double, so an integer past int64 anywhere before the
        # usage (a client's JSON schema a Responses body echoes) ended the read. Read from
        # their text instead, integers are Python's and others Decimal (made floats in the
        # usage read, as a body held whole reads them: :func:`_floats`).
        self._reads: dict[str, tuple[Any, list[Any]]] = {}
        self._short = ShortStrings()  # else yajl holds each long string a part cuts whole
        for member in ("model", "usage"):
            found = ijson.sendable_list()
            self._reads[member] = (ijson.items_coro(found, f"{at}.{member}" if at else member), found)
        # The usage's parser reads on past the usage to the end, for a usage written again; with
        # ``whole`` also to find whether the input is JSON throughout, and the model's parser,
        # if it has not read one yet, with it.
        self._whole = whole
        self._rest: tuple[Any, list[Any]] | None = None  # the usage's parser, and what it read

    async def pass_on(self, parts: list[bytes], send: Send) -> None:
        """Send the parts held so far, reading each: the loop serves other requests between them."""
        for part in parts:
            self.feed(part)
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0)

    def payload(self) -> dict[str, Any] | None:
        """The body as far as its figures go (its kind, model and usage), once its usage was read."""
        if self.usage is None:
            return None
        return {**self._kind, "usage": self.usage} if self.model is None else \
            {**self._kind, "model": self.model, "usage": self.usage}

    def fed(self, part: bytes, last: bool) -> dict[str, Any] | None:
        """:meth:`feed`, then :meth:`payload` once the last part came."""
        self.feed(part, last)
        return self.payload() if last else None

    def feed(self, part: bytes, last: bool = False) -> None:
        if self._reads or self._rest is not None:
            self.read(self._short.cut(part), last)

    def read(self, part: bytes, last: bool = False) -> None:
        """:meth:`feed` for a part its caller cut with a :class:`ShortStrings` of its own, in
        order (:mod:`proxy.patching.passing_event`, whose other parser reads the same text)."""
        if self._rest is not None:
            self._read_rest(part, last)
        for member, (parser, found) in list(self._reads.items()):
            try:
                if part:  # to the parser, an empty buffer is the end: ASGI allows one before the last
                    parser.send(part)
                if last:
                    parser.close()
            except UNREADABLE:  # not JSON from here (or cut short): nothing more to read, but
                del self._reads[member]  # a value read before that byte in this same part still counts,
                if self._whole:  # unless the whole is to be JSON
                    self._reads.clear()
                    self.usage = self.model = self._rest = None
                    return
            if found:
                self._reads.pop(member, None)
                if member == "model":
                    self.model = found[0] if isinstance(found[0], str) else None
                    continue
                del found[:-1]  # written twice in this part, the last: json.loads keeps it
                self.usage = _floats(found[0]) if isinstance(found[0], dict) else None
                self._rest = None if last else (parser, found)  # read on to the end: a usage written again
                if not self._whole:  # wins; with ``whole``, the model too, if not read yet
                    self._reads.clear()  # a model after the usage is none that any API's body writes

    def _read_rest(self, part: bytes, last: bool) -> None:
        assert self._rest is not None
        parser, found = self._rest
        try:
            if part:
                parser.send(part)
            if last:
                parser.close()
        except UNREADABLE:
            self._rest = None
            if self._whole:  # not one JSON value: what was read of it does not count
                self.usage = self.model = None
                self._reads.clear()
                return
            last = True  # not JSON from here: the last usage read before it stands
        del found[:-1]  # only the last counts: else a body of usages written over and over is held as read
        if last:  # a usage written twice is the last, as json.loads reads it
            self.usage = _floats(found[-1]) if isinstance(found[-1], dict) else None
            self._rest = None


def _floats(usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` with each ``Decimal`` in it a float, as the standard library and orjson read
    such a number: the usage is patched and written as a held body's is, and neither writes
    a ``Decimal``. A stack, not recursion: an upstream may nest it as deep as it likes."""
    stack: list[dict[str, Any] | list[Any]] = [usage]
    while stack:
        node = stack.pop()
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, Decimal):
                node[key] = float(value)  # type: ignore[index]
            elif isinstance(value, dict | list):
                stack.append(value)
    return usage
