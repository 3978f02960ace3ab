"""The ``cachetally_*`` series expose exactly what prometheus_client's own types would, in
one process and summed over processes by ``MultiProcessCollector``; ``/stats`` agrees."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from engine_adapter.events import Scheduled
from proxy.accounting.metrics import _RATIO_BUCKETS, _TOKEN_BUCKETS, Metrics
from proxy.accounting.records.record import UsageRecord
from proxy.accounting.records.queue import Delivery
from proxy.accounting.records.recorder import Recorder
from proxy.patching.ledger import UsageLedger
from tests.servers import stop

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("cachetally_requests", "cachetally_prompt_tokens", "cachetally_cached_tokens_total",
            "cachetally_cache_write_tokens",
            "cachetally_completion_tokens", "cachetally_request_cached_tokens", "cachetally_request_cache_hit_ratio",
            "cachetally_cached_tokens_mismatch")


def samples(text: bytes, prefix: str) -> dict[str, float]:
    """``name{labels} value`` lines of one family, labels sorted, ``_created`` left out."""
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(prefix) and "_created" not in line:
            name, _, value = line.rpartition(" ")
            if "{" in name:
                base, labels = name[:-1].split("{", 1)
                name = base + "{" + ",".join(sorted(labels.split(","))) + "}"
            out[name] = float(value)
    return out


@dataclass(frozen=True)
class Counted:
    """One finished request's figures, as the tests generate them."""

    model: str
    route: str
    stream: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    source: str | None = None
    local_cached_tokens: int | None = None
    external_cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    mismatches: int = 0
    tenant: str = "default"
    completion_tokens: int = 0

    def count(self, metrics: Metrics) -> None:
        """``metrics`` counts this request's usage record, as the middleware hands it over."""
        fields = {k: v for k, v in asdict(self).items() if k != "mismatches"}
        metrics.record(UsageRecord(request_id="r", start_unix=0.0, **fields), self.mismatches)


def cache_of(rec: Counted) -> str:
    """The ``cache`` label as docs/ACCOUNTING.md defines it: unknown without both figures,
    else hit when any prompt token was cached."""
    if rec.prompt_tokens is None or rec.cached_tokens is None:
        return "unknown"
    return "hit" if rec.cached_tokens > 0 else "miss"


def reference(recs: list[Counted]) -> bytes:
    """The exposition prometheus_client's own Counter and Histogram give for ``recs``."""
    registry = CollectorRegistry()
    requests = Counter("cachetally_requests", "", ["model", "route", "stream", "cache", "tenant"], registry=registry)
    prompt = Counter("cachetally_prompt_tokens", "", ["model", "tenant"], registry=registry)
    cached = Counter("cachetally_cached_tokens", "", ["model", "source", "tier", "tenant"], registry=registry)
    completion = Counter("cachetally_completion_tokens", "", ["model", "tenant"], registry=registry)
    writes = Counter("cachetally_cache_write_tokens", "", ["model", "source", "tenant"], registry=registry)
    mismatch = Counter("cachetally_cached_tokens_mismatch", "", registry=registry)
    per_request = Histogram("cachetally_request_cached_tokens", "", ["model"], buckets=_TOKEN_BUCKETS,
                            registry=registry)
    ratio = Histogram("cachetally_request_cache_hit_ratio", "", ["model"], buckets=_RATIO_BUCKETS,
                      registry=registry)
    for rec in recs:
        requests.labels(rec.model, rec.route, str(rec.stream).lower(), cache_of(rec), rec.tenant).inc()
        if rec.mismatches:  # a response counts once, however many of its usage objects
            mismatch.inc()
        if rec.completion_tokens:
            completion.labels(rec.model, rec.tenant).inc(rec.completion_tokens)
        if cache_of(rec) == "unknown":
            continue
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        source = rec.source or "upstream"
        prompt.labels(rec.model, rec.tenant).inc(rec.prompt_tokens)
        cached.labels(rec.model, source, "all", rec.tenant).inc(rec.cached_tokens)
        for tier, value in (("local", rec.local_cached_tokens), ("external", rec.external_cached_tokens)):
            if value is not None:
                cached.labels(rec.model, source, tier, rec.tenant).inc(value)
        if rec.cache_creation_tokens:
            writes.labels(rec.model, source, rec.tenant).inc(rec.cache_creation_tokens)
        per_request.labels(rec.model).observe(rec.cached_tokens)
        if rec.prompt_tokens:
            ratio.labels(rec.model).observe(rec.cached_tokens / rec.prompt_tokens)
    return generate_latest(registry)


