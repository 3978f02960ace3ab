"""The micro figures of ``cachetally bench proxy``: :class:`~proxy.patching.sse.SSEPatcher` timed alone.

- a pass-through event: one token chunk per ``feed`` (the fast path), and split in two
  (the buffering path, e.g. an event cut across TCP reads);
- a usage event: parsed, patched with :class:`~proxy.patching.usage.UsagePatch` against an engine
  slot, and re-serialized, as the middleware does for every final usage chunk.

Each is the median of five timed loops of ``events`` feeds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from engine_adapter.sim.protocol import sse, stream_choice, usage
from proxy.patching.ledger import EngineUsage
from proxy.patching.sse import SSEPatcher
from proxy.patching.usage import ResponseUsage, UsagePatch

_HEAD = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk",
         "created": 1_700_000_000, "model": "sim-model"}
TOKEN_EVENT = sse({**_HEAD, "choices": [stream_choice("chat", 0, " tok1", False)]})
USAGE_EVENT = sse({**_HEAD, "choices": [], "usage": usage(120, 16, None)})


def _per_event_us(events: int, loop: Callable[[int], None]) -> float:
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        loop(events)
        timings.append((time.perf_counter() - start) / events * 1e6)
    return statistics.median(timings)


def micro(events: int) -> dict[str, float]:
    slot = EngineUsage(prompt_tokens=120, cached_tokens=96)
    in_response = ResponseUsage()
    patcher = SSEPatcher(lambda payload: UsagePatch(engine=slot).apply(payload, in_response))
    half = len(TOKEN_EVENT) // 2
    head, tail = TOKEN_EVENT[:half], TOKEN_EVENT[half:]

    def whole(n: int) -> None:
        feed = patcher.feed
        for _ in range(n):
            feed(TOKEN_EVENT)

    def split(n: int) -> None:
        feed = patcher.feed
        for _ in range(n):
            feed(head)
            feed(tail)

    def patched(n: int) -> None:
        feed = patcher.feed
        for _ in range(n):
            feed(USAGE_EVENT)

    out = patcher.feed(USAGE_EVENT)
    assert b'"cached_tokens":96' in out, out  # the loop below times a real patch
    return {
        "passthrough_event_us": _per_event_us(events, whole),
        "passthrough_split_event_us": _per_event_us(events, split),
        "usage_event_us": _per_event_us(events, patched),
    }
