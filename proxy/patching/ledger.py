"""Per-request usage slots: where engine events meet the responses they describe.

The middleware opens a slot under a unique key before it calls the inner app and closes
it in ``finally``; engines publish :class:`~engine_adapter.events.Scheduled` into the
ledger (it is an :class:`~engine_adapter.events.EventSink`). Closing is a plain dict pop
with no ``await``, so cancellation cannot skip it.

A slot aggregates every engine request of one HTTP request (a batch of prompts, or one
request with ``n > 1``) the way the engine counts ``prompt_tokens``: each prompt once. A
beam search (vLLM's ``use_beam_search``) runs one engine request per beam per step, each
on the prompt and the tokens chosen so far: its slot keeps the first, the client's prompt
(:meth:`UsageLedger.first_event_only`). An engine request announced before its prefill
(``EventSink.added``) whose ``Scheduled`` never comes leaves its prompt in the slot, its cache
unknown: it was cut before its prefill ended.

Events for keys that are not open are counted and dropped, never stored. A TTL sweep and
a size cap are a second line of defence against a slot that outlives its request; each
eviction is counted. Neither should ever fire: a leak is a bug, not steady state.

The sweep is for slots whose request has ended without closing them (a missed drop
guard), so it never takes the slot of a request still running, however long it runs (a
stream may legitimately outlive any TTL: the read timeout is *between* bytes). A slot
remembers the asyncio task that opened it, weakly; past the TTL it is swept only once
that task is done or gone. A slot opened outside a task has no owner to ask and is swept
by age alone (tests/patching/test_ledger.py::test_the_sweep_never_takes_a_live_requests_slot).
The cap takes the oldest slot, live or not, but a live request's key stays taken until it
closes it: given to another request, the first one's close would close the other's slot
(tests/server/test_leak.py::test_a_slot_the_cap_evicted_keeps_its_key_from_another_tenants_request).

The ledger knows nothing of metrics: it keeps its own counters and tells an optional
:class:`LedgerObserver` (``proxy.accounting.metrics`` installs one) of each change as it happens, so
metrics are exact whichever process is scraped.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from engine_adapter.events import Scheduled


@dataclass(slots=True)
class EngineUsage:
    """What the engine reported for one HTTP request, summed over its engine requests."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    local_cached_tokens: int | None = None
    external_cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    transferred_tokens: int | None = None  # disaggregated decode only (Scheduled)
    decode_local_tokens: int | None = None
    events: int = 0
    #: Tokens the engine's outputs handed its serving layer, when the engine counts them (vLLM's tap).
    generated_tokens: int | None = None
    #: (prompt_tokens, cached_tokens, first_choice, choices) of each engine request, in
    #: publication order (:class:`~engine_adapter.events.Scheduled`).
    per_request: list[tuple[int, int, int | None, int]] = field(default_factory=list)
    #: Engine requests announced (:meth:`~engine_adapter.events.EventSink.added`) whose
    #: ``Scheduled`` has not come, and their prompt tokens: at the close, those cut before
    #: their prefill's figures, whose prompt is known and whose cache is not.
    unscheduled: int = 0
    unscheduled_tokens: int = 0

    def add(self, event: Scheduled) -> None:
        if self.unscheduled:  # the announced request it settles: both are the engine's count of its prompt
            self.unscheduled -= 1
            self.unscheduled_tokens -= event.prompt_tokens
        if not self.events:  # the first, and usually the only, event of a request
            self.prompt_tokens, self.cached_tokens = event.prompt_tokens, event.cached_tokens
            self.local_cached_tokens = event.local_cached_tokens
            self.external_cached_tokens = event.external_cached_tokens
            self.cache_creation_tokens = event.cache_creation_tokens
            self.transferred_tokens = event.transferred_tokens
            self.decode_local_tokens = event.decode_local_tokens
        else:
            self.prompt_tokens += event.prompt_tokens
            self.cached_tokens += event.cached_tokens
            self.local_cached_tokens = _add_optional(self.local_cached_tokens, event.local_cached_tokens)
            self.external_cached_tokens = _add_optional(self.external_cached_tokens, event.external_cached_tokens)
            self.cache_creation_tokens = _add_optional(self.cache_creation_tokens, event.cache_creation_tokens)
            self.transferred_tokens = _add_optional(self.transferred_tokens, event.transferred_tokens)
            self.decode_local_tokens = _add_optional(self.decode_local_tokens, event.decode_local_tokens)
        self.events += 1
        self.per_request.append((event.prompt_tokens, event.cached_tokens, event.first_choice, event.choices))

    def cached_for(self, prompt_tokens: object, choice: int | None = None) -> int | None:
        """The cached tokens matching a usage object that reports ``prompt_tokens``.

        A usage object for the whole request matches the aggregate. A per-prompt one (vLLM's
        continuous usage chunks of a multi-prompt completions stream, each of one ``choice``)
        matches the engine request that makes that choice, where the engine said which,
        else the one with that prompt length, when that is unambiguous; otherwise ``None``.
        """
        if not isinstance(prompt_tokens, int) or prompt_tokens == self.prompt_tokens:
            return self.cached_tokens
        if choice is not None:
            for prompt, cached, first, choices in self.per_request:
                if first is not None and first <= choice < first + choices:
                    return cached if prompt == prompt_tokens else None
        matches = {cached for prompt, cached, _, _ in self.per_request if prompt == prompt_tokens}
        return matches.pop() if len(matches) == 1 else None


