"""JSON read and written back exactly, with only the edits made to it.

orjson is fast but reads less than Python's ``json``, which is what vLLM and other Python
servers read and write: ``NaN`` and ``Infinity``, lone surrogates (``"\\ud800"``), integers
wider than 64 bits (orjson reads those as floats, silently), and nesting deeper than the
254 levels orjson writes. :func:`loads` uses orjson where it reads a text exactly and the
standard library otherwise, and returns the encoder that writes the value back the same
way; :func:`dumps` is orjson, falling back to the standard library past its depth.
Clients (request bodies) and upstreams (response bodies and SSE events) may send any of it.

The standard library recurses once a level, against the interpreter's recursion limit
(1,000) less the frames of the server already on the stack, so deep in a request's
handling it stopped short of the 1,024 levels orjson reads: a tool schema nested 1,000
levels, which an upstream reads, failed the request here with a 500. :func:`standard_loads`
and :func:`standard_dumps` run with room for 1,024 levels more than the stack holds.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

Encoder = Callable[[Any], bytes]

#: Digits enough for an integer orjson reads as a float: it holds -2**63 to 2**64 - 1, and
#: a number past either end has 19 digits or more. Found as a run of 19 zeros once every
#: digit is a zero and every other byte a blank: two passes in C, where a regular
#: expression would try a match at every byte. Digits in a string count too, which costs a
#: slower read of that text, never a different one.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_WIDE_INT = b"0" * 19

#: The levels orjson reads, and the frames of ``json``'s own calls above them.
_ROOM = 1024 + 32
#: The recursion limit is the interpreter's, not a thread's: raised and restored by one at a time.
_limit = threading.Lock()


@contextmanager
def _room_for_depth() -> Iterator[None]:
    with _limit:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + _ROOM)
        try:
            yield
        finally:
            sys.setrecursionlimit(limit)


def standard_loads(text: bytes) -> Any:
    """``json.loads``, from any depth of the stack as from none (module docstring):
    ``RecursionError`` only past 1,024 levels, ``ValueError`` for what is no JSON."""
    with _room_for_depth():
        return json.loads(text)


def standard_dumps(value: Any) -> bytes:
    """NaN and Infinity kept, as ``json`` writes them, in orjson's compact form otherwise:
    the text read by ``json`` only because a string looked like a wide integer (an id's
    digits) comes back as orjson would write it. ASCII only with a lone surrogate, which
    UTF-8 cannot hold. Any depth read from JSON (module docstring)."""
    with _room_for_depth():
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return json.dumps(value, separators=(",", ":")).encode()


def dumps(value: Any) -> bytes:
    """orjson, or the standard library for a value orjson cannot write: nested deeper than
    it writes, or (read by ``json``) holding an integer past 64 bits or a lone surrogate."""
    try:
        return orjson.dumps(value)
    except TypeError:  # a value read from JSON holds nothing else orjson refuses
        return standard_dumps(value)


def may_hold_wide_ints(text: bytes) -> bool:
    """``text`` may hold an integer orjson would read as a float."""
    return text.translate(_DIGITS_AS_ZEROS).find(_WIDE_INT) >= 0  # find: bytes' `in` costs more (sse.py)


def loads(text: bytes) -> tuple[Any, Encoder]:
    """``text`` read, and the encoder that writes it back exactly; ``ValueError`` when neither
    parser reads it (``RecursionError`` included: nested deeper than ``json`` recurses)."""
    if not may_hold_wide_ints(text):
        try:
            return orjson.loads(text), dumps
        except orjson.JSONDecodeError:
            pass
    try:
        return standard_loads(text), standard_dumps
    except (ValueError, RecursionError) as exc:
        raise ValueError(str(exc)) from None
