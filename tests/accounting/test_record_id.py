"""Record ids: RFC 9562 UUIDv7, checked with the standard library's ``uuid`` as the oracle.

Python's ``uuid`` parses any UUID and names its version and variant; the 48-bit timestamp
is read back per RFC 9562 section 5.7. Ids must sort in the order one process mints
them, and never repeat, within a process or across processes (forked or spawned).
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from pathlib import Path

import orjson
import pytest

from proxy.accounting.records.jsonl import JsonlSink
from proxy.accounting.records.otlp import OtlpSink
from proxy.accounting.records.record import UsageRecord
from proxy.accounting.records.record_id import new_record_id, uuid7
from proxy.accounting.records.recorder import Recorder
from tests.otlp_receiver import otlp_receiver


def _mint(n: int) -> list[str]:
    return [new_record_id() for _ in range(n)]


def test_ids_are_rfc_9562_version_7_with_the_time_they_were_minted() -> None:
    before = time.time_ns() // 1_000_000
    ids = [uuid.UUID(new_record_id()) for _ in range(1000)]
    after = time.time_ns() // 1_000_000
    for parsed in ids:
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122
        assert before <= parsed.int >> 80 <= after + 1  # +1: a counter overflow borrows the next ms
        assert str(parsed) == str(parsed).lower() and len(str(parsed)) == 36


def test_ids_sort_in_the_order_they_were_minted() -> None:
    ids = [uuid7() for _ in range(50_000)]
    assert ids == sorted(ids)
    assert [str(i) for i in ids] == sorted(str(i) for i in ids)  # as text too: the JSONL field
    assert len(set(ids)) == len(ids)


def test_ids_never_repeat_across_processes() -> None:
    new_record_id()  # the parent's counter is set: forked children must not continue it
    minted: list[str] = []
    for method in ("fork", "spawn"):
        with multiprocessing.get_context(method).Pool(4) as pool:
            for chunk in pool.map(_mint, [20_000] * 4):
                minted += chunk
    minted += _mint(20_000)
    assert len(set(minted)) == len(minted) == 180_000


@pytest.mark.loopback
def test_every_record_gets_its_own_id_in_the_file_and_at_the_collector(tmp_path: Path) -> None:
    """Three records of one reused request id, through the real JSONL sink and the real OTLP
    exporter into a receiver that decodes the protobuf itself: a user finds three ids in
    the file, and the same three at the collector."""
    records = [UsageRecord(request_id="same", tenant="t", route="chat", stream=False, start_unix=0.0) for _ in range(3)]
    with otlp_receiver() as receiver:
        recorder = Recorder([JsonlSink(tmp_path), OtlpSink(receiver.url, timeout_s=5)], interval_s=3600)
        recorder.start()
        for record in records:
            recorder.submit(record)
        recorder.stop(timeout_s=30)
        spans = receiver.snapshot()
    lines = [orjson.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_bytes().splitlines()]
    in_file = [line["record_id"] for line in lines]
    assert [line["request_id"] for line in lines] == ["same"] * 3
    assert len(set(in_file)) == 3 and all(uuid.UUID(r).version == 7 for r in in_file)
    assert sorted(s.attributes["cachetally.record_id"] for s in spans) == sorted(in_file)


class _Random:
    """Counter seeds of ``seed``; no random bits in the tail."""

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def getrandbits(self, bits: int) -> int:
        return self._seed if bits == 41 else 0

    def seed(self, value: object) -> None:
        pass


def _scripted(monkeypatch: pytest.MonkeyPatch, clock_ms: list[int], seed: int) -> None:
    from types import SimpleNamespace

    from proxy.accounting.records import record_id

    times = iter(clock_ms)
    monkeypatch.setattr(record_id, "time", SimpleNamespace(time_ns=lambda: next(times) * 1_000_000))
    monkeypatch.setattr(record_id, "_random", _Random(seed))
    monkeypatch.setattr(record_id, "_last_ms", 0)
    monkeypatch.setattr(record_id, "_counter", 0)


@pytest.mark.parametrize("seed", [(1 << 29) - 2, (1 << 30) - 2])  # a carry into bit 29, into the high field
def test_ids_sort_in_minting_order_across_a_counter_carry_and_a_clock_stepped_back(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Within one millisecond the counter carries across its bits; a clock stepped back (NTP)
    keeps counting from the last id: the ids still sort in the order they were minted, so a
    pipeline that reads them in order loses none."""
    t = 1_700_000_000_000
    _scripted(monkeypatch, [t, t, t, t - 5, t - 5, t + 1], seed)
    ids = [uuid7() for _ in range(6)]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert [i.int >> 80 for i in ids] == [t] * 5 + [t + 1]


def test_a_new_milliseconds_counter_starts_in_its_lower_half() -> None:
    """The counter is reseeded with its top bit clear at each new millisecond, which leaves
    2**41 ids of room before a millisecond must borrow the next one."""
    tops = []
    for _ in range(64):
        time.sleep(0.0011)  # each id the first of its millisecond
        tops.append(uuid7().int >> 75 & 1)
    assert tops == [0] * 64


def test_children_forked_in_one_millisecond_never_mint_the_same_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked from one parent start with its random state: each reseeds, so that even
    in the same millisecond (the clock is frozen here) no two mint the same record id."""
    from types import SimpleNamespace

    from proxy.accounting.records import record_id

    monkeypatch.setattr(record_id, "time", SimpleNamespace(time_ns=lambda: 1_700_000_000_000_000_000))
    minted = _mint(100)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        for chunk in pool.map(_mint, [1000, 1000]):
            minted += chunk
    assert len(set(minted)) == len(minted) == 2100
