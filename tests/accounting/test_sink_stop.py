"""Stopping the recorder while requests still end: every record is written or counted once.

``submit`` runs on the event loop while ``stop`` drains on another thread. The
interleavings are forced, not hoped for: a queue whose ``append`` runs the whole stop
between ``submit``'s checks and its append, and a sink held inside its ``write`` past the
stop's timeout.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from proxy.accounting.records.queue import Delivery, DropCounts, SinkWorker
from proxy.accounting.records.record import UsageRecord
from proxy.accounting.records.recorder import Recorder
from tests.servers import ROOT
from tests.sink_counts import usage


class _Kept:
    """A sink that keeps what it is given; ``gate``, when set, holds ``write`` until released."""

    name, failure = "kept", "write_failed"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.records: list[UsageRecord] = []
        self.gate = gate

    def write(self, batch: list[UsageRecord]) -> Delivery:
        if self.gate is not None:
            self.gate.wait(30)
        self.records.extend(batch)
        return Delivery(written=len(batch))

    def close(self) -> None: ...


def test_a_submit_that_races_the_final_drain_is_written_or_counted() -> None:
    """The interleaving: ``submit`` passes its checks, then the whole stop runs (final drain,
    thread gone) before its ``append``. Nothing would ever drain that record."""
    sink, drops = _Kept(), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100, interval_s=3600)

    class StopBeforeAppend(type(worker._queue)):  # type: ignore[misc]
        def append(self, record: UsageRecord) -> None:
            assert worker.stop(timeout_s=10)
            super().append(record)

    worker._queue = StopBeforeAppend()
    worker.start()
    worker.submit(usage(0))
    assert len(sink.records) + sum(drops.snapshot().values()) == 1
    assert sink.records == [] and drops.snapshot() == {("kept", "stopped"): 1}


def test_records_submitted_while_the_final_drain_runs_are_each_written_or_counted_once() -> None:
    gate = threading.Event()
    sink, drops = _Kept(gate), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100_000, interval_s=3600)
    worker.start()
    worker.submit(usage(0))
    stopper = threading.Thread(target=worker.stop, args=(30,))
    stopper.start()  # the final drain takes r0 and waits in write
    n = 1
    while n < 20_000 and worker._thread.is_alive():
        if n == 200:
            gate.set()
        worker.submit(usage(n))
        n += 1
    stopper.join()
    written = Counter(r.request_id for r in sink.records)
    assert max(written.values()) == 1
    assert len(written) + drops.snapshot().get(("kept", "stopped"), 0) == n
    assert sum(drops.snapshot().values()) == n - len(written)


def test_a_sink_stuck_past_the_stop_timeout_has_its_records_counted_not_lost() -> None:
    gate = threading.Event()
    sink, drops = _Kept(gate), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100, interval_s=3600)
    written: list[int] = []
    worker.on_written = written.append
    worker.start()
    for n in range(3):
        worker.submit(usage(n))
    assert worker.stop(timeout_s=0.2) is False  # its final drain is stuck in write
    worker.submit(usage(3))  # a request ending after the stop gave up
    assert drops.snapshot() == {("kept", "unconfirmed"): 3, ("kept", "stopped"): 1}
    gate.set()  # the write goes through after all: it was counted unconfirmed, not again
    worker._thread.join(10)
    assert len(sink.records) == 3 and drops.snapshot() == {("kept", "unconfirmed"): 3, ("kept", "stopped"): 1}
    assert written == []  # nor written: cachetally_usage_records_written_total stays 0


def test_records_kept_for_a_retry_when_the_stop_gives_up_are_counted_stopped() -> None:
    """The interleaving: the sink delivered part of a batch and kept the rest for a retry, then
    the thread is held (here in the written-records hook) past the stop's timeout, before a
    next batch takes the rest. Nothing will write them: they are counted, not lost."""
    class Partial(_Kept):
        def write(self, batch: list[UsageRecord]) -> Delivery:
            self.records.extend(batch[:1])
            return Delivery(written=1, retry=batch[1:])

    held, gate = threading.Event(), threading.Event()

    def hold(n: int) -> None:
        held.set()
        gate.wait(30)

    sink, drops = Partial(), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100, interval_s=0.01)
    worker.on_written = hold
    for n in range(3):
        worker.submit(usage(n))
    worker.start()
    assert held.wait(10)  # its first step wrote one and kept two for a retry, and is held
    assert worker.stop(timeout_s=0.2) is False
    assert drops.snapshot() == {("kept", "stopped"): 2}
    gate.set()
    worker._thread.join(10)
    assert len(sink.records) == 1 and drops.snapshot() == {("kept", "stopped"): 2}


def test_records_queued_behind_a_stuck_write_when_the_stop_gives_up_are_counted_stopped() -> None:
    """The thread took a batch and is stuck writing it; requests ending meanwhile queue behind
    it. When the stop gives up, the batch is unconfirmed and what is queued is stopped: each
    record counted once, none waiting for a drain that will never come."""
    class Entered(_Kept):
        def __init__(self, gate: threading.Event) -> None:
            super().__init__(gate)
            self.entered = threading.Event()

        def write(self, batch: list[UsageRecord]) -> Delivery:
            self.entered.set()
            return super().write(batch)

    gate = threading.Event()
    sink, drops = Entered(gate), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100, interval_s=0.01)
    worker.submit(usage(0))
    worker.start()
    assert sink.entered.wait(10)  # its first step took usage(0) and is stuck in write
    worker.submit(usage(1))
    worker.submit(usage(2))
    assert worker.stop(timeout_s=0.2) is False
    assert drops.snapshot() == {("kept", "unconfirmed"): 1, ("kept", "stopped"): 2}
    gate.set()
    worker._thread.join(10)
    assert len(sink.records) == 1 and drops.snapshot() == {("kept", "unconfirmed"): 1, ("kept", "stopped"): 2}


def test_drops_not_yet_logged_are_logged_at_the_stop_and_the_lines_add_up_to_every_drop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Drops are logged at most once a minute: those since the last line are logged when the
    recorder stops, one line for every sink and reason, so the log's lines add up to every
    record dropped (what tests/server/test_stop.py reads from a real server's log)."""
    first, second = _Kept(), _Kept()
    second.name = "other"
    recorder = Recorder([first, second], max_queued=1, interval_s=3600)
    caplog.set_level(logging.WARNING, "cachetally.records")
    for n in range(3):  # before the threads start: each sink queues one and drops two
        recorder.submit(usage(n))
    recorder.stop(timeout_s=10)
    assert [r.getMessage() for r in caplog.records] == [
        "usage records dropped: 1 (kept: queue_full)",  # the first drop, at once
        "usage records dropped: 1 (kept: queue_full), 2 (other: queue_full)",  # the rest, at the stop
    ]
    assert [r.request_id for r in first.records + second.records] == [usage(0).request_id] * 2


