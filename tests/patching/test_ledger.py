"""UsageLedger: slot lifetime, aggregation over engine requests, and the drop guards."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from engine_adapter.events import EventSink, Scheduled
from proxy.accounting.metrics import Metrics
from proxy.patching.ledger import EngineUsage, UsageLedger
from tests.patching.test_middleware import DONE, ROLE, TOKEN, USAGE, Client, Harness, chat_request, sse_payloads, start


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ledger_is_an_event_sink() -> None:
    assert isinstance(UsageLedger(), EventSink)


def test_two_events_sum_prompt_and_cached_tokens() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", prompt_tokens=40, cached_tokens=32))
    ledger.publish(Scheduled("r1", prompt_tokens=24, cached_tokens=16))

    usage = ledger.usage("r1")
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.events) == (64, 48, 2)
    assert usage.per_request == [(40, 32, None, 1), (24, 16, None, 1)]

    closed = ledger.close("r1")
    assert closed is usage
    assert len(ledger) == 0
    assert "r1" not in ledger


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_per_prompt_usage_gets_its_own_prompts_hits_when_prompts_share_a_length(n: int) -> None:
    """Completions over two prompts of 300 tokens, one warm (256 cached), one cold: a usage
    chunk of one choice reads the hits of the engine request that makes that choice. By
    length alone the two are ambiguous, and read ``None`` (the missing policy's 0)."""
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", prompt_tokens=300, cached_tokens=0, first_choice=n, choices=n))  # prefilled first
    ledger.publish(Scheduled("r1", prompt_tokens=300, cached_tokens=256, first_choice=0, choices=n))
    usage = ledger.usage("r1")
    assert usage is not None
    assert [usage.cached_for(300, choice) for choice in range(2 * n)] == [256] * n + [0] * n
    assert usage.cached_for(300) is None  # no choice said: ambiguous
    assert usage.cached_for(600, 0) == 256  # the whole request's usage: the sum
    ledger.publish(Scheduled("r1", prompt_tokens=40, cached_tokens=32))  # an engine that does not say
    assert usage.cached_for(40, 2 * n) == 32


def test_tiers_sum_and_unknown_tiers_stay_none() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", 40, 32, local_cached_tokens=16, external_cached_tokens=16))
    ledger.publish(
        Scheduled("r1", 24, 16, local_cached_tokens=16, external_cached_tokens=0, cache_creation_tokens=8)
    )
    usage = ledger.close("r1")
    assert usage is not None
    assert usage.local_cached_tokens == 32
    assert usage.external_cached_tokens == 16
    # Only the second event knew cache creation: the sum is its value, not None.
    assert usage.cache_creation_tokens == 8


_TIERS = ("local_cached_tokens", "external_cached_tokens", "cache_creation_tokens", "transferred_tokens",
          "decode_local_tokens")


@st.composite
def _engine_requests(draw: st.DrawFn) -> list[Scheduled]:
    """An HTTP request's engine requests (one per prompt, or ``n`` of them), each with its own
    figures; any tier may be unknown to any of them."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.integers(1, 100))
        tiers = {name: draw(st.none() | st.integers(1, prompt)) for name in _TIERS}
        out.append(Scheduled("r1", prompt, draw(st.integers(0, prompt)), **tiers))
    return out


@given(requests=_engine_requests(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_a_requests_figures_are_its_engine_requests_summed_in_whatever_order_they_come(
    requests: list[Scheduled], data: st.DataObject
) -> None:
    """The record of a request over several prompts (or ``n > 1``) bills each figure as the sum
    of what its engine requests reported, whichever engine request's ``Scheduled`` comes
    first; a tier only some of them knew is the sum of theirs, one none knew stays ``None``."""
    ledger = UsageLedger()
    ledger.open("r1")
    for event in data.draw(st.permutations(requests)):
        ledger.publish(event)
    usage = ledger.close("r1")
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens) == (
        sum(r.prompt_tokens for r in requests), sum(r.cached_tokens for r in requests))
    for name in _TIERS:
        known = [getattr(r, name) for r in requests if getattr(r, name) is not None]
        assert getattr(usage, name) == (sum(known) if known else None), name


def test_tiers_nobody_reported_stay_none() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", 10, 0))
    ledger.publish(Scheduled("r1", 10, 10))
    usage = ledger.close("r1")
    assert usage is not None
    assert usage.cached_tokens == 10
    assert (usage.local_cached_tokens, usage.external_cached_tokens, usage.cache_creation_tokens) == (
        None,
        None,
        None,
    )


def test_zero_cached_tokens_is_a_value_not_absence() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    assert ledger.usage("r1") is None  # no event yet
    ledger.publish(Scheduled("r1", 12, 0))
    usage = ledger.usage("r1")
    assert usage is not None and usage.cached_tokens == 0


def test_close_without_events_returns_none_and_frees_the_slot() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    assert ledger.close("r1") is None
    assert len(ledger) == 0
    assert ledger.close("r1") is None  # closing twice is harmless


def test_unmatched_events_are_counted_and_not_stored() -> None:
    ledger = UsageLedger()
    ledger.publish(Scheduled("ghost", 10, 5))
    assert ledger.counters.unmatched_events == 1
    assert len(ledger) == 0

    # A slot opened later under that key does not see the earlier event.
    ledger.open("ghost")
    assert ledger.usage("ghost") is None

    # Nor does an event arriving after the slot closed land anywhere.
    ledger.close("ghost")
    ledger.publish(Scheduled("ghost", 10, 5))
    assert ledger.counters.unmatched_events == 2
    assert len(ledger) == 0


def test_slot_context_manager_closes_on_exception() -> None:
    ledger = UsageLedger()
    with pytest.raises(RuntimeError, match="boom"):
        with ledger.slot("r1") as key:
            assert key == "r1"
            ledger.publish(Scheduled("r1", 8, 8))
            assert len(ledger) == 1
            raise RuntimeError("boom")
    assert len(ledger) == 0
    ledger.publish(Scheduled("r1", 8, 8))
    assert ledger.counters.unmatched_events == 1


def test_duplicate_open_raises_and_keeps_the_first_slot() -> None:
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", 8, 4))
    with pytest.raises(KeyError):
        ledger.open("r1")
    usage = ledger.usage("r1")
    assert usage is not None and usage.cached_tokens == 4
    assert len(ledger) == 1


def test_ttl_sweep_evicts_only_stale_slots_and_counts_them() -> None:
    clock = FakeClock()
    ledger = UsageLedger(ttl_s=60.0, clock=clock)
    ledger.open("old")
    clock.now += 30
    ledger.open("young")
    clock.now += 31  # "old" is 61 s old, "young" 31 s

    assert ledger.sweep() == 1
    assert "old" not in ledger and "young" in ledger
    assert ledger.counters.evicted_ttl == 1

    assert ledger.sweep() == 0  # nothing else is stale
    assert ledger.counters.evicted_ttl == 1

    clock.now += 30
    assert ledger.sweep() == 1
    assert len(ledger) == 0
    assert ledger.counters.evicted_ttl == 2
    assert ledger.counters.evicted_cap == 0


def test_cap_evicts_the_oldest_slot_first_and_counts_it() -> None:
    ledger = UsageLedger(max_slots=2)
    ledger.open("a")
    ledger.open("b")
    ledger.open("c")
    assert len(ledger) == 2
    assert "a" not in ledger and "b" in ledger and "c" in ledger
    assert ledger.counters.evicted_cap == 1

    ledger.close("b")
    ledger.open("d")  # room again: no eviction
    assert ledger.counters.evicted_cap == 1
    ledger.open("e")  # evicts "c", now the oldest
    assert len(ledger) == 2
    assert "c" not in ledger and "d" in ledger and "e" in ledger
    assert ledger.counters.evicted_cap == 2


@pytest.mark.asyncio
async def test_a_key_the_cap_evicted_stays_taken_while_its_request_runs() -> None:
    """Its figures go, its key does not: no later request is given it, so the evicted
    request's close cannot close another's slot, nor its late events land in one."""
    ledger = UsageLedger(max_slots=1)
    release = asyncio.Event()

    async def request(key: str, close: bool) -> EngineUsage | None:
        ledger.open(key)
        await release.wait()
        return ledger.close(key) if close else None

    evicted = asyncio.create_task(request("x", close=True))
    leaked = asyncio.create_task(request("y", close=False))  # evicts x, then misses its close
    await asyncio.sleep(0)
    ledger.open("z")  # evicts y
    assert ledger.counters.evicted_cap == 2 and len(ledger) == 1
    assert "x" in ledger and "y" in ledger
    with pytest.raises(KeyError):
        ledger.open("x")
    ledger.publish(Scheduled("x", 100, 64))  # the evicted request's late prefill
    assert ledger.counters.unmatched_events == 1
    release.set()
    assert await evicted is None
    await leaked
    assert "x" not in ledger and "y" in ledger
    assert ledger.sweep() == 0 and "y" not in ledger  # its task ended without a close
    assert "z" in ledger


def test_max_slots_must_be_positive() -> None:
    with pytest.raises(ValueError):
        UsageLedger(max_slots=0)


def _usage(*requests: tuple[int, int]) -> EngineUsage:
    usage = EngineUsage()
    for prompt, cached in requests:
        usage.add(Scheduled("k", prompt, cached))
    return usage


def test_cached_for_whole_request_matches_the_aggregate() -> None:
    usage = _usage((40, 32), (24, 16))
    assert usage.cached_for(64) == 48
    # A usage object without an int prompt_tokens gets the aggregate too.
    assert usage.cached_for(None) == 48


def test_cached_for_a_per_prompt_usage_object_matches_its_engine_request() -> None:
    usage = _usage((40, 32), (24, 16))
    assert usage.cached_for(40) == 32
    assert usage.cached_for(24) == 16


def test_cached_for_ambiguous_or_unknown_prompt_length_is_none() -> None:
    usage = _usage((40, 32), (40, 0), (24, 16))
    assert usage.cached_for(40) is None  # two prompts of 40 tokens, different hits
    assert usage.cached_for(7) is None  # no engine request of that length


def test_cached_for_same_length_same_value_is_not_ambiguous() -> None:
    # n > 1 or identical prompts: equal lengths with equal hits give one answer.
    usage = _usage((40, 32), (40, 32), (24, 16))
    assert usage.cached_for(40) == 32


@pytest.mark.asyncio
async def test_the_sweep_never_takes_a_live_requests_slot() -> None:
    """Past the TTL, a slot is swept only once the request that opened it has ended."""
    clock = FakeClock()
    ledger = UsageLedger(ttl_s=60.0, clock=clock)
    release = asyncio.Event()

    async def long_request() -> EngineUsage | None:
        with ledger.slot("live"):
            ledger.publish(Scheduled("live", 100, 64))
            await release.wait()
            return ledger.usage("live")

    async def missed_drop_guard() -> None:
        ledger.open("leaked")  # ends without closing its slot

    live = asyncio.create_task(long_request())
    await asyncio.create_task(missed_drop_guard())
    await asyncio.sleep(0)
    ledger.open("opened-here")  # by this test's own task, still running
    clock.now += 3600.0  # an hour: far past the TTL

    assert ledger.sweep() == 1  # the leaked slot only
    assert "leaked" not in ledger and "live" in ledger and "opened-here" in ledger
    assert ledger.counters.evicted_ttl == 1
    release.set()
    usage = await live
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (100, 64)
    ledger.close("opened-here")
    assert len(ledger) == 0


@pytest.mark.asyncio
async def test_a_stream_that_outlives_the_ttl_still_reports_the_engines_figures() -> None:
    """Through the middleware: the sweep runs (an hour on the fake clock) mid-stream."""
    clock = FakeClock()
    h = Harness()
    h.ledger = UsageLedger(ttl_s=900.0, clock=clock)
    h.metrics = Metrics(h.ledger)
    first_sent = asyncio.Event()
    swept = asyncio.Event()

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await start(send, b"text/event-stream")
        await send({"type": "http.response.body", "body": ROLE, "more_body": True})
        first_sent.set()
        await swept.wait()
        for event in (TOKEN, USAGE, DONE):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    client = Client(chat_request(stream=True, stream_options={"include_usage": True}))
    call = asyncio.create_task(h.call(h.middleware(respond, (64, 48)), client))
    await first_sent.wait()
    clock.now += 3600.0
    assert h.ledger.sweep() == 0
    swept.set()
    await call

    [usage] = [e["usage"] for e in sse_payloads(client.body)[:-1] if e.get("usage")]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 48
    assert h.ledger.counters.evicted_ttl == 0
    assert h.requests() == {"hit": 1}


def test_a_beam_searchs_engine_steps_are_no_tokens_of_its_answer() -> None:
    """vLLM's beam search runs one-token engine steps per beam and builds its answer outside
    them: the steps' tokens are neither the answer's count nor a prompt, so a search cut
    before its answer leaves no engine count (and the first step's prompt stands)."""
    ledger = UsageLedger()
    ledger.open("k")
    ledger.first_event_only("k")
    for step in range(5):
        ledger.publish(Scheduled(request_id="k", prompt_tokens=64 + step, cached_tokens=step))
        ledger.generated("k", 1)
    usage = ledger.close("k")
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.generated_tokens) == (64, 0, None)
    ledger.open("plain")
    ledger.generated("plain", 3)
    ledger.publish(Scheduled(request_id="plain", prompt_tokens=10, cached_tokens=0))
    usage = ledger.close("plain")
    assert usage is not None and usage.generated_tokens == 3


@pytest.mark.parametrize(("steps_prefilled", "billed"), [(5, (64, 0, 0)), (0, (0, 0, 1))])
def test_a_beam_search_cut_is_billed_its_first_steps_prompt_once(steps_prefilled: int, billed: tuple) -> None:
    """Each beam-search step is an engine request the tap announces (``added``) on the prompt
    and the tokens chosen so far: the slot keeps the first, settled by the first ``Scheduled``,
    or left unscheduled (its cache unknown) when the search was cut before any prefill ended."""
    ledger = UsageLedger()
    ledger.open("k")
    ledger.first_event_only("k")
    for step in range(5):
        ledger.added("k", 64 + step)
        if step < steps_prefilled:
            ledger.publish(Scheduled(request_id="k", prompt_tokens=64 + step, cached_tokens=step))
    usage = ledger.close("k")
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.unscheduled) == billed
    assert usage.unscheduled_tokens == (64 if steps_prefilled == 0 else 0)


