"""UsagePatch.apply: which cached_tokens is written, and what else is (not) touched."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from engine_adapter.events import Scheduled
from proxy.patching.ledger import EngineUsage
from proxy.patching.usage import DETAILS_KEY, ResponseUsage, UsagePatch


def engine(*requests: Scheduled) -> EngineUsage:
    usage = EngineUsage()
    for event in requests:
        usage.add(event)
    return usage


def body(**usage: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66, **usage},
    }


ENGINE_48 = engine(Scheduled("k", 64, 48))
NO_TIERS = {"local": None, "external": None, "created": None}


def test_engine_value_is_written() -> None:
    payload = body()
    seen = ResponseUsage()
    assert UsagePatch(ENGINE_48).apply(payload, seen) is True
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert (seen.model, seen.prompt_tokens, seen.cached_tokens, seen.source) == ("m", 64, 48, "engine")
    assert seen.mismatches == 0


def test_engine_value_overwrites_a_different_reported_value_and_counts_a_mismatch() -> None:
    payload = body(prompt_tokens_details={"cached_tokens": 32})
    seen = ResponseUsage()
    assert UsagePatch(ENGINE_48).apply(payload, seen) is True
    assert payload["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert seen.mismatches == 1
    assert seen.source == "engine"


def test_engine_value_equal_to_the_reported_one_changes_nothing() -> None:
    payload = body(prompt_tokens_details={"cached_tokens": 48})
    before = copy.deepcopy(payload)
    seen = ResponseUsage()
    assert UsagePatch(ENGINE_48).apply(payload, seen) is None
    assert payload == before
    assert seen.mismatches == 0
    assert (seen.cached_tokens, seen.source) == (48, "engine")


def test_engine_value_overrides_llama_cpp_timings_and_counts_a_mismatch() -> None:
    payload = {**body(), "timings": {"cache_n": 10, "prompt_n": 54}}
    seen = ResponseUsage()
    UsagePatch(ENGINE_48).apply(payload, seen)
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert payload["timings"] == {"cache_n": 10, "prompt_n": 54}  # vendor fields untouched
    assert seen.mismatches == 1


def test_no_engine_event_keeps_the_reported_standard_value_as_upstream() -> None:
    payload = body(prompt_tokens_details={"cached_tokens": 32})
    before = copy.deepcopy(payload)
    seen = ResponseUsage()
    assert UsagePatch(None).apply(payload, seen) is None
    assert payload == before
    assert (seen.cached_tokens, seen.source, seen.mismatches) == (32, "upstream", 0)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_an_upstream_reporting_more_reads_than_its_prompt_is_not_believed(route: str) -> None:
    """vLLM reports a client's ``remote_prefill_cached_tokens`` claim as its reads, past the
    prompt too: such a figure is no count of this prompt, so the missing policy applies.
    (Messages counts its reads apart from ``input_tokens``: any figure there fits its prompt.)"""
    from proxy.patching.shapes import shape_for

    usages = {
        "chat": {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": 10_000_000}},
        "responses": {"input_tokens": 64, "input_tokens_details": {"cached_tokens": 65}},
    }
    seen = ResponseUsage()
    if route == "chat":
        payload = body(**usages["chat"])
        UsagePatch(None).apply(payload, seen)
        written = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    else:
        holder = {"object": "response", "usage": usages["responses"]}
        shape = shape_for(route)
        assert shape is not None
        shape.patch(holder, None, "zero", seen)
        written = holder["usage"]["input_tokens_details"]["cached_tokens"]
    assert (written, seen.cached_tokens, seen.source) == (0, 0, None)


@pytest.mark.parametrize(("usage", "recorded"), [
    ({"prompt_tokens": 10.0, "prompt_tokens_details": {"cached_tokens": 5}}, (None, 0, None, None)),
    ({"prompt_tokens": "10", "prompt_tokens_details": {"cached_tokens": 5}}, (None, 0, None, None)),
    ({"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": 1}}, (None, 0, None, None)),
    ({"prompt_tokens": -5, "prompt_tokens_details": {"cached_tokens": 0}}, (None, 0, None, None)),
    ({"prompt_tokens_details": {"cached_tokens": 300}}, (None, 0, None, None)),  # no prompt at all
    # writes past what the reads leave of the prompt are no count of it; the reads stand
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 1000}},
     (10, 4, None, "upstream")),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 6}},
     (10, 4, 6, "upstream")),
    # OpenAI's name for them, the same rule; it wins where both names are there
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 7}},
     (10, 4, None, "upstream")),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 6}},
     (10, 4, 6, "upstream")),
    ({"prompt_tokens": 10, "prompt_tokens_details": {
        "cached_tokens": 4, "cache_write_tokens": 5, "created_cache_tokens": 6}}, (10, 4, 5, "upstream")),
    ({"prompt_tokens": 10, "prompt_tokens_details": {
        "cached_tokens": 4, "cache_write_tokens": None, "created_cache_tokens": 6}}, (10, 4, 6, "upstream")),
])
def test_an_upstreams_figures_are_believed_only_as_counts_of_its_prompt(
    usage: dict[str, Any], recorded: tuple[Any, ...]
) -> None:
    """What the record and the counters take from an upstream with no engine event: a prompt
    that is a count, reads within it, writes within what the reads leave."""
    payload = {"id": "chatcmpl-1", "model": "m", "choices": [], "usage": {"completion_tokens": 2, **usage}}
    seen = ResponseUsage()
    UsagePatch(None).apply(payload, seen)
    assert (seen.prompt_tokens, seen.cached_tokens, seen.cache_creation_tokens, seen.source) == recorded


def test_no_engine_event_normalizes_llama_cpp_cache_n_into_the_standard_field() -> None:
    payload = {**body(), "timings": {"cache_n": 17, "prompt_n": 47}}
    seen = ResponseUsage()
    assert UsagePatch(None).apply(payload, seen) is True
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 17}
    assert (seen.cached_tokens, seen.source) == (17, "upstream")


def test_reported_zero_is_kept_as_zero() -> None:
    payload = body(prompt_tokens_details={"cached_tokens": 0})
    seen = ResponseUsage()
    assert UsagePatch(None, missing="omit").apply(payload, seen) is None
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (seen.cached_tokens, seen.source) == (0, "upstream")


def test_neither_with_zero_policy_writes_zero() -> None:
    payload = body()
    seen = ResponseUsage()
    assert UsagePatch(None, missing="zero").apply(payload, seen) is True
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (seen.cached_tokens, seen.source) == (0, None)


def test_neither_with_omit_policy_leaves_the_body_unchanged() -> None:
    bodies = (body(), body(prompt_tokens_details=None), body(prompt_tokens_details={"audio_tokens": 0}))
    for payload in bodies:
        before = copy.deepcopy(payload)
        seen = ResponseUsage()
        assert UsagePatch(None, missing="omit").apply(payload, seen) is None
        assert payload == before
        assert (seen.cached_tokens, seen.source) == (None, None)


def test_engine_zero_is_written_as_zero_not_omitted_or_null() -> None:
    payload = body()
    UsagePatch(engine(Scheduled("k", 64, 0)), missing="omit").apply(payload, ResponseUsage())
    assert b'"prompt_tokens_details":{"cached_tokens":0}' in orjson.dumps(payload)


def test_engine_zero_replaces_a_reported_null_or_false() -> None:
    for reported in (None, False):
        payload = body(prompt_tokens_details={"cached_tokens": reported})
        assert UsagePatch(engine(Scheduled("k", 64, 0))).apply(payload, ResponseUsage()) is True
        cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 0 and type(cached) is int


def test_null_prompt_tokens_details_is_replaced_by_an_object() -> None:
    payload = body(prompt_tokens_details=None)
    assert UsagePatch(ENGINE_48).apply(payload, ResponseUsage()) is True
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


def test_other_prompt_tokens_details_keys_are_untouched() -> None:
    payload = body(prompt_tokens_details={"audio_tokens": 3, "cached_tokens": 1, "x": [1, None]})
    UsagePatch(ENGINE_48).apply(payload, ResponseUsage())
    details = payload["usage"]["prompt_tokens_details"]
    assert details == {"audio_tokens": 3, "cached_tokens": 48, "x": [1, None]}
    assert payload["usage"]["prompt_tokens"] == 64  # the standard fields stay the engine's own
    assert payload["usage"]["total_tokens"] == 66


def test_payload_without_a_usage_object_is_left_alone() -> None:
    for payload in ({"choices": [{"delta": {"content": "x"}}], "usage": None}, {"choices": []}):
        before = copy.deepcopy(payload)
        seen = ResponseUsage()
        assert UsagePatch(ENGINE_48, details=True).apply(payload, seen) is None
        assert payload == before
        assert seen.source is None


def test_per_prompt_usage_object_gets_its_own_engine_request() -> None:
    two = engine(Scheduled("k", 40, 32), Scheduled("k", 24, 16))
    per_prompt = {"choices": [{"index": 1, "text": "x"}], "usage": {"prompt_tokens": 24}}
    UsagePatch(two).apply(per_prompt, ResponseUsage())
    assert per_prompt["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    whole = {"choices": [], "usage": {"prompt_tokens": 64}}
    UsagePatch(two).apply(whole, ResponseUsage())
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


def test_ambiguous_per_prompt_usage_falls_back_to_reported_then_policy() -> None:
    twins = engine(Scheduled("k", 40, 32), Scheduled("k", 40, 0))
    reported = {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 5}}}
    seen = ResponseUsage()
    UsagePatch(twins).apply(reported, seen)
    assert reported["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert (seen.source, seen.mismatches) == ("upstream", 0)

    unreported = {"choices": [], "usage": {"prompt_tokens": 40}}
    UsagePatch(twins, missing="omit").apply(unreported, ResponseUsage())
    assert unreported == {"choices": [], "usage": {"prompt_tokens": 40}}


def test_details_adds_the_tier_object_from_the_engine() -> None:
    tiers = engine(
        Scheduled("k", 40, 32, local_cached_tokens=16, external_cached_tokens=16, cache_creation_tokens=8),
        Scheduled("k", 24, 16, local_cached_tokens=16, external_cached_tokens=0, cache_creation_tokens=8),
    )
    payload = body()
    assert UsagePatch(tiers, details=True).apply(payload, ResponseUsage()) is True
    assert payload[DETAILS_KEY] == {"local": 32, "external": 16, "created": 16, "source": "engine"}
    # The standard fields are the same as without details.
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 48, "created_cache_tokens": 16,
                                                         "cache_write_tokens": 16}


@pytest.mark.parametrize(
    ("patch", "usage", "want"),
    [
        (UsagePatch(ENGINE_48, details=True), {}, {**NO_TIERS, "source": "engine"}),
        (
            UsagePatch(None, details=True),
            {"prompt_tokens_details": {"cached_tokens": 3}},
            {**NO_TIERS, "source": "upstream"},
        ),
        (UsagePatch(None, details=True), {}, {**NO_TIERS, "source": "unknown"}),
    ],
)
def test_details_source(patch: UsagePatch, usage: dict[str, Any], want: dict[str, Any]) -> None:
    payload = body(**usage)
    patch.apply(payload, ResponseUsage())
    assert payload[DETAILS_KEY] == want


def test_no_details_by_default() -> None:
    payload = body()
    UsagePatch(ENGINE_48).apply(payload, ResponseUsage())
    assert DETAILS_KEY not in payload


def test_cache_writes_go_in_openais_and_vllms_fields_for_the_whole_request_only() -> None:
    """``cache_write_tokens`` (OpenAI's name, the ``openai`` SDK's) and ``created_cache_tokens``
    (vLLM's) are the engine's count of prompt tokens written to the cache, 0 included; a
    per-prompt usage chunk of a two-prompt request gets none, since the engine reports writes
    for the request as a whole."""
    writes = engine(
        Scheduled("k", 40, 32, cache_creation_tokens=0),
        Scheduled("k", 24, 0, cache_creation_tokens=16),
    )
    whole = body(prompt_tokens_details={"cached_tokens": 32, "created_cache_tokens": 16, "cache_write_tokens": 9})
    assert UsagePatch(writes).apply(whole, ResponseUsage()) is True
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 32, "created_cache_tokens": 16,
                                                       "cache_write_tokens": 16}
    per_prompt = body(prompt_tokens=24)
    UsagePatch(writes).apply(per_prompt, ResponseUsage())
    assert per_prompt["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    none_written = body()
    UsagePatch(engine(Scheduled("k", 64, 64, cache_creation_tokens=0))).apply(none_written, ResponseUsage())
    assert b'"created_cache_tokens":0,"cache_write_tokens":0' in orjson.dumps(none_written)


def test_a_responses_upstreams_writes_past_its_prompt_are_not_recorded() -> None:
    from proxy.patching.shapes import shape_for

    shape = shape_for("responses")
    assert shape is not None
    for writes, recorded in ((1000, None), (6, 6)):
        holder = {"object": "response", "usage": {"input_tokens": 10, "input_tokens_details": {
            "cached_tokens": 4, "cache_write_tokens": writes}}}
        seen = ResponseUsage()
        shape.patch(holder, None, "zero", seen)
        assert (seen.prompt_tokens, seen.cached_tokens, seen.cache_creation_tokens) == (10, 4, recorded)
        assert holder["usage"]["input_tokens_details"]["cache_write_tokens"] == writes  # the client's answer is the upstream's


def test_a_choices_usage_chunk_reads_its_own_prompts_hits_when_prompts_share_a_length() -> None:
    """Two 300-token prompts, the first cold, the second warm (vLLM says which choices each
    engine request makes): each choice's chunk carries its own prompt's hits. A chunk of two
    choices is no one prompt's: by length they are ambiguous, and the policy's 0 is written."""
    twins = engine(Scheduled("k", 300, 0, first_choice=0, choices=1), Scheduled("k", 300, 256, first_choice=1, choices=1))
    chunks = [{"choices": [{"index": i, "text": "x"}], "usage": {"prompt_tokens": 300}} for i in (0, 1)]
    for chunk in chunks:
        UsagePatch(twins).apply(chunk, ResponseUsage())
    assert [c["usage"]["prompt_tokens_details"] for c in chunks] == [{"cached_tokens": 0}, {"cached_tokens": 256}]
    both = {"choices": [{"index": 1, "text": "x"}, {"index": 0, "text": "y"}], "usage": {"prompt_tokens": 300}}
    seen = ResponseUsage()
    UsagePatch(twins).apply(both, seen)
    assert (both["usage"]["prompt_tokens_details"], seen.source) == ({"cached_tokens": 0}, None)


@pytest.mark.parametrize(("reads", "writes", "believed"), [
    (64, None, (64, None)),  # the whole prompt read from the cache
    (40, 24, (40, 24)),  # reads and writes that are the whole prompt
    (48, 24, (48, None)),  # writes past what the reads leave of the prompt
    (0, 64, (0, 64)),  # no reads: the whole prompt written
    (0, 65, (0, None)),  # no reads, and writes one past the prompt
])
def test_an_upstreams_reads_and_writes_are_believed_up_to_the_prompt_and_no_further(
        reads: int, writes: int | None, believed: tuple[int, int | None]) -> None:
    details: dict[str, Any] = {"cached_tokens": reads} | ({} if writes is None else {"created_cache_tokens": writes})
    payload = {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 1, "prompt_tokens_details": details}}
    seen = ResponseUsage()
    UsagePatch(None).apply(payload, seen)
    assert (seen.cached_tokens, seen.cache_creation_tokens, seen.source) == (*believed, "upstream")


def test_reads_and_writes_already_exact_leave_the_body_as_the_upstream_sent_it() -> None:
    """Nothing to patch: the client gets the upstream's bytes, not a re-encoding of them."""
    details = {"cached_tokens": 48, "created_cache_tokens": 16, "cache_write_tokens": 16}
    payload = body(prompt_tokens_details=dict(details))
    writes = engine(Scheduled("k", 64, 48, cache_creation_tokens=16))
    assert UsagePatch(writes).apply(payload, ResponseUsage()) is None
    assert payload["usage"]["prompt_tokens_details"] == details


@pytest.mark.parametrize("name", ["created_cache_tokens", "cache_write_tokens"])
def test_a_writes_figure_equal_only_as_a_bool_is_rewritten_as_a_count(name: str) -> None:
    """``true`` equals 1 in Python, not to a client: the engine's 1 replaces it."""
    payload = body(prompt_tokens_details={"cached_tokens": 48, "created_cache_tokens": 1, "cache_write_tokens": 1,
                                          name: True})
    writes = engine(Scheduled("k", 64, 48, cache_creation_tokens=1))
    assert UsagePatch(writes).apply(payload, ResponseUsage()) is True
    assert b'"created_cache_tokens":1,"cache_write_tokens":1' in orjson.dumps(payload)
