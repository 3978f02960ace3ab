"""The hand-off from the event loop to a sink: a bounded queue that one thread drains.

:meth:`SinkWorker.submit` runs in the middleware's ``finally``, on the event loop: a length
check, a ``deque.append`` (atomic under the GIL) and a flag read; no lock, no I/O, never a
wait. When ``max_queued`` records are waiting (a batch kept for a retry included), the
record is dropped and counted. The thread wakes every flush interval, takes everything
queued and hands it to the sink as one batch; at stop it drains once more, so a graceful
stop loses nothing a sink can write, and a crash loses at most one flush interval.

Every record submitted ends counted exactly once, in
``cachetally_usage_records_written_total`` or ``cachetally_usage_records_dropped_total``:

- a sink reports each batch as a :class:`Delivery`: records written; records certainly not
  delivered that may be offered again (kept at the head of the queue, counted against its
  bound, until the next interval; dropped with the sink's ``failure`` reason at the final
  drain); records certainly not delivered and not to be retried (``failure``); and records
  whose fate the sink cannot know (``unconfirmed``: an ``fsync`` that failed after the
  bytes were written, when they could not be cut back; an export a collector left
  unanswered), which are never offered again;
- a record submitted while the final drain runs or after it is taken back by ``submit``
  itself and dropped as ``stopped`` if the drain did not take it: the deque's ``popleft``
  gives each record to exactly one of them;
- when the thread does not finish within ``stop``'s timeout (a sink stuck in a write),
  ``stop`` counts the batch in the sink's hands as ``unconfirmed`` and what is still queued
  as ``stopped``; a lock, which the thread takes when it takes a batch and when it counts
  one (never on the event loop), keeps the two from both counting a batch.

Drops are counted per sink and reason and logged at most once a minute, with the count
since the last line. ``DropCounts.listener`` and ``SinkWorker.on_written`` tell metrics of
each drop and write as it happens, from whichever thread it happens in (prometheus_client's
metrics are thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.accounting.records.record import UsageRecord

logger = logging.getLogger("cachetally.records")

LOG_EVERY_S = 60.0
#: The drop reason of a record a sink may or may not have delivered (module docstring).
UNCONFIRMED = "unconfirmed"


@dataclass(slots=True)
class Delivery:
    """What a sink did with a batch; each record of it is in exactly one of these."""

    written: int = 0
    #: Certainly not delivered, and nothing of them is where a reader would count them.
    retry: list[UsageRecord] = field(default_factory=list)
    #: Certainly not delivered; not to be offered again.
    lost: int = 0
    #: Maybe delivered, maybe not; never offered again.
    unconfirmed: int = 0
    #: The last error, for the log line.
    detail: str = ""


class Sink(Protocol):
    name: str
    #: The drop reason for records a sink could not deliver.
    failure: str

    def write(self, batch: list[UsageRecord]) -> Delivery:
        """Deliver ``batch``; never raises for a delivery failure."""
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
        self._closed = False  # no drain will take what is queued from now on: submit takes it back
        self._settle = threading.Lock()  # a batch is counted by the thread, or by a timed-out stop
        self._in_hand: list[UsageRecord] = []
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"cachetally-usage-{sink.name}", daemon=True)

    def submit(self, record: UsageRecord) -> None:
        if len(self._queue) + len(self._retry) >= self._max:
            self._drops.add(self.sink.name, "queue_full", 1)
            return
        self._queue.append(record)
        if self._closed:
            self._take_back()

    def _take_back(self) -> None:
        """Drop what is queued once no drain will come (``popleft`` races the drain safely)."""
        queue, n = self._queue, 0
        while True:
            try:
                queue.popleft()
            except IndexError:
                break
            n += 1
        self._drops.add(self.sink.name, "stopped", n)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Drain, close the sink and join the thread; ``False`` if it did not end in time,
        and then what it still held is counted (module docstring)."""
        self._stopping = True
        self._wake.set()
        if self._thread.ident is None:  # never started: the final drain still runs
            self._thread.start()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            return True
        with self._settle:
            self._abandoned = self._closed = True
            in_hand, self._in_hand = self._in_hand, []
            retry, self._retry = self._retry, []
        self._drops.add(self.sink.name, UNCONFIRMED, len(in_hand), "the sink did not finish in time")
        self._drops.add(self.sink.name, "stopped", len(retry))
        self._take_back()
        return False

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(self._interval)
                self.flush()
            self._closed = True
            self.flush(final=True)
        finally:
            try:
                self.sink.close()
            except Exception as exc:  # a sink must not take the process down at stop
                logger.error("usage sink %s failed to close: %s", self.sink.name, type(exc).__name__)

    def flush(self, *, final: bool = False) -> None:
        """Hand everything queued to the sink as one batch and count the outcome (the
        thread's step; ``final``: nothing is kept for a retry)."""
        with self._settle:
            if self._abandoned:
                return  # a timed-out stop took over: submit takes back what comes
            batch, self._retry = self._retry, []
            queue = self._queue
            while True:  # not ``while queue``: a closed worker's submit pops too
                try:
                    batch.append(queue.popleft())
                except IndexError:
                    break
            self._in_hand = batch
        if not batch:
            return
        try:
            done = self.sink.write(batch)
        except Exception as exc:  # a sink bug must not end the thread: count, go on
            done = Delivery(lost=len(batch), detail=type(exc).__name__)
        with self._settle:
            if self._abandoned:
                return  # a timed-out stop counted this batch
            self._in_hand = []
            retry = done.retry
            if retry and not final:
                self._retry = retry
                retry = []
        name, failure = self.sink.name, self.sink.failure
        if done.written and self.on_written is not None:
            self.on_written(done.written)
        self._drops.add(name, failure, done.lost + len(retry), done.detail)
        self._drops.add(name, UNCONFIRMED, done.unconfirmed, done.detail)