def test_a_beam_search_whose_first_steps_figures_were_refused_is_billed_its_prompt_with_its_cache_unknown() -> None:
    """The tap publishes nothing for a step whose figures fail ``Scheduled``'s checks, and vLLM
    starts the next step after that prefill: the next step's ``Scheduled`` (its prompt one
    token longer, its cache its own) must not settle the first step's announcement. Found by
    tests/patching/test_ledger_interleavings.py."""
    ledger = UsageLedger()
    ledger.open("k")
    ledger.first_event_only("k")
    ledger.added("k", 64)  # step 1, its figures refused: no Scheduled
    for _ in range(2):  # step 2, two beams, each on the prompt and the token chosen
        ledger.added("k", 65)
        ledger.publish(Scheduled(request_id="k", prompt_tokens=65, cached_tokens=64))
    usage = ledger.close("k")
    assert usage is not None
    # what its record bills (proxy.patching.metering): the client's prompt, its cache unknown
    if usage.unscheduled:
        billed = usage.prompt_tokens + usage.unscheduled_tokens, None
    else:
        billed = usage.prompt_tokens, usage.cached_tokens
    assert billed == (64, None)


def test_a_choices_usage_whose_prompt_is_not_its_engine_requests_reads_no_hits() -> None:
    """The engine request that makes a choice had another prompt length than the chunk says:
    the figures do not describe the same prompt, so neither request's hits are written."""
    ledger = UsageLedger()
    ledger.open("r1")
    ledger.publish(Scheduled("r1", prompt_tokens=300, cached_tokens=256, first_choice=0, choices=1))
    ledger.publish(Scheduled("r1", prompt_tokens=200, cached_tokens=0, first_choice=1, choices=1))
    usage = ledger.usage("r1")
    assert usage is not None
    assert (usage.cached_for(300, 0), usage.cached_for(250, 0), usage.cached_for(300, 1)) == (256, None, None)
