"""The Messages shape's figures at their bounds, payload by payload as the responder hands
them over: what the client reads in the patched usage, and what the record takes
(:class:`~proxy.patching.usage.ResponseUsage`)."""

from __future__ import annotations

from typing import Any

from proxy.accounting.records.record import MAX_COUNT
from proxy.patching.ledger import EngineUsage
from proxy.patching.shapes.messages import SHAPE
from proxy.patching.usage import ResponseUsage


def _start(usage: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                  "model": "m", "content": [], "usage": usage}}


def _delta(usage: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}


def test_a_message_deltas_own_figures_win_over_message_starts() -> None:
    """The anthropic SDK merges a delta's figures over message_start's: a figure the delta
    sends is the one the client reads, and the record bills."""
    seen = ResponseUsage()
    SHAPE.patch(_start({"input_tokens": 64, "output_tokens": 0}), None, "zero", seen)
    delta = _delta({"input_tokens": 16, "cache_read_input_tokens": 48, "output_tokens": 2})
    SHAPE.patch(delta, None, "zero", seen)
    assert (seen.prompt_tokens, seen.cached_tokens, seen.source) == (64, 48, "upstream")
    assert delta["usage"] == {"input_tokens": 16, "cache_read_input_tokens": 48, "output_tokens": 2}


def test_input_figures_that_add_up_past_int64_are_no_prompt_count() -> None:
    seen = ResponseUsage()
    SHAPE.patch({"type": "message", "usage": {"input_tokens": MAX_COUNT, "cache_read_input_tokens": 1}},
                None, "zero", seen)
    assert seen.prompt_tokens is None


def test_a_prompt_the_engine_found_whole_in_its_cache_reads_zero_fresh_input() -> None:
    """Anthropic's ``input_tokens`` excludes the cache reads: a prompt read whole from the
    cache is 0 fresh tokens, else the client adds the prompt twice."""
    engine = EngineUsage(prompt_tokens=64, cached_tokens=64, events=1)
    body = {"type": "message", "usage": {"input_tokens": 64, "output_tokens": 2}}
    seen = ResponseUsage()
    SHAPE.patch(body, engine, "zero", seen)
    assert body["usage"] == {"input_tokens": 0, "output_tokens": 2, "cache_read_input_tokens": 64}
    assert (seen.prompt_tokens, seen.cached_tokens) == (64, 64)


def test_cache_reads_without_a_prompt_count_are_not_believed_and_the_policy_is_written() -> None:
    """Reads are believed as figures of a prompt (:func:`~proxy.patching.usage.believed`):
    with no ``input_tokens`` they are none, and the ``zero`` policy writes its 0 for them."""
    body = {"type": "message", "usage": {"cache_read_input_tokens": 5, "output_tokens": 2}}
    seen = ResponseUsage()
    SHAPE.patch(body, None, "zero", seen)
    assert body["usage"] == {"cache_read_input_tokens": 0, "output_tokens": 2}
    assert (seen.prompt_tokens, seen.cached_tokens, seen.source) == (None, 0, None)


def test_the_upstreams_cache_writes_stand_where_the_engine_counts_none() -> None:
    """An engine event without a count of writes (an older vLLM) leaves the response's own:
    the client's three figures still add up to the prompt, and the record keeps them."""
    engine = EngineUsage(prompt_tokens=64, cached_tokens=16, cache_creation_tokens=None, events=1)
    body = {"type": "message", "usage": {"input_tokens": 24, "cache_read_input_tokens": 16,
                                         "cache_creation_input_tokens": 24, "output_tokens": 2}}
    seen = ResponseUsage()
    SHAPE.patch(body, engine, "zero", seen)
    assert body["usage"] == {"input_tokens": 24, "cache_read_input_tokens": 16, "cache_creation_input_tokens": 24,
                             "output_tokens": 2}
    assert (seen.prompt_tokens, seen.cached_tokens, seen.cache_creation_tokens, seen.source) == (64, 16, 24, "engine")


def test_a_reported_read_the_engine_overwrites_is_a_mismatch_and_an_equal_one_is_not() -> None:
    engine = EngineUsage(prompt_tokens=64, cached_tokens=48, events=1)
    mismatches = []
    for reported in (48, 5):
        seen = ResponseUsage()
        SHAPE.patch({"type": "message", "usage": {"input_tokens": 64 - reported, "cache_read_input_tokens": reported}},
                    engine, "zero", seen)
        mismatches.append(seen.mismatches)
    assert mismatches == [0, 1]