def expected_stats(recs: list[Counted]) -> dict[str, int | float]:
    """``/stats`` for ``recs``, written out here rather than taken from the code that serves
    it: hit rates over the requests and prompt tokens whose cache is known."""
    known = [rec for rec in recs if cache_of(rec) != "unknown"]
    hits = sum(cache_of(rec) == "hit" for rec in known)
    prompt = sum(rec.prompt_tokens or 0 for rec in known)
    cached = sum(rec.cached_tokens or 0 for rec in known)
    return {
        "total_requests": len(recs),
        "hit_requests": hits,
        "miss_requests": len(known) - hits,
        "unknown_requests": len(recs) - len(known),
        "hit_rate": round(hits / len(known), 4) if known else 0.0,
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "token_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
    }


records = st.builds(
    Counted,
    model=st.sampled_from(["m1", "m2"]),
    route=st.sampled_from(["chat", "completions"]),
    stream=st.booleans(),
    prompt_tokens=st.one_of(st.none(), st.integers(0, 200_000)),
    cached_tokens=st.one_of(st.none(), st.integers(0, 200_000)),
    source=st.sampled_from([None, "engine", "upstream"]),
    local_cached_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    external_cached_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    cache_creation_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    mismatches=st.integers(0, 2),
    tenant=st.sampled_from(["default", "other", "team-a"]),
    completion_tokens=st.integers(0, 5_000),
)


@settings(deadline=None)  # a pass/fail test, not a timing: the machine is shared
@given(st.lists(records, max_size=30))
def test_series_match_prometheus_client_counters_and_histograms(recs: list[Counted]) -> None:
    metrics = Metrics(UsageLedger())
    for rec in recs:
        rec.count(metrics)
    ours, theirs = metrics.exposition(), reference(recs)
    for family in FAMILIES:
        assert samples(ours, family) == samples(theirs, family), family
    assert metrics.stats_dict() == expected_stats(recs)


def test_each_metrics_has_its_own_registry() -> None:
    one, two = Metrics(UsageLedger()), Metrics(UsageLedger())
    Counted("m", "chat", False, prompt_tokens=10, cached_tokens=4).count(one)
    assert one.stats_dict()["total_requests"] == 1
    assert two.stats_dict()["total_requests"] == 0


def test_ledger_and_recorder_counts_are_counted_as_they_happen() -> None:
    ticks = iter(range(0, 10_000, 100))
    ledger = UsageLedger(ttl_s=50, max_slots=2, clock=lambda: next(ticks))
    metrics = Metrics(ledger)
    ledger.open("a")
    ledger.open("b")
    ledger.open("c")  # over the cap: "a" goes
    ledger.publish(Scheduled("nobody", prompt_tokens=4, cached_tokens=0))
    assert ledger.sweep() == 2  # "b" and "c" are older than the TTL by now
    ledger.open("d")
    text = metrics.exposition()
    assert samples(text, "cachetally_ledger_evicted") == {
        'cachetally_ledger_evicted_total{reason="cap"}': 1.0,
        'cachetally_ledger_evicted_total{reason="ttl"}': 2.0,
    }
    assert samples(text, "cachetally_events_unmatched") == {"cachetally_events_unmatched_total": 1.0}
    assert samples(text, "cachetally_ledger_open_slots") == {"cachetally_ledger_open_slots": 1.0}


class _Sink:
    """A sink that takes every record, or (``lossy``) loses the odd ones, however they are batched."""

    failure = "write_failed"

    def __init__(self, name: str, lossy: bool = False) -> None:
        self.name, self.lossy = name, lossy

    def write(self, batch: list[int]) -> Delivery:
        lost = sum(record % 2 for record in batch) if self.lossy else 0
        return Delivery(written=len(batch) - lost, lost=lost)

    def close(self) -> None:
        pass


def test_usage_records_written_and_dropped_reach_the_counters() -> None:
    metrics = Metrics(UsageLedger())
    recorder = Recorder([_Sink("whole"), _Sink("lossy", lossy=True)], max_queued=100, interval_s=0.01)  # type: ignore[list-item]
    metrics.watch_recorder(recorder)
    recorder.start()
    for i in range(40):
        recorder.submit(i)  # type: ignore[arg-type]  # the sinks never look inside
    recorder.stop(timeout_s=10)
    recorder.submit(40)  # type: ignore[arg-type]  # after the stop: dropped, counted
    assert samples(metrics.exposition(), "cachetally_usage_records_written") == {
        'cachetally_usage_records_written_total{sink="whole"}': 40.0,
        'cachetally_usage_records_written_total{sink="lossy"}': 20.0,
    }
    assert samples(metrics.exposition(), "cachetally_usage_records_dropped") == {
        'cachetally_usage_records_dropped_total{reason="write_failed",sink="lossy"}': 20.0,
        'cachetally_usage_records_dropped_total{reason="stopped",sink="lossy"}': 1.0,
        'cachetally_usage_records_dropped_total{reason="stopped",sink="whole"}': 1.0,
    }