def _add_optional(total: int | None, value: int | None) -> int | None:
    if value is None:
        return total
    return value if total is None else total + value


#: The task serving a request, weakly: a slot (or key) is its request's as long as it runs.
Owner = weakref.ref[asyncio.Task[object]] | None


def _ended(owner: Owner) -> bool:
    """The request ``owner`` served is over (or unknown): its ``finally`` cannot close it now."""
    task = owner() if owner is not None else None
    return task is None or task.done()


@dataclass(slots=True)
class _Slot:
    opened_at: float
    owner: Owner = None
    usage: EngineUsage = field(default_factory=EngineUsage)
    first_only: bool = False  # a beam search: later events are its steps, not prompts
    #: A beam search's later step was announced: vLLM starts it after the first step's prefill,
    #: so a first step still unscheduled never will be (its figures were refused).
    later_steps: bool = False

    def ended(self) -> bool:
        """The request that opened it is over (or unknown): its ``finally`` cannot close it now."""
        return _ended(self.owner)


def _current_task() -> Owner:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        return None
    return weakref.ref(task) if task is not None else None


@dataclass(slots=True)
class LedgerCounters:
    """Second-line-of-defence counters; exported as metrics by the caller."""

    evicted_ttl: int = 0
    evicted_cap: int = 0
    unmatched_events: int = 0


class LedgerObserver(Protocol):
    """Told of every change to what the ledger counts, in the thread that changed it."""

    #: Told the number of open slots after each open and close; ``None`` when the observer
    #: reads ``len(ledger)`` itself (nothing to call on every request).
    open_slots: Callable[[int], None] | None

    def evicted(self, reason: str, n: int) -> None: ...

    def unmatched(self) -> None: ...


class _Unobserved:
    open_slots = None

    def evicted(self, reason: str, n: int) -> None:
        pass

    def unmatched(self) -> None:
        pass


