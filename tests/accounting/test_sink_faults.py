"""Fault schedules for the usage sinks, drawn by Hypothesis: every record submitted is in
the sink's output exactly once, or counted in ``cachetally_usage_records_dropped_total``;
never twice, never silently missing.

JSONL: the sink's module sees a fault-injecting ``os`` (:class:`FaultyOs`) that fails the
n-th ``open``, ``write``, ``fsync``, ``ftruncate`` or ``close`` as the schedule says, as
the kernel does: ``ENOSPC``/``EIO``/``EPERM`` with nothing done, a short ``write`` (the
disk filling mid-batch), an ``fsync`` ``EIO`` after the bytes went in, a ``close`` that
closes and then reports ``EIO``. Small file limits make rotation (a new ``open``) part of
the schedule. OTLP: the exporter confirms, refuses (the SDK's ``FAILURE``, what a 4xx,
a 5xx after retries or a timeout give) or raises, as scheduled; and the SDK's real
exporter meets a collector on loopback that takes, refuses or takes in part (a partial
success) each export, as scheduled.

The oracle is what a user reads: the files parsed line by line (:mod:`tests.sink_counts`)
or the spans the collector took, and the counters of a real Prometheus registry. Records
``unconfirmed`` (an ``fsync`` failed and the bytes could not be cut back: maybe on disk,
maybe not) may be in a file, once at most; every other record is in the output exactly
when it is counted written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from proxy.accounting.records import jsonl, otlp
from proxy.accounting.records.jsonl import JsonlSink
from proxy.accounting.records.recorder import Recorder
from tests.otlp_receiver import RESET, Receiver, otlp_receiver
from tests.sink_counts import counters, ids_in_files, usage, watched

FAULTS = ("ok", "ok", "ok", "ok", "enospc", "eio", "short", "eperm")


class FaultyOs:
    """``os`` for the JSONL sink's module, failing calls as ``schedule`` says: per call
    (``open``, ``write``, ``fsync``, ``ftruncate``, ``close``), one entry for each of its
    calls in order, ``(fault, k)`` where ``k`` is a short write's length. Past its list,
    every call succeeds."""

    def __init__(self, schedule: dict[str, list[tuple[str, int]]]) -> None:
        self._schedule = {call: iter(faults) for call, faults in schedule.items()}
        self.injected: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _fault(self, call: str) -> tuple[str, int]:
        fault, k = next(self._schedule.get(call, iter(())), ("ok", 0))
        if fault != "ok":
            self.injected[f"{call} {fault}"] += 1
        return fault, k

    @staticmethod
    def _raise(fault: str) -> None:
        code = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eperm": errno.EPERM, "short": errno.EIO}[fault]
        raise OSError(code, os.strerror(code))

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        fault, _ = self._fault("open")
        if fault != "ok":
            self._raise(fault)
        return os.open(path, flags, mode)

    def write(self, fd: int, data: Any) -> int:
        fault, k = self._fault("write")
        if fault == "short" and len(data) > 1:  # the disk filled up: part of it went in
            return os.write(fd, data[: min(k, len(data) - 1)])
        if fault != "ok":
            self._raise(fault)
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        fault, _ = self._fault("fsync")
        if fault != "ok":  # the bytes are in the file; whether on disk, nobody knows
            self._raise("eio")
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        fault, _ = self._fault("ftruncate")
        if fault != "ok":
            self._raise(fault)
        os.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        fault, _ = self._fault("close")
        os.close(fd)  # Linux frees the descriptor even when close reports an error
        if fault != "ok":
            self._raise("eio")


@contextlib.contextmanager
def faulty_os(schedule: dict[str, list[tuple[str, int]]]) -> Iterator[FaultyOs]:
    shim = FaultyOs(schedule)
    jsonl.os = shim  # type: ignore[assignment]
    try:
        yield shim
    finally:
        jsonl.os = os


def check_outcome(present: Counter[str], submitted: int, written: float, dropped: dict[str, float]) -> None:
    assert set(present) <= {f"r{n}" for n in range(submitted)}
    assert max(present.values(), default=1) == 1, f"written twice: {[i for i, c in present.items() if c > 1]}"
    assert written + sum(dropped.values()) == submitted  # each record counted exactly once
    unconfirmed = dropped.get("unconfirmed", 0)
    assert written <= len(present) <= written + unconfirmed  # counted written: in the output


def run_rounds(recorder: Recorder, rounds: list[int]) -> int:
    """Start ``recorder``, run ``rounds`` (each: that many requests end, then one flush
    interval; its thread waits for the stop, so these are its only flushes) and stop it,
    so that the final drain meets the rest of the schedule. Returns how many were submitted."""
    recorder.start()
    submitted = 0
    for count in rounds:
        for _ in range(count):
            recorder.submit(usage(submitted))
            submitted += 1
        recorder.workers[0].flush()
    recorder.stop(timeout_s=60)
    return submitted


CALLS = ("open", "write", "fsync", "ftruncate", "close")
schedules = st.fixed_dictionaries(
    {call: st.lists(st.tuples(st.sampled_from(FAULTS), st.integers(1, 3000)), max_size=16) for call in CALLS}
)
rounds = st.lists(st.integers(0, 12), min_size=1, max_size=6)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules, rounds=rounds, max_file=st.integers(300, 6000), max_queued=st.integers(1, 40))
# The case: fsync EIO, and the cut back fails too (it was written twice).
@example(schedule={"fsync": [("ok", 0), ("eio", 0)], "ftruncate": [("eio", 0)]}, rounds=[3], max_file=6000,
         max_queued=40)
# The disk fills mid-batch (one whole line and a torn one), the cut fails, an fsync works.
@example(schedule={"write": [("short", 600), ("enospc", 0)], "ftruncate": [("eio", 0)]}, rounds=[3],
         max_file=6000, max_queued=40)
def test_jsonl_writes_each_record_once_or_counts_it_under_any_fault_schedule(
    schedule: dict[str, list[tuple[str, int]]], rounds: list[int], max_file: int, max_queued: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "usage"
        with faulty_os(schedule) as shim:
            recorder = Recorder([JsonlSink(directory, max_file)], max_queued=max_queued, interval_s=3600)
            metrics = watched(recorder)
            submitted = run_rounds(recorder, rounds)
        written, dropped = counters(metrics, "jsonl")
        for fault in [*shim.injected, *(f"dropped {reason}" for reason in dropped)]:
            event(fault)  # --hypothesis-show-statistics: how often each was drawn
        check_outcome(ids_in_files(directory), submitted, written, dropped)


class ScriptedExporter:
    """Stands in for the SDK's exporter: per ``export`` call, confirms (the spans reach the
    collector), fails (``FAILURE``: refused, or retried until the timeout) or raises."""

    def __init__(self, script: list[str]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._script = iter(script)
        self._result = SpanExportResult
        self.collected: list[Any] = []

    def export(self, spans: list[Any]) -> Any:
        step = next(self._script, "ok")
        if step == "raise":
            raise ConnectionError("collector reset the connection")
        if step == "fail":
            return self._result.FAILURE
        self.collected.extend(spans)
        return self._result.SUCCESS

    def shutdown(self) -> None: ...


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=st.lists(st.sampled_from(["ok", "ok", "fail", "raise"]), max_size=30),
    rounds=rounds,
    chunk=st.integers(1, 8),
    max_queued=st.integers(1, 40),
)
def test_otlp_exports_each_record_once_or_counts_it_under_any_exporter_script(
    script: list[str], rounds: list[int], chunk: int, max_queued: int
) -> None:
    sink = otlp.OtlpSink("http://127.0.0.1:9/v1/traces")
    exporter = ScriptedExporter(script)
    sink._exporter = exporter  # type: ignore[assignment]
    saved, otlp.MAX_BATCH = otlp.MAX_BATCH, chunk  # several export calls per flush
    try:
        recorder = Recorder([sink], max_queued=max_queued, interval_s=3600)
        metrics = watched(recorder)
        submitted = run_rounds(recorder, rounds)
    finally:
        otlp.MAX_BATCH = saved
    present = Counter(s.attributes["cachetally.request_id"] for s in exporter.collected)
    assert len({s.context.span_id for s in exporter.collected}) == len(exporter.collected)
    written, dropped = counters(metrics, "otlp")
    assert "unconfirmed" not in dropped
    check_outcome(present, submitted, written, dropped)



@pytest.fixture(scope="module")
def collector() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


#: A collector's answers to an export, over real HTTP: taken (200), refused (400: the SDK
#: does not retry it), redirected (307: the SDK follows no redirect, and takes it for a
#: success), too large (413: the sink sends it again in halves), taken with no answer (a
#: reset: the SDK sends again at once), or taken in part (200 with
#: ``partial_success.rejected_spans``).
answers = st.lists(
    st.one_of(st.just((200, 0)), st.just((400, 0)), st.just((307, 0)), st.just((413, 0)), st.just((RESET, 0)),
              st.tuples(st.just(200), st.integers(1, 9))),
    max_size=12,
)


@pytest.mark.loopback
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers=answers, rounds=rounds, chunk=st.integers(1, 8))
def test_otlp_counts_what_a_collector_took_refused_or_rejected_in_part_over_real_http(
    collector: Receiver, answers: list[tuple[int, int]], rounds: list[int], chunk: int
) -> None:
    """The SDK's real exporter against a collector on loopback that answers as scripted: every
    record counted written is among the spans the collector kept, and one it kept is
    counted written or ``unconfirmed`` (it took a request it did not answer). A resent
    span has the same span id, by which a collector drops it (docs/ACCOUNTING.md).
    The timeout is shorter than the SDK's first backoff: two resets in a row end the
    export at once instead of waiting a second for a third try."""
    with collector.lock:
        collector.spans.clear()
        collector.script[:] = answers
    saved, otlp.MAX_BATCH = otlp.MAX_BATCH, chunk  # several exports per flush
    try:
        recorder = Recorder([otlp.OtlpSink(collector.url, timeout_s=0.7)], interval_s=3600)
        metrics = watched(recorder)
        submitted = run_rounds(recorder, rounds)
    finally:
        otlp.MAX_BATCH = saved
    kept = {s.span_id: s.attributes["cachetally.request_id"] for s in collector.snapshot()}
    written, dropped = counters(metrics, "otlp")
    event(f"dropped {sorted(dropped)}")
    assert set(dropped) <= {"export_failed", "unconfirmed"}
    check_outcome(Counter(kept.values()), submitted, written, dropped)


def test_a_record_json_cannot_hold_is_dropped_alone_and_the_rest_of_its_flush_written(tmp_path: Path) -> None:
    """A record orjson cannot write (a lone surrogate in a string, injected past the record's
    own bounds) once failed its whole flush: every fair record in it was dropped too."""
    recorder = Recorder([JsonlSink(tmp_path)], interval_s=3600)
    metrics = watched(recorder)
    poison = usage(1)
    poison.request_model = "m\ud800"
    recorder.start()
    for record in (usage(0), poison, usage(2)):
        recorder.submit(record)
    recorder.stop(timeout_s=60)
    assert ids_in_files(tmp_path) == Counter({"r0": 1, "r2": 1})
    assert counters(metrics, "jsonl") == (2, {"write_failed": 1})


def test_a_flush_of_only_records_json_cannot_hold_makes_no_file_and_the_log_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to write is no reason for an empty usage file; the operator reads why the
    record is counted dropped."""
    recorder = Recorder([JsonlSink(tmp_path)], interval_s=3600)
    metrics = watched(recorder)
    poison = usage(1)
    poison.request_model = "m\ud800"
    recorder.start()
    recorder.submit(poison)
    with caplog.at_level("WARNING", logger="cachetally.records"):
        recorder.stop(timeout_s=60)
    assert list(tmp_path.iterdir()) == []
    assert counters(metrics, "jsonl") == (0, {"write_failed": 1})
    assert "last error: a record JSON cannot hold" in caplog.text