STUCK_FOR_GOOD = """
import threading
from proxy.accounting.records.queue import DropCounts, SinkWorker
from tests.sink_counts import usage

class Stuck:  # a write that never returns: a disk that hangs (a dead NFS server)
    name, failure = "stuck", "write_failed"

    def write(self, batch):
        threading.Event().wait()

    def close(self):
        pass

drops = DropCounts()
worker = SinkWorker(Stuck(), drops, max_queued=10, interval_s=3600)
worker.start()
worker.submit(usage(0))
print(worker.stop(timeout_s=0.2), drops.snapshot())
"""


def test_a_sink_stuck_for_good_does_not_keep_the_process_from_exiting_once_the_stop_gives_up() -> None:
    """The stop counts what a stuck sink holds and returns; the process then exits (a server's
    SIGTERM ends it) though the sink's thread is still inside its write."""
    run = subprocess.run([sys.executable, "-c", STUCK_FOR_GOOD], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "False {('stuck', 'unconfirmed'): 1}\n"
    # what an operator reads (no logging configured: the last-resort handler's stderr)
    assert "usage records dropped: 1 (stuck: unconfirmed); last error: the sink did not finish in time" in run.stderr


def test_a_sink_that_raises_has_that_batch_counted_and_the_next_one_written() -> None:
    """A sink's bug (an exception out of ``write``) costs the batch it was given, counted with
    the sink's reason; the thread goes on, and the records after it are written, not left
    queued and counted nowhere."""
    class FailsOnce(_Kept):
        failed = False

        def write(self, batch: list[UsageRecord]) -> Delivery:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a sink bug")
            return super().write(batch)

    sink, drops = FailsOnce(), DropCounts()
    worker = SinkWorker(sink, drops, max_queued=100, interval_s=0.01)
    worker.submit(usage(0))
    worker.start()
    for _ in range(1000):  # until the first step has failed and counted its batch (10 s at most)
        if drops.snapshot():
            break
        time.sleep(0.01)
    assert drops.snapshot() == {("kept", "write_failed"): 1}
    worker.submit(usage(1))
    assert worker.stop(timeout_s=10)
    assert drops.snapshot() == {("kept", "write_failed"): 1}
    assert [r.request_id for r in sink.records] == [usage(1).request_id]
