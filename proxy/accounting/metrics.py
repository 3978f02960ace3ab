"""Prometheus metrics (prefix ``cachetally_``): each finished request counted from its usage record.

Every series is right in both of prometheus_client's modes:

- **One process**: the metrics live in the registry they are registered in. ``registry=None``
  gives each :class:`Metrics` a private ``CollectorRegistry``, so several apps in one process
  (tests, benchmarks) never share counters; vLLM's middleware passes ``prometheus_client.REGISTRY``.
  The series each request updates are counted in plain numbers and read at scrape
  (:mod:`proxy.accounting.series`); the rest are prometheus_client's own.
- **Several processes** (``PROMETHEUS_MULTIPROC_DIR`` set: ``vllm serve --api-server-count N``,
  ``cachetally serve --workers N``): every series is prometheus_client's own, its values in
  per-pid mmap files in that directory, whatever registry holds the object, and
  ``MultiProcessCollector`` sums them. Custom collectors and ``Gauge.set_function`` are
  invisible there.
  ``cachetally_ledger_open_slots`` is a ``livesum`` gauge: the sum over live processes
  (``cachetally serve --workers`` drops a dead worker's files: :mod:`proxy.server.workers`).
  Empty files are skipped (:class:`_SizedFilesCollector`).

Counts that happen outside a request (ledger evictions and unmatched events, usage records
written or dropped by a sink thread) are counters incremented where the event happens, via
the hooks the ledger and the recorder offer (``UsageLedger.observer``, ``DropCounts.listener``,
``SinkWorker.on_written``). Syncing a source's own counters on scrape would be exact in one
process only: in multiprocess mode another process answers the scrape, and an eviction in
an idle process would stay invisible until that process's next request.

Each request's updates are a few series writes: a dict update each in one process, an mmap
write each in multiprocess mode, where label children are looked up once and kept. What
that costs per request, in each mode: docs/PERFORMANCE.md.

The token and request counters carry a ``tenant`` label, bounded by :mod:`proxy.accounting.tenants`;
the per-request histograms do not (a histogram per tenant and model is too many series).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.accounting.series import Family, Native, Tally
from proxy.accounting.stats import CacheStats, collected_stats
from proxy.patching.ledger import UsageLedger
from proxy.patching.pd_leg import LegMetrics

if TYPE_CHECKING:
    from proxy.accounting.records.record import UsageRecord
    from proxy.accounting.records.recorder import Recorder

_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

# The series every metered request updates (proxy.accounting.series).
REQUESTS = Family("cachetally_requests", "Requests of the metered routes by cache outcome",
                  ("model", "route", "stream", "cache", "tenant"))
PROMPT = Family("cachetally_prompt_tokens", "Prompt tokens of counted requests", ("model", "tenant"))
CACHED = Family("cachetally_cached_tokens", "Prompt tokens served from the prefix cache",
                ("model", "source", "tier", "tenant"))
CACHE_WRITE = Family("cachetally_cache_write_tokens", "Prompt tokens the engine wrote to its prefix cache",
                     ("model", "source", "tenant"))
COMPLETION = Family("cachetally_completion_tokens",
                    "Completion tokens, counted up to the disconnect when a client left early", ("model", "tenant"))
REQUEST_CACHED = Family("cachetally_request_cached_tokens", "Cached prompt tokens per request", ("model",),
                        _TOKEN_BUCKETS)
REQUEST_RATIO = Family("cachetally_request_cache_hit_ratio", "cached_tokens / prompt_tokens per request", ("model",),
                       _RATIO_BUCKETS)
RECORDS_DROPPED = Family("cachetally_usage_records_dropped",
                         "Usage records a sink could not take or write (queue full, write or export failed)",
                         ("sink", "reason"))


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory, when that mode is on."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _SizedFilesCollector(MultiProcessCollector):
    """``MultiProcessCollector`` over the files that have a size.

    prometheus_client creates a process's file empty and sizes it a moment later. Its own
    collector fails the whole scrape on an empty file (``struct.error``), and a process
    killed in that moment leaves the empty file for good, named for a pid that never comes
    back (prometheus/client_python#1199). An empty file holds no value, so it is skipped;
    files only grow, so a file with a size is read as before.
    """

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        super().__init__(registry, path)
        self._dir = path

    def collect(self) -> Iterable[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._dir, "*.db")):
            try:
                if os.path.getsize(path):
                    files.append(path)
            except FileNotFoundError:  # removed since the glob: a dead process's live gauge
                continue
        return self.merge(files, accumulate=True)


class _LedgerMetrics:
    """The ledger's observer (:class:`proxy.patching.ledger.LedgerObserver`): gauge and counters.

    The open-slots gauge is read from the ledger at each scrape in one process; in
    multiprocess mode, where a function gauge is invisible, every open and close writes it.
    """

    def __init__(self, registry: CollectorRegistry, ledger: UsageLedger) -> None:
        gauge = Gauge(
            "cachetally_ledger_open_slots", "Open ledger slots", registry=registry, multiprocess_mode="livesum"
        )
        #: Told of each open and close (module docstring of proxy.patching.ledger).
        self.open_slots: Callable[[int], None] | None
        if multiprocess_dir() is None:
            gauge.set_function(ledger.__len__)
            self.open_slots = None
        else:
            gauge.set(len(ledger))
            self.open_slots = gauge.set
        evicted = Counter(
            "cachetally_ledger_evicted", "Slots evicted by the second line of defence", ["reason"], registry=registry
        )
        self._evicted = {reason: evicted.labels(reason).inc for reason in ("ttl", "cap")}
        self.unmatched = Counter(
            "cachetally_events_unmatched", "Engine events for keys with no open slot (dropped)", registry=registry
        ).inc

    def evicted(self, reason: str, n: int) -> None:
        self._evicted[reason](n)


class Metrics:
    def __init__(self, ledger: UsageLedger, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = CollectorRegistry() if registry is None else registry
        mp_dir = multiprocess_dir()
        if mp_dir is None:
            #: What ``/metrics`` and ``/stats`` read: this registry, or every process's files.
            self.scrape_registry = registry
        else:
            self.scrape_registry = CollectorRegistry()
            _SizedFilesCollector(self.scrape_registry, mp_dir)
        #: Per process; feeds the debug stats line (which then names its pid).
        self.stats = CacheStats(pid=os.getpid() if mp_dir else None)
        self.patch_skipped = Counter(
            "cachetally_patch_skipped", "Responses or events passed through unpatched", ["reason"], registry=registry
        )
        self.legs = LegMetrics(registry)
        #: Requests that would have run the engine unmetered, refused (proxy.patching.routes).
        self.refused_unmetered = Counter(
            "cachetally_refused_unmetered", "Requests refused because the engine would run unmetered", ["route"],
            registry=registry,
        )
        #: Requests answered 503: their process held all it may of bodies still arriving
        #: (proxy.patching.body_budget).
        self.bodies_refused = Counter(
            "cachetally_request_bodies_refused", "Requests refused (503) because the process held "
            "max_request_bytes_held of request bodies still arriving", registry=registry,
        )
        ledger.observer = _LedgerMetrics(registry, ledger)

        series = Native(registry) if mp_dir else Tally(registry)
        self._requests = series.counter(REQUESTS)
        self._prompt = series.counter(PROMPT)
        self._cached = series.counter(CACHED)
        self._cache_write = series.counter(CACHE_WRITE)
        self._completion = series.counter(COMPLETION)
        self._request_cached = series.histogram(REQUEST_CACHED)
        self._request_ratio = series.histogram(REQUEST_RATIO)
        self._mismatch = Counter(
            "cachetally_cached_tokens_mismatch",
            "Responses whose own cached_tokens differed from the engine's",
            registry=registry,
        ).inc
        self._records_written = Counter(
            "cachetally_usage_records_written", "Usage records a sink wrote or exported", ["sink"], registry=registry
        )
        self._records_dropped = Native(registry).counter(RECORDS_DROPPED)  # counted from sink threads

    def count_completion(self, rec: UsageRecord) -> None:
        """Only the completion tokens of a request that is not counted otherwise."""
        if rec.completion_tokens:
            self._completion.add((rec.model, rec.tenant), rec.completion_tokens)

    def record(self, rec: UsageRecord, mismatches: int = 0) -> None:
        """Count one finished request; ``mismatches``: how many of its response's usage
        objects had a figure the engine's overwrote (the counter counts the response once)."""
        model, tenant = rec.model, rec.tenant
        prompt, cached = rec.prompt_tokens, rec.cached_tokens
        cache = "unknown" if prompt is None or cached is None else "hit" if cached else "miss"
        self._requests.add((model, rec.route, "true" if rec.stream else "false", cache, tenant), 1)
        if mismatches:
            self._mismatch()
        if rec.completion_tokens:
            self._completion.add((model, tenant), rec.completion_tokens)
        self.stats.add(prompt, cached)
        if prompt is None or cached is None:
            return  # cache=unknown: not in the token counters, so the hit rate is not diluted
        source = rec.source or "upstream"
        self._prompt.add((model, tenant), prompt)
        self._cached.add((model, source, "all", tenant), cached)
        if rec.local_cached_tokens is not None:
            self._cached.add((model, source, "local", tenant), rec.local_cached_tokens)
        if rec.external_cached_tokens is not None:
            self._cached.add((model, source, "external", tenant), rec.external_cached_tokens)
        if rec.cache_creation_tokens:
            self._cache_write.add((model, source, tenant), rec.cache_creation_tokens)
        self._request_cached.observe(model, cached)
        if prompt:
            self._request_ratio.observe(model, cached / prompt)

    def watch_recorder(self, recorder: Recorder) -> None:
        """Count ``cachetally_usage_records_{written,dropped}_total`` for ``recorder``.

        Call it before ``recorder.start()``: the hooks count from then on.
        """
        for worker in recorder.workers:
            worker.on_written = self._records_written.labels(worker.sink.name).inc
        dropped = self._records_dropped
        recorder.drops.listener = lambda sink, reason, n: dropped.add((sink, reason), n)

    def exposition(self) -> bytes:
        """The ``/metrics`` text: every process's series in multiprocess mode."""
        return generate_latest(self.scrape_registry)

    def stats_dict(self, registry: CollectorRegistry | None = None) -> dict[str, int | float]:
        """``/stats``, from the collected counters of ``registry`` (default: what ``/metrics``
        reads; in multiprocess mode, every process's files, vLLM's API servers included)."""
        return collected_stats(self.scrape_registry if registry is None else registry).as_dict()