# One process of the multiprocess test: records what it is given, leaves slots open.
_CHILD = """
import json, sys
from engine_adapter.events import Scheduled
from proxy.accounting.metrics import Metrics
from proxy.accounting.records.record import UsageRecord
from proxy.patching.ledger import UsageLedger
job = json.load(sys.stdin)
ledger = UsageLedger()
metrics = Metrics(ledger)
for rec in job["records"]:
    mismatches = rec.pop("mismatches")
    metrics.record(UsageRecord(request_id="r", start_unix=0.0, **rec), mismatches)
for i in range(job["open"]):
    ledger.open(f"slot-{i}")
ledger.publish(Scheduled("nobody", prompt_tokens=1, cached_tokens=0))
metrics.patch_skipped.labels("too_large").inc()
print(metrics.stats.line())
"""


def _random_records(rng: random.Random, n: int) -> list[Counted]:
    out = []
    for _ in range(n):
        prompt = rng.choice([None, 0, rng.randrange(1, 300_000)])
        cached = None if rng.random() < 0.1 else rng.randrange(0, 1 + (prompt or 0))
        out.append(Counted(
            model=rng.choice(["m1", "m2"]), route=rng.choice(["chat", "completions"]), stream=rng.random() < 0.5,
            prompt_tokens=prompt, cached_tokens=cached, source=rng.choice([None, "engine", "upstream"]),
            local_cached_tokens=rng.choice([None, rng.randrange(100)]),
            cache_creation_tokens=rng.choice([None, 0, rng.randrange(100)]), mismatches=rng.randrange(2),
            tenant=rng.choice(["default", "team-a"]), completion_tokens=rng.randrange(50),
        ))
    return out


def test_multiprocess_mode_sums_every_process(tmp_path: Path) -> None:
    rng = random.Random(13)
    jobs = [{"records": _random_records(rng, 200), "open": 3}, {"records": _random_records(rng, 150), "open": 2}]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
        for _ in jobs
    ]
    lines = []
    try:
        for child, job in zip(children, jobs, strict=True):
            out, _ = child.communicate(json.dumps({**job, "records": [asdict(r) for r in job["records"]]}), timeout=60)
            assert child.returncode == 0
            lines.append(out.strip())
    finally:
        for child in children:  # one that failed or hung must not outlive the test
            stop(child)
    for child, line in zip(children, lines, strict=True):
        assert line.endswith(f" pid={child.pid}")  # the debug line says which process it counts

    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    collected = generate_latest(registry)
    everything = jobs[0]["records"] + jobs[1]["records"]
    theirs = reference(everything)
    for family in FAMILIES:
        got, want = samples(collected, family), samples(theirs, family)
        # Ratio sums are floats added in another order (per process, then summed).
        assert got == pytest.approx(want, rel=1e-12), family
    assert samples(collected, "cachetally_ledger_open_slots") == {"cachetally_ledger_open_slots": 5.0}
    assert samples(collected, "cachetally_events_unmatched") == {"cachetally_events_unmatched_total": 2.0}
    assert samples(collected, "cachetally_patch_skipped") == {
        'cachetally_patch_skipped_total{reason="too_large"}': 2.0
    }
    # /stats from the multiprocess view: what one process would have counted for all.
    assert Metrics(UsageLedger()).stats_dict(registry) == expected_stats(everything)
    # A dead process's open slots leave the live sum; its counts stay.
    mark_process_dead(children[0].pid, str(tmp_path))
    collected = generate_latest(registry)
    assert samples(collected, "cachetally_ledger_open_slots") == {"cachetally_ledger_open_slots": 2.0}
    assert samples(collected, "cachetally_requests") == samples(theirs, "cachetally_requests")


# One worker whose requests left three slots open (a missed drop guard) before one more opened:
# past the TTL, the sweep evicts the three.
_SWEPT = """
from proxy.accounting.metrics import Metrics
from proxy.patching.ledger import UsageLedger
now = [0.0]
ledger = UsageLedger(ttl_s=10, clock=lambda: now[0])
metrics = Metrics(ledger)
for i in range(3):
    ledger.open(f"leaked-{i}")
now[0] = 11.0
ledger.open("fresh")
assert ledger.sweep() == 3
"""


def test_in_multiprocess_mode_the_slots_the_sweep_evicts_leave_the_open_slots_gauge(tmp_path: Path) -> None:
    """With ``--workers N`` the gauge is written by each process, not read from its ledger at
    the scrape: slots the TTL sweep evicted must leave it, or an operator reads a leak the
    sweep already ended, for as long as the worker lives."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _SWEPT], env=env, cwd=ROOT, check=True, timeout=60)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path))
    collected = generate_latest(registry)
    assert samples(collected, "cachetally_ledger_open_slots") == {"cachetally_ledger_open_slots": 1.0}
    assert samples(collected, "cachetally_ledger_evicted") == {
        'cachetally_ledger_evicted_total{reason="cap"}': 0.0,
        'cachetally_ledger_evicted_total{reason="ttl"}': 3.0,
    }
