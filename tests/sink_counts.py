"""Reading a recorder's outcome as a user would: the counters of a real Prometheus registry
(``Metrics.watch_recorder``, the same hooks ``/metrics`` serves) and the JSONL files parsed
line by line, independently of the sink."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson

from proxy.accounting.metrics import Metrics
from proxy.accounting.records.record import UsageRecord
from proxy.accounting.records.recorder import Recorder
from proxy.patching.ledger import UsageLedger
from tests.servers import metric_value


def watched(recorder: Recorder) -> Metrics:
    metrics = Metrics(UsageLedger())
    metrics.watch_recorder(recorder)
    return metrics


def counters(metrics: Metrics, sink: str) -> tuple[float, dict[str, float]]:
    """(``written_total``, ``dropped_total`` by reason) of ``sink``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = metrics.exposition().decode()
    dropped: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cachetally_usage_records_dropped_total" and sample.labels["sink"] == sink:
                dropped[sample.labels["reason"]] = sample.value
    return metric_value(text, "cachetally_usage_records_written_total", sink=sink), dropped


def ids_in_files(directory: Path) -> Counter[str]:
    """Request ids of the lines that parse as JSON objects, as ``cachetally report`` reads
    them (a torn line is no record); asserts that a torn line only ever ends a file, where
    an abandoned file's last write may leave one, and that no ``record_id`` (the key a
    billing pipeline deduplicates on) is there twice.

    The tests give every request an id of its own, so a request id counted twice is a
    record written twice, or one request billed under two record ids: either is a bill
    too high, and the record ids alone would not show the second."""
    seen: Counter[str] = Counter()
    record_ids: Counter[str] = Counter()
    for path in sorted(directory.glob("*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        for number, line in enumerate(lines, 1):
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                assert number == len(lines), f"{path.name}: line {number} of {len(lines)} is torn"
                continue
            seen[obj["request_id"]] += 1
            record_ids[obj["record_id"]] += 1
    assert [r for r, n in record_ids.items() if n > 1] == [], "a record_id written twice"
    return seen


def usage(n: int) -> UsageRecord:
    """A record with id ``r<n>``."""
    return UsageRecord(request_id=f"r{n}", tenant="t", route="chat", stream=False, start_unix=1.7e9,
                       end_unix=1.7e9 + 1, prompt_tokens=100, cached_tokens=n, completion_tokens=5)
