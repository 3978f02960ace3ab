"""A process budget's warning that something did not fit in it: logged at most once a minute,
with the count since the last line, so that a burst which fills the budget is one line, not
one a request (:mod:`proxy.patching.body_budget`, :mod:`proxy.patching.response_budget`)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("cachetally.app")

#: At most one line a minute.
LOG_EVERY_S = 60.0


class BudgetWarning:
    """:meth:`count` each time; ``message`` is a ``%`` format whose first argument is the count
    since the last line. Event loop only."""

    __slots__ = ("_message", "_count", "_logged_at")

    def __init__(self, message: str) -> None:
        self._message = message
        self._count = 0
        self._logged_at: float | None = None

    def count(self, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            logger.warning(self._message, self._count, *args)
            self._logged_at, self._count = now, 0
