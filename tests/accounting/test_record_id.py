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
