"""Prometheus metrics (prefix ``cachetally_``) and the per-request record they count.

Each app owns its registry, so several apps (tests, benchmarks) never share counters.
The token and request counters carry a ``tenant`` label, bounded by :mod:`proxy.tenants`;
the per-request histograms do not (a histogram per tenant and model is too many series).
The ledger's own counters are read at scrape time, so the ledger stays free of metrics.

The per-request series are plain dicts of numbers that a collector turns into metric
families at scrape time (prometheus_client's custom-collector API), not ``Counter`` and
``Histogram`` children: those take a lock and do label bookkeeping on every call, about
6 us for the seven updates of one request against about 1.4 us here. Everything runs in
the event loop's thread, scrapes included, so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy.ledger import UsageLedger
from proxy.stats import CacheStats

if TYPE_CHECKING:
    from proxy.records.recorder import Recorder

_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


@dataclass(slots=True)
class RequestRecord:
    """One finished chat or completions request, as the proxy saw it."""

    model: str
    route: str  # chat | completions
    stream: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    source: str | None = None  # engine | upstream | None when unknown
    local_cached_tokens: int | None = None
    external_cached_tokens: int | None = None
    mismatches: int = 0
    tenant: str = "default"
    completion_tokens: int = 0

    @property
    def cache(self) -> str:
        if self.cached_tokens is None or self.prompt_tokens is None:
            return "unknown"
        return "hit" if self.cached_tokens > 0 else "miss"


class _LedgerCollector(Collector):
    def __init__(self, ledger: UsageLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        counters = self._ledger.counters
        evicted = CounterMetricFamily(
            "cachetally_ledger_evicted", "Slots evicted by the second line of defence", labels=["reason"]
        )
        evicted.add_metric(["ttl"], counters.evicted_ttl)
        evicted.add_metric(["cap"], counters.evicted_cap)
        yield evicted
        yield CounterMetricFamily(
            "cachetally_events_unmatched",
            "Engine events for keys with no open slot (dropped)",
            value=counters.unmatched_events,
        )


class _RecordsCollector(Collector):
    """Usage records written and dropped per sink, read from the recorder at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        recorder = self._metrics._recorder
        written = CounterMetricFamily(
            "cachetally_usage_records_written", "Usage records a sink wrote or exported", labels=["sink"]
        )
        dropped = CounterMetricFamily(
            "cachetally_usage_records_dropped",
            "Usage records a sink could not take or write (queue full, write or export failed)",
            labels=["sink", "reason"],
        )
        if recorder is not None:
            for worker in recorder.workers:
                written.add_metric([worker.sink.name], worker.written)
            for (sink, reason), value in recorder.drops.snapshot().items():
                dropped.add_metric([sink, reason], value)
        yield written
        yield dropped


@dataclass(slots=True)
class _Histogram:
    """One histogram series: observations per bucket (not cumulative; the last is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class _RequestSeries(Collector):
    """The per-request counters and histograms, by label values."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, str, str, str, str], int] = defaultdict(int)
        self.prompt_tokens: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.cached_tokens: defaultdict[tuple[str, str, str, str], int] = defaultdict(int)
        self.completion_tokens: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.mismatches = 0
        self.request_cached: dict[str, _Histogram] = {}
        self.request_ratio: dict[str, _Histogram] = {}

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, doc: str, labels: list[str], series: dict[tuple[str, ...], int]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels)
            for values, value in series.items():
                family.add_metric(list(values), value)
            return family

        def histogram(name: str, doc: str, series: dict[str, _Histogram]) -> Metric:
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, h in series.items():
                family.add_metric([model], h.buckets(), h.total)
            return family

        yield counter(
            "cachetally_prompt_tokens", "Prompt tokens of counted requests", ["model", "tenant"], self.prompt_tokens
        )
        yield counter(
            "cachetally_cached_tokens",
            "Prompt tokens served from the prefix cache",
            ["model", "source", "tier", "tenant"],
            self.cached_tokens,
        )
        yield counter(
            "cachetally_completion_tokens",
            "Completion tokens, counted up to the disconnect when a client left early",
            ["model", "tenant"],
            self.completion_tokens,
        )
        yield counter(
            "cachetally_requests",
            "Chat and completions requests by cache outcome",
            ["model", "route", "stream", "cache", "tenant"],
            self.requests,
        )
        yield histogram("cachetally_request_cached_tokens", "Cached prompt tokens per request", self.request_cached)
        yield histogram(
            "cachetally_request_cache_hit_ratio", "cached_tokens / prompt_tokens per request", self.request_ratio
        )
        yield CounterMetricFamily(
            "cachetally_cached_tokens_mismatch",
            "Responses whose own cached_tokens differed from the engine's",
            value=self.mismatches,
        )


class Metrics:
    def __init__(self, ledger: UsageLedger, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.stats = CacheStats()
        self._series = _RequestSeries()
        registry.register(self._series)
        self.patch_skipped = Counter(
            "cachetally_patch_skipped",
            "Responses or events passed through unpatched",
            ["reason"],
            registry=registry,
        )
        open_slots = Gauge("cachetally_ledger_open_slots", "Open ledger slots", registry=registry)
        open_slots.set_function(lambda: len(ledger))
        registry.register(_LedgerCollector(ledger))
        self._recorder: Recorder | None = None
        registry.register(_RecordsCollector(self))

    def count_completion(self, rec: RequestRecord) -> None:
        """Only the completion tokens of a request that is not counted otherwise."""
        if rec.completion_tokens:
            self._series.completion_tokens[rec.model, rec.tenant] += rec.completion_tokens

    def record(self, rec: RequestRecord) -> None:
        series, model, tenant = self._series, rec.model, rec.tenant
        series.requests[model, rec.route, "true" if rec.stream else "false", rec.cache, tenant] += 1
        series.mismatches += rec.mismatches
        self.count_completion(rec)
        prompt, cached = rec.prompt_tokens, rec.cached_tokens
        self.stats.add(prompt, cached)
        if prompt is None or cached is None:
            return  # cache=unknown: not in the token counters, so the hit rate is not diluted
        source = rec.source or "upstream"
        series.prompt_tokens[model, tenant] += prompt
        series.cached_tokens[model, source, "all", tenant] += cached
        if rec.local_cached_tokens is not None:
            series.cached_tokens[model, source, "local", tenant] += rec.local_cached_tokens
        if rec.external_cached_tokens is not None:
            series.cached_tokens[model, source, "external", tenant] += rec.external_cached_tokens
        per_request = series.request_cached.get(model)
        if per_request is None:
            per_request = series.request_cached[model] = _Histogram(_TOKEN_BUCKETS)
        per_request.observe(cached)
        if prompt:
            ratio = series.request_ratio.get(model)
            if ratio is None:
                ratio = series.request_ratio[model] = _Histogram(_RATIO_BUCKETS)
            ratio.observe(cached / prompt)

    def watch_recorder(self, recorder: Recorder) -> None:
        """Export ``cachetally_usage_records_{written,dropped}_total`` from ``recorder``."""
        self._recorder = recorder

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
