"""The ledger's pairing of announced engine requests with their ``Scheduled``, over interleavings.

Several HTTP requests run at once, each with 1 to 3 prompts and ``n`` 1 to 3 (one engine
request per prompt, as vLLM's tap and the sim announce them), or a beam search (one engine
request for its first step, then ``n`` per step, each step after the last one's prefills).
Announcements and ``Scheduled`` arrive in any order an engine can produce (an engine
request's announcement first; none at all for one whose figures the tap refused), for open,
closed and unknown keys; a request closes at any
point; the clock moves and the TTL sweep and the size cap evict.

The oracle is a plain model of which engine requests of each key were announced and
scheduled while its slot was open, billed by the rule of docs/ACCOUNTING.md ("Billed with
its cache unknown"): every announced engine request's prompt, and the cached tokens only
where each of them was scheduled, else unknown (``None``). A beam search bills its first
step's prompt only. A slot evicted before its close bills nothing from the engine. After
every step the ledger holds exactly the open slots and counts what the model counts; after
the last close, nothing. 200 examples of 30 steps; ``CACHETALLY_INTERLEAVINGS=N`` for more.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_adapter.events import Scheduled
from proxy.patching.ledger import EngineUsage, UsageLedger

TTL_S = 10.0


def billed(usage: EngineUsage | None) -> tuple[int, int | None] | None:
    """The record's (prompt_tokens, cached_tokens) from a closed slot's usage, as
    docs/ACCOUNTING.md states it: ``None`` where the engine reported nothing."""
    if usage is None:
        return None
    if usage.unscheduled:  # an engine request cut before its prefill: its cache unknown
        return usage.prompt_tokens + usage.unscheduled_tokens, None
    return usage.prompt_tokens, usage.cached_tokens


@dataclass
class EngineRequest:
    prompt_tokens: int
    first_choice: int | None
    choices: int
    step: int = 1  # a beam search's step; 1 for every other request
    announced: bool = False
    announced_while_open: bool = False
    cached_tokens: int | None = None  # set when its Scheduled is published
    scheduled_while_open: bool = False
    refused: bool = False  # prefilled, its figures refused: no Scheduled will come

    def prefilled(self) -> bool:
        return self.cached_tokens is not None or self.refused


@dataclass
class HttpRequest:
    key: str
    prompts: list[int]
    n: int
    beam: bool
    opened_at: float
    owner: asyncio.Task[None] | None
    requests: list[EngineRequest] = field(default_factory=list)
    open: bool = True  # its slot holds figures: neither closed nor evicted
    evicted: bool = False
    closed: bool = False
    taken: bool = True  # ``key in ledger``

    def owner_ended(self) -> bool:
        return self.owner is None or self.owner.done()

    def expected(self) -> tuple[int, int | None] | None:
        """What its record bills from the engine, by the model alone."""
        if self.evicted:
            return None
        counted = [r for r in self.requests if r.announced_while_open]
        if self.beam:
            counted = counted[:1]  # the first step's, the client's prompt
        if not counted:
            return None
        prompt = sum(r.prompt_tokens for r in counted)
        if all(r.scheduled_while_open for r in counted):
            return prompt, sum(r.cached_tokens or 0 for r in counted)
        return prompt, None


class LedgerInterleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 1000.0
        self.ledger = UsageLedger(ttl_s=TTL_S, clock=lambda: self.now)
        self.requests: list[HttpRequest] = []
        self.unmatched = self.evicted_ttl = self.evicted_cap = 0
        self.max_slots = 100_000

    @initialize(max_slots=st.sampled_from([2, 3, 100_000]))
    def size_cap(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.ledger = UsageLedger(ttl_s=TTL_S, max_slots=max_slots, clock=lambda: self.now)

    # -- requests --------------------------------------------------------------------------

    @rule(
        prompts=st.lists(st.integers(1, 60), min_size=1, max_size=3),
        n=st.integers(1, 3),
        beam=st.booleans(),
        owned=st.booleans(),
    )
    def open_request(self, prompts: list[int], n: int, beam: bool, owned: bool) -> None:
        if beam:
            prompts = prompts[:1]  # a beam search over several prompts is refused while billing
        key = f"k{len(self.requests)}"
        open_slots = [r for r in self.requests if r.open]
        if len(open_slots) >= self.max_slots:
            oldest = open_slots[0]
            oldest.open, oldest.evicted = False, True
            oldest.taken = not oldest.owner_ended()
            self.evicted_cap += 1
        owner = self._open_in_a_task(key) if owned else None
        if owner is None:
            self.ledger.open(key)
        if beam:
            self.ledger.first_event_only(key)
        request = HttpRequest(key, prompts, n, beam, self.now, owner)
        if beam:
            request.requests.append(EngineRequest(prompts[0], None, 1))
        else:
            request.requests.extend(EngineRequest(p, i * n, n) for i, p in enumerate(prompts))
        self.requests.append(request)

    def _open_in_a_task(self, key: str) -> asyncio.Task[None]:
        """Open ``key`` from a task that runs on (a request still being served) until ended."""
        ended = self.loop.create_future()

        async def serve() -> None:
            self.ledger.open(key)
            await ended

        task = self.loop.create_task(serve())
        self.loop.run_until_complete(asyncio.sleep(0))
        assert key in self.ledger
        task.ended = ended  # type: ignore[attr-defined]
        return task

    @precondition(lambda self: any(r.owner is not None and not r.owner.done() for r in self.requests))
    @rule(data=st.data())
    def end_a_request_without_its_close(self, data: st.DataObject) -> None:
        """A missed drop guard: the task that served it ends, its slot still open."""
        live = [r for r in self.requests if r.owner is not None and not r.owner.done()]
        request = data.draw(st.sampled_from(live))
        assert request.owner is not None
        request.owner.ended.set_result(None)  # type: ignore[attr-defined]
        self.loop.run_until_complete(request.owner)

    # -- engine events ---------------------------------------------------------------------

    def _announceable(self) -> list[tuple[HttpRequest, EngineRequest]]:
        return [(h, r) for h in self.requests for r in h.requests if not r.announced]

    def _schedulable(self) -> list[tuple[HttpRequest, EngineRequest]]:
        return [(h, r) for h in self.requests for r in h.requests if r.announced and not r.prefilled()]

    @precondition(lambda self: bool(self._announceable()))
    @rule(data=st.data())
    def announce(self, data: st.DataObject) -> None:
        http, request = data.draw(st.sampled_from(self._announceable()))
        request.announced, request.announced_while_open = True, http.open
        self.ledger.added(http.key, request.prompt_tokens)

    @precondition(lambda self: bool(self._schedulable()))
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        http, request = data.draw(st.sampled_from(self._schedulable()))
        request.cached_tokens = data.draw(st.integers(0, request.prompt_tokens))
        request.scheduled_while_open = http.open
        self.unmatched += not http.open
        self.ledger.publish(Scheduled(http.key, request.prompt_tokens, request.cached_tokens,
                                      first_choice=request.first_choice, choices=request.choices))
        self._next_beam_step(http, request)

    @precondition(lambda self: bool(self._schedulable()))
    @rule(data=st.data())
    def refuse_figures(self, data: st.DataObject) -> None:
        """The engine request was prefilled but its figures failed ``Scheduled``'s checks (the
        tap logs and publishes nothing): the request goes on, its cache unknown."""
        http, request = data.draw(st.sampled_from(self._schedulable()))
        request.refused = True
        self._next_beam_step(http, request)

    @staticmethod
    def _next_beam_step(http: HttpRequest, request: EngineRequest) -> None:
        if http.beam and all(r.prefilled() for r in http.requests):
            # the step's beams are prefilled: the next step runs n engine requests, each on
            # the prompt and the tokens chosen so far
            step = request.step + 1
            http.requests.extend(EngineRequest(http.prompts[0] + step - 1, None, 1, step) for _ in range(http.n))

    @rule(key=st.sampled_from(["never-opened", ""]), prompt_tokens=st.integers(0, 60), publish=st.booleans())
    def event_for_an_unknown_key(self, key: str, prompt_tokens: int, publish: bool) -> None:
        if publish:
            self.ledger.publish(Scheduled(key, prompt_tokens, 0))
            self.unmatched += 1
        else:
            self.ledger.added(key, prompt_tokens)

    # -- the request's end, and the second line of defence ---------------------------------

    @precondition(lambda self: any(not r.closed for r in self.requests))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.requests if not r.closed]))
        expected = request.expected()
        request.open, request.closed, request.taken = False, True, False
        assert billed(self.ledger.close(request.key)) == expected, request

    @rule(seconds=st.sampled_from([1.0, 4.0, TTL_S + 1]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def sweep(self) -> None:
        deadline = self.now - TTL_S
        stale = [r for r in self.requests if r.open and r.opened_at < deadline and r.owner_ended()]
        for request in stale:
            request.open, request.evicted, request.taken = False, True, False
        for request in self.requests:
            if request.evicted and request.taken and request.owner_ended():
                request.taken = False
        self.evicted_ttl += len(stale)
        assert self.ledger.sweep() == len(stale)

    # -- what the ledger holds -------------------------------------------------------------

    @invariant()
    def holds_exactly_the_open_slots(self) -> None:
        assert len(self.ledger) == sum(r.open for r in self.requests)
        assert [r.key for r in self.requests if r.key in self.ledger] == [r.key for r in self.requests if r.taken]
        counters = self.ledger.counters
        assert (counters.unmatched_events, counters.evicted_ttl, counters.evicted_cap) == (
            self.unmatched, self.evicted_ttl, self.evicted_cap)

    def teardown(self) -> None:
        try:
            for request in self.requests:
                if not request.closed:
                    assert billed(self.ledger.close(request.key)) == request.expected(), request
            # nothing outlives its close: no slot, no key kept taken, late events store nothing
            assert len(self.ledger) == 0
            assert not any(r.key in self.ledger for r in self.requests)
            for request in self.requests:
                self.ledger.added(request.key, 1)
                self.ledger.publish(Scheduled(request.key, 1, 0))
            assert len(self.ledger) == 0 and self.ledger.sweep() == 0
        finally:
            for request in self.requests:
                if request.owner is not None and not request.owner.done():
                    request.owner.ended.set_result(None)  # type: ignore[attr-defined]
                    self.loop.run_until_complete(request.owner)
            self.loop.close()


LedgerInterleavings.TestCase.settings = settings(
    max_examples=int(os.environ.get("CACHETALLY_INTERLEAVINGS", "200")),  # about 2 s
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ledger_interleavings = LedgerInterleavings.TestCase