class UsageLedger:
    """Open slots keyed by the proxy's request key. Single event loop; not thread-safe."""

    def __init__(
        self,
        *,
        ttl_s: float = 900.0,
        max_slots: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self._slots: dict[str, _Slot] = {}
        #: Keys whose slot the cap evicted while their request ran: still that request's.
        self._evicted: dict[str, Owner] = {}
        self._ttl_s = ttl_s
        self._max_slots = max_slots
        self._clock = clock
        self.counters = LedgerCounters()
        self.observer: LedgerObserver = _Unobserved()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is taken: its slot is open, or the cap evicted it while its request runs."""
        return key in self._slots or key in self._evicted

    def open(self, key: str) -> None:
        if key in self:
            raise KeyError(f"ledger slot {key!r} is already open")
        if len(self._slots) >= self._max_slots:
            # dicts keep insertion order: the first slot is the oldest. Its figures go, its
            # key stays taken: given out again, its request's close would close the other's slot.
            oldest = next(iter(self._slots))
            if not (evicted := self._slots.pop(oldest)).ended():
                self._evicted[oldest] = evicted.owner
            self.counters.evicted_cap += 1
            self.observer.evicted("cap", 1)
        self._slots[key] = _Slot(opened_at=self._clock(), owner=_current_task())
        if (notify := self.observer.open_slots) is not None:
            notify(len(self._slots))

    def close(self, key: str) -> EngineUsage | None:
        """Drop the slot; return its usage if any event or announcement arrived. No await:
        safe in ``finally``."""
        slot = self._slots.pop(key, None)
        if slot is None:
            self._evicted.pop(key, None)
        if (notify := self.observer.open_slots) is not None:
            notify(len(self._slots))
        return None if slot is None or not (slot.usage.events or slot.usage.unscheduled) else slot.usage

    @contextmanager
    def slot(self, key: str) -> Iterator[str]:
        """Drop guard: the slot lives exactly as long as the ``with`` block."""
        self.open(key)
        try:
            yield key
        finally:
            self.close(key)

    def first_event_only(self, key: str) -> None:
        """The slot of ``key`` keeps its first engine request, announced or scheduled, and drops
        the rest (a beam search's later steps)."""
        if (slot := self._slots.get(key)) is not None:
            slot.first_only = True

    def usage(self, key: str) -> EngineUsage | None:
        """The engine's figures for ``key``, or ``None`` if no event arrived (yet)."""
        slot = self._slots.get(key)
        if slot is None or slot.usage.events == 0:
            return None
        return slot.usage

    def publish(self, event: Scheduled) -> None:
        """:class:`EventSink` entry point for engines."""
        slot = self._slots.get(event.request_id)
        if slot is None:
            self.counters.unmatched_events += 1
            self.observer.unmatched()
            return
        if slot.first_only and (slot.usage.events or slot.later_steps):
            return  # a later step's: it must not settle the first step's announcement
        slot.usage.add(event)

    def added(self, request_id: str, prompt_tokens: int) -> None:
        """:class:`EventSink`: an engine request of ``request_id`` awaits its ``Scheduled`` (for
        no open slot: dropped). A beam search keeps its first request only, as its events."""
        if (slot := self._slots.get(request_id)) is None:
            return
        usage = slot.usage
        if slot.first_only and (usage.events or usage.unscheduled):
            slot.later_steps = True
            return
        usage.unscheduled += 1
        usage.unscheduled_tokens += prompt_tokens

    def generated(self, request_id: str, tokens: int) -> None:
        """:class:`EventSink`: ``tokens`` more reached the serving layer (for no open slot: dropped).
        A beam search's ``generate()`` calls are its steps, not its answer: not counted."""
        if (slot := self._slots.get(request_id)) is not None and not slot.first_only:
            slot.usage.generated_tokens = (slot.usage.generated_tokens or 0) + tokens

    def sweep(self) -> int:
        """Evict slots older than the TTL whose request has ended; returns how many. Call it
        periodically."""
        deadline = self._clock() - self._ttl_s
        stale = [key for key, slot in self._slots.items() if slot.opened_at < deadline and slot.ended()]
        for key in stale:
            del self._slots[key]
        for key in [key for key, owner in self._evicted.items() if _ended(owner)]:
            del self._evicted[key]  # its request ended without a close: a missed drop guard
        if stale:
            self.counters.evicted_ttl += len(stale)
            self.observer.evicted("ttl", len(stale))
            if (notify := self.observer.open_slots) is not None:
                notify(len(self._slots))
        return len(stale)
