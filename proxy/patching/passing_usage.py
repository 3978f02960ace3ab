"""The top-level ``usage`` member of a JSON body too large to hold, read as the body passes.

A JSON response past ``max_response_bytes`` goes out unpatched, as it comes: it is not held
whole. Its usage still says what the request cost, and were it not read a client could keep
its prompt and its completion off the bill by asking for an answer that large: vLLM's
``prompt_logprobs`` (20 entries a prompt token) takes a prompt of some 50,000 tokens past the
64 MiB default, and in front of an upstream the record then had no prompt at all.

So each part is fed, as it passes, to ijson's incremental parser (its C backend, yajl), which
builds only the value at the prefix ``usage``: the top level's, never a ``"usage"`` key in an
object the body echoes (a Responses body's JSON schema), nor the letters in a string. The
parse stops once that value is read (vLLM writes ``usage`` before ``prompt_logprobs``), or at
the first byte that is not JSON. What it holds meanwhile is the value and the token being read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import ijson
from starlette.types import Send


class PassingUsage:
    """Feed a JSON body's parts in order (:meth:`feed`); :attr:`usage` is its top-level
    ``usage`` object once read, else ``None``. ``kind``: the top-level fields that name such a
    body of its API (a shape's ``body_kind``), for :meth:`payload`."""

    __slots__ = ("usage", "_kind", "_found", "_parser")

    def __init__(self, kind: Mapping[str, str] = {}) -> None:
        self.usage: dict[str, Any] | None = None
        self._kind = kind
        self._found = ijson.sendable_list()
        # Not use_float: its numbers are yajl's int64 and double, so an integer past int64
        # anywhere before the usage (a client's JSON schema a Responses body echoes) ended the
        # read. Read from their text instead, integers are Python's and others Decimal
        # (made floats in the usage read, as a body held whole reads them: :func:`_floats`).
        self._parser: Any = ijson.items_coro(self._found, "usage")

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
        if self._parser is None or not (part or last):  # to the parser, an empty buffer is the end
            return
        try:
            self._parser.send(part)
            if last:
                self._parser.close()
        except ijson.JSONError:  # not JSON from here (or cut short): nothing more to read, but
            self._parser = None  # a usage read before that byte in this same part still counts
        if self._found:
            usage, self._parser = self._found[0], None
            self.usage = _floats(usage) if isinstance(usage, dict) else None


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
