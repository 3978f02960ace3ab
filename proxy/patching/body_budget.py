"""The request bodies one process holds at once, bounded (``max_request_bytes_held``).

A metered request's body is read whole before the inner app sees it
(:mod:`proxy.patching.request_side`), each up to ``max_request_bytes``. Without a bound
across requests, clients that each send most of a large body and then trickle the rest make
the process hold every one of them: 20 such clients held 580 MiB of a sim server, and memory
grows with their number until the process (in ``cachetally serve``, vLLM's API server with
it) is killed. uvicorn holds at most 64 KiB of a body the app has not asked for, so what a
request holds beyond that is what it reads here.

A request's :class:`Hold` takes bytes as they arrive, never for a ``Content-Length`` that
has not arrived: a client that only announces a large body holds nothing. A body that does
not fit is answered 503 with ``Retry-After`` (the ``openai`` and ``anthropic`` SDKs retry
it), and so is one whose announced length does not fit at its start, before any of it is
read. A P/D leg over ``max_request_bytes`` holds the ``kv_transfer_params`` it keeps while
the rest passes (:mod:`proxy.patching.oversized_leg`), counted the same way. The hold is
given back when the body is handed to the inner app, which then holds its own copy, or
when the request ends, whichever comes first.

Clients that fill the budget make others' bodies wait for it, not the process die: the
budget is what one process may spend on bodies still arriving, chosen from its memory
(docs/RELIABILITY.md §4).
"""

from __future__ import annotations

from proxy.patching.budget_warning import BudgetWarning


class BodyBudgetFull(Exception):
    """The body does not fit in what the process may still hold."""


class BodyBudget:
    """One process's bytes of request bodies held, against ``limit``. Event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._refused = BudgetWarning("%d request bodies refused (503): this process held max_request_bytes_held "
                                      "(%d bytes) of bodies still arriving")

    def refused(self) -> None:
        """A body was refused: warned, with the others, at most once a minute."""
        self._refused.count(self.limit)


class Hold:
    """One request's share of its process's :class:`BodyBudget`: taken as its body arrives,
    given back once, by :meth:`release`."""

    __slots__ = ("_budget", "_n")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self._n = 0

    def fits(self, n: int) -> bool:
        budget = self._budget
        return budget.held + n <= budget.limit

    def take(self, n: int) -> None:
        budget = self._budget
        if budget.held + n > budget.limit:
            raise BodyBudgetFull
        budget.held += n
        self._n += n

    def holds(self, n: int) -> None:
        """The request now holds ``n`` bytes (a P/D leg's kept ``kv_transfer_params``): its
        share follows, ``BodyBudgetFull`` where more does not fit."""
        if n > self._n:
            self.take(n - self._n)
        else:
            self._budget.held -= self._n - n
            self._n = n

    def release(self) -> None:
        if n := self._n:
            self._budget.held -= n
            self._n = 0
