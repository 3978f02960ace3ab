"""The response bytes one process holds at once, bounded (``max_response_bytes_held``).

A JSON response is held whole to patch its usage (up to ``max_response_bytes`` each), and a
Responses stream's partial event up to the same size (its terminal event holds the whole
response object). Without a bound across requests, clients that each ask for a large answer
(vLLM's ``prompt_logprobs``, ``top_logprobs``, ``n``) make the process hold every one of
them at once: N × 64 MiB at the default limit.

A response's :class:`ResponseHold` counts the parts held while more of the body is awaited.
A part that would take the process past its budget is not held: the response goes on as one
past ``max_response_bytes`` does (the parts held so far first, then the rest as it comes),
unpatched, and still billed from its usage read as it passes
(:mod:`proxy.patching.passing_usage`); a partial event goes out as one past its bound does.
Nothing waits for the budget, so no request can wait on another that waits on it. The last
part of a body is not held waiting for anything: the body is in hand whole and is patched,
as one that ends past ``max_response_bytes`` is. A partial event counts only its bytes past
``max_event_bytes``, which every stream may hold: so a usage event of ordinary size is always
read, whatever the other streams hold.
"""

from __future__ import annotations

from proxy.patching.budget_warning import BudgetWarning

#: ``cachetally_patch_skipped_total``'s reason for a response or event passed on unpatched
#: because its process held ``max_response_bytes_held`` already.
BUDGET_FULL = "response_budget_full"


class ResponseBudget:
    """One process's bytes of responses held, against ``limit``. Event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._unheld = BudgetWarning("%d responses passed on unpatched (still billed from their usage): this process "
                                     "held max_response_bytes_held (%d bytes) of responses")

    def passed_unheld(self) -> None:
        """A response went on unheld: warned, with the others, at most once a minute."""
        self._unheld.count(self.limit)


class ResponseHold:
    """One response's share of its process's :class:`ResponseBudget`, given back by
    :meth:`release` (also when its request ends, however it ends)."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: ResponseBudget) -> None:
        self._budget = budget
        self.held = 0

    def holds(self, n: int) -> bool:
        """The response now holds ``n`` bytes; ``False``, and its share unchanged, where that
        does not fit in what the process may still hold."""
        budget = self._budget
        more = n - self.held
        if budget.held + more > budget.limit:  # never for less: the process holds at most its limit
            budget.passed_unheld()
            return False
        budget.held += more
        self.held = n
        return True

    def keeps(self, part: int, cap: int) -> str | None:
        """Hold ``part`` bytes more of a body held up to ``cap``: ``None`` where they are held,
        else why not, as ``cachetally_patch_skipped_total`` says it."""
        n = self.held + part
        if n > cap:
            return "body_too_large"
        return None if self.holds(n) else BUDGET_FULL

    def release(self) -> None:
        self.holds(0)
