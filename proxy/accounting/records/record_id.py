"""Record ids: RFC 9562 UUIDv7 strings, minted by the server for every usage record.

A record's ``request_id`` is the client's ``X-Request-Id``, which a client may reuse; the
``record_id`` is ours, unique across processes, replicas and restarts, and what a
pipeline (``cachetally report`` included) deduplicates on. Python's :mod:`uuid` has
``uuid7`` only from 3.14, so this follows the layout that version uses (RFC 9562 section
5.7, with the counter of section 6.2, method 1):

- 48 bits: Unix time in milliseconds;
- 4 bits version (7), then 12 + 30 bits: a counter, reseeded with random bits (its top
  bit clear) at each new millisecond and incremented within one, so that the ids one
  process mints sort in the order they were minted;
- 2 bits variant (``10``), then the counter's low 30 bits and 32 fresh random bits.

Across processes uniqueness rests on the random bits: 73 of them (41 of the counter's
seed, 32 per id) for two ids minted in the same millisecond, drawn from a generator each
process seeds with 256 bits from the OS. A forked child starts a
fresh counter, so it never continues its parent's sequence.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

_COUNTER_BITS = 42
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1

_lock = threading.Lock()
_last_ms = 0
_counter = 0
#: The random bits: a generator seeded from the OS once per process (and again in a forked
#: child), so that minting costs no system call. Ids need to be unique, not unguessable.
_random = random.Random(os.urandom(32))


def _reset() -> None:
    global _last_ms, _counter
    _last_ms, _counter = 0, 0
    _random.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reset)


def _uuid7_int() -> int:
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _counter = _random.getrandbits(41)  # the top bit of the 42-bit counter clear
        else:
            # Same millisecond, or the clock stepped back: keep counting from the last id.
            now_ms = _last_ms
            _counter += 1
            if _counter > _COUNTER_MAX:  # 2**41 ids in one millisecond: borrow the next one
                now_ms += 1
                _counter = _random.getrandbits(41)
        _last_ms = now_ms
        counter = _counter
        tail = _random.getrandbits(32)
    value = (now_ms & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76 | (counter >> 30) << 64  # version, counter's high 12 bits
    return value | 0b10 << 62 | (counter & 0x3FFF_FFFF) << 32 | tail  # variant, low 30 bits, random


def uuid7() -> uuid.UUID:
    """A new UUIDv7; later than every one this process minted before."""
    return uuid.UUID(int=_uuid7_int())


def new_record_id() -> str:
    """A record id: a UUIDv7 in its canonical 36-character form (what ``str(uuid7())`` gives)."""
    h = f"{_uuid7_int():032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
