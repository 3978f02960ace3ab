"""The hand-off from the event loop to a sink: a bounded queue that one thread drains.

:meth:`SinkWorker.submit` runs in the middleware's ``finally``, on the event loop: a length
check and a ``deque.append`` (atomic under the GIL), no lock, no I/O, never a wait. When
``max_queued`` records are waiting (a batch kept for a retry included), the record is
dropped and counted. The thread wakes every flush interval, takes everything queued and
hands it to the sink as one batch; at stop it drains once more, so a graceful stop loses
nothing a sink can write, and a crash loses at most one flush interval.

A sink that fails:

- raises :class:`RetryLater` when the whole batch can be tried again without being written
  twice (the JSONL sink cuts a failed write back to its last whole line). The batch stays
  at the head of the queue, and counts against its bound, until the next interval;
- or returns how many records it could not deliver (the OTLP exporter already retried
  within its timeout): those are dropped.

Drops are counted per sink and reason (``cachetally_usage_records_dropped_total``) and
logged at most once a minute, with the count since the last line. ``DropCounts.listener``
and ``SinkWorker.on_written`` tell metrics of each drop and write as it happens, from
whichever thread it happens in (prometheus_client's metrics are thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from proxy.records.record import UsageRecord

logger = logging.getLogger("cachetally.records")

LOG_EVERY_S = 60.0


class RetryLater(Exception):
    """The sink wrote nothing of the batch; it may be offered again."""


class Sink(Protocol):
    name: str
    #: The drop reason for records ``write`` reports as undelivered.
    failure: str

    def write(self, batch: list[UsageRecord]) -> int:
        """Deliver ``batch``; return how many records were lost. May raise ``RetryLater``."""
        ...

    def close(self) -> None: ...


class DropCounts:
    """Dropped records per (sink, reason). Thread-safe; the lock is taken only on a drop."""

    def __init__(self, log_every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str], int] = {}
        self._unlogged: dict[tuple[str, str], int] = {}
        self._last_log: float | None = None
        self._every = log_every_s
        self._clock = clock
        #: Called with (sink, reason, n) on every drop, outside the lock.
        self.listener: Callable[[str, str, int], None] | None = None

    def add(self, sink: str, reason: str, n: int, detail: str = "") -> None:
        if n <= 0:
            return
        with self._lock:
            key = (sink, reason)
            self._totals[key] = self._totals.get(key, 0) + n
            self._unlogged[key] = self._unlogged.get(key, 0) + n
            now = self._clock()
            due = self._last_log is None or now - self._last_log >= self._every
            if due:
                self._last_log = now
                line, self._unlogged = self._unlogged, {}
        if self.listener is not None:
            self.listener(sink, reason, n)
        if due:
            self._log(line, detail)

    def flush_log(self) -> None:
        """Log what was dropped since the last line (at stop)."""
        with self._lock:
            line, self._unlogged = self._unlogged, {}
        if line:
            self._log(line, "")

    @staticmethod
    def _log(line: dict[tuple[str, str], int], detail: str) -> None:
        counts = ", ".join(f"{n} ({sink}: {reason})" for (sink, reason), n in sorted(line.items()))
        logger.warning("usage records dropped: %s%s", counts, f"; last error: {detail}" if detail else "")

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._totals)


class SinkWorker:
    """One sink's bounded queue and the thread that drains it (module docstring)."""

    def __init__(self, sink: Sink, drops: DropCounts, *, max_queued: int, interval_s: float) -> None:
        self.sink = sink
        self._drops = drops
        self._max = max_queued
        self._interval = interval_s
        #: Called with the number of records the sink took, in the sink's thread.
        self.on_written: Callable[[int], None] | None = None
        self._queue: deque[UsageRecord] = deque()
        self._retry: list[UsageRecord] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"cachetally-usage-{sink.name}", daemon=True)

    def submit(self, record: UsageRecord) -> None:
        if self._stopping:
            self._drops.add(self.sink.name, "stopped", 1)
        elif len(self._queue) + len(self._retry) >= self._max:
            self._drops.add(self.sink.name, "queue_full", 1)
        else:
            self._queue.append(record)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Drain, close the sink and join the thread; ``False`` if it did not end in time."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(self._interval)
                self._drain(final=False)
            self._drain(final=True)
        finally:
            try:
                self.sink.close()
            except Exception as exc:  # a sink must not take the process down at stop
                logger.error("usage sink %s failed to close: %s", self.sink.name, type(exc).__name__)

    def _drain(self, *, final: bool) -> None:
        batch, self._retry = self._retry, []
        queue = self._queue
        while queue:
            batch.append(queue.popleft())
        if not batch:
            return
        try:
            lost = self.sink.write(batch)
        except RetryLater as exc:
            if final:
                self._drops.add(self.sink.name, self.sink.failure, len(batch), str(exc))
            else:
                self._retry = batch
            return
        except Exception as exc:  # a sink bug must not end the thread: count, go on
            self._drops.add(self.sink.name, self.sink.failure, len(batch), type(exc).__name__)
            return
        taken = len(batch) - lost
        if taken and self.on_written is not None:
            self.on_written(taken)
        self._drops.add(self.sink.name, self.sink.failure, lost)
