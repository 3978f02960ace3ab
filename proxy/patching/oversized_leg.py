"""A P/D leg too large to hold: its top-level ``kv_transfer_params``, read as the body passes.

A P/D router's decode leg is the client's body plus the prefill's ``kv_transfer_params``
(its block ids, and the figures it hands over: :mod:`proxy.patching.pd_leg`), so it can pass
``max_request_bytes`` where its prefill leg did not; on ``/v1/responses`` vllm-router even
keeps a client's ``stream_options``, of any size, on the decode leg only. Refused (413)
unparsed, such a decode leg would bill nothing, though its prefill was computed and cached.
So with ``pd_legs`` on, a body over the limit is still refused, but read to its end first
without being held: only the value of its top-level ``kv_transfer_params``
is kept (at most ``cap`` bytes), for the leg and the handed figures to be read from it.

:class:`TopLevelMember` follows the JSON structure across chunks: strings (escapes
included) and nesting depth, so a key inside a nested object or a string's text is never
taken for the member; with duplicate keys the last one counts, as ``json.loads`` takes it.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.types import Receive

from proxy.patching.body_budget import Hold
from proxy.patching.json_exact import loads
from proxy.patching.request_body import ClientGone

#: A run of string content, escapes included; it stops at the closing quote, or at a
#: backslash the chunk cut from the byte it escapes.
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
#: A run outside strings with nothing that changes the structure.
_PLAIN = re.compile(rb'[^"{}\[\],:]*')


def _nested(levels: int) -> bytes:
    """Whole strings, bytes that are no structure, and whole values nested ``levels`` deep."""
    item = rb'[^"{}\[\]]|"[^"\\]*(?:\\.[^"\\]*)*"'
    for _ in range(levels):
        item = rb'[^"{}\[\]]|"[^"\\]*(?:\\.[^"\\]*)*"|[\[{](?:' + item + rb')*[\]}]'
    return rb"(?:" + item + rb")*"


#: Below the top level nothing is kept, so what is whole there is passed over at C speed;
#: what is cut by the chunk's end, or nested deeper, is followed a byte of structure at a time.
_INNER = re.compile(_nested(8), re.DOTALL)
#: Fed in slices, so that a body of little but brackets holds the event loop briefly.
_SLICE = 64 << 10
_MAX_KEY = 256  # longer than any spelling of the name, escapes included


class TopLevelMember:
    """The raw value of member ``name`` of a JSON object fed in pieces (:meth:`feed`)."""

    def __init__(self, name: str, cap: int) -> None:
        self._name, self._cap = name, cap
        self._depth = 0
        self._in_string = self._escaped = self._expect_key = self._target = False
        self._key: bytearray | None = None  # a top-level key being read
        self._value: bytearray | None = None  # the member's value being read
        self.value: bytes | None = None  # the last complete one

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        value_from = 0 if self._value is not None else None
        while pos < end:
            if self._in_string:
                if self._escaped:  # the byte the last chunk's closing backslash escapes
                    self._key_part(data[pos : pos + 1])
                    self._escaped, pos = False, pos + 1
                    continue
                stop = _STRING_BODY.match(data, pos).end()  # type: ignore[union-attr]
                self._key_part(data[pos:stop])
                if stop < end and data[stop] == 0x5C:  # a backslash, its byte in the next chunk
                    self._key_part(b"\\")
                    self._escaped, stop = True, end
                if stop == end:
                    break
                self._in_string, pos = False, stop + 1
                if self._key is not None:
                    self._end_key()
                continue
            if self._depth > 1:
                pos = _INNER.match(data, pos).end()  # type: ignore[union-attr]
            stop = _PLAIN.match(data, pos).end()  # type: ignore[union-attr]
            if stop == end:
                break
            char, pos = data[stop], stop + 1
            if char == 0x22:  # "
                self._in_string = True
                if self._depth == 1 and self._expect_key:
                    self._key, self._expect_key = bytearray(), False
            elif char in b"{[":
                self._depth += 1
                self._expect_key = self._depth == 1 and char == 0x7B
            elif char in b"}],":
                if self._depth == 1 and value_from is not None:
                    self._end_value(data[value_from:stop])
                    value_from = None
                self._expect_key = self._depth == 1 and char == 0x2C
                if char != 0x2C:
                    self._depth -= 1
            elif char == 0x3A and self._depth == 1 and self._target:  # the member's colon
                self._value, value_from, self._target = bytearray(), pos, False
        if value_from is not None:
            self._value_part(data[value_from:end])

    def _key_part(self, part: bytes) -> None:
        if self._key is not None and len(self._key) <= _MAX_KEY:
            self._key += part[: _MAX_KEY + 1 - len(self._key)]

    def _end_key(self) -> None:
        assert self._key is not None
        raw, self._key = bytes(self._key), None
        try:  # the key as the engine's parser reads it: escapes too
            self._target = len(raw) <= _MAX_KEY and json.loads(b'"' + raw + b'"') == self._name
        except ValueError:
            self._target = False

    @property
    def kept(self) -> int:
        """Bytes of the member's value held: the one being read and the last complete one."""
        return (0 if self._value is None else len(self._value)) + (0 if self.value is None else len(self.value))

    def _value_part(self, part: bytes) -> None:
        if self._value is None:
            return
        if len(self._value) + len(part) > self._cap:  # too long to keep: no value, not an older one
            self._value = self.value = None
            return
        self._value += part

    def _end_value(self, part: bytes) -> None:
        self._value_part(part)
        if self._value is not None:
            self.value, self._value = bytes(self._value), None


async def member_of(
    head: list[bytes], more: bool, receive: Receive, name: str, cap: int, hold: Hold
) -> dict[str, Any]:
    """``{name: value}`` of a body whose first chunks were read (``head``; ``more``: the rest
    is still to be received), read to its end and not kept; ``{}`` where it has none that
    parses. ``hold`` follows what is held, the head not yet read and the value kept (up to
    ``cap`` for each of many clients that stop after it): ``BodyBudgetFull`` where it does not
    fit. Raises :class:`ClientGone` if the client leaves before the end."""
    member = TopLevelMember(name, cap)
    unread = sum(map(len, head))
    while head:
        chunk = head.pop(0)  # emptied as it is read: the head is not held beside the rest
        for start in range(0, len(chunk), _SLICE):
            member.feed(chunk[start : start + _SLICE])
            await asyncio.sleep(0)
        unread -= len(chunk)
        hold.holds(unread + member.kept)
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        member.feed(message.get("body", b""))
        hold.holds(member.kept)
        more = message.get("more_body", False)
    if member.value is None:
        return {}
    try:  # as the engine reads it: NaN, wide integers, any depth (json_exact)
        return {name: loads(member.value)[0]}
    except ValueError:
        return {}
