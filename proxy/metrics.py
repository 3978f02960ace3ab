"""Prometheus metrics (prefix ``cachetally_``) and the per-request record they count.

Each app owns its registry, so several apps (tests, benchmarks) never share counters.
The ledger's own counters are read at scrape time, so the ledger stays free of metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.ledger import UsageLedger
from proxy.stats import CacheStats

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


class Metrics:
    def __init__(self, ledger: UsageLedger) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.stats = CacheStats()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.prompt_tokens = Counter(
            "cachetally_prompt_tokens", "Prompt tokens of counted requests", ["model"], registry=registry
        )
        self.cached_tokens = Counter(
            "cachetally_cached_tokens",
            "Prompt tokens served from the prefix cache",
            ["model", "source", "tier"],
            registry=registry,
        )
        self.requests = Counter(
            "cachetally_requests",
            "Chat and completions requests by cache outcome",
            ["model", "route", "stream", "cache"],
            registry=registry,
        )
        self.request_cached = Histogram(
            "cachetally_request_cached_tokens",
            "Cached prompt tokens per request",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.request_ratio = Histogram(
            "cachetally_request_cache_hit_ratio",
            "cached_tokens / prompt_tokens per request",
            ["model"],
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.mismatch = Counter(
            "cachetally_cached_tokens_mismatch",
            "Responses whose own cached_tokens differed from the engine's",
            registry=registry,
        )
        self.patch_skipped = Counter(
            "cachetally_patch_skipped",
            "Responses or events passed through unpatched",
            ["reason"],
            registry=registry,
        )
        open_slots = Gauge("cachetally_ledger_open_slots", "Open ledger slots", registry=registry)
        open_slots.set_function(lambda: len(ledger))
        registry.register(_LedgerCollector(ledger))

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoized: ``labels()`` costs microseconds per call,
        and the label sets are few (models x routes x outcomes)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record(self, rec: RequestRecord) -> None:
        child = self._child
        child(self.requests, rec.model, rec.route, "true" if rec.stream else "false", rec.cache).inc()
        if rec.mismatches:
            self.mismatch.inc(rec.mismatches)
        self.stats.add(rec.prompt_tokens, rec.cached_tokens)
        if rec.cache == "unknown":
            return
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        source = rec.source or "upstream"
        child(self.prompt_tokens, rec.model).inc(rec.prompt_tokens)
        child(self.cached_tokens, rec.model, source, "all").inc(rec.cached_tokens)
        if rec.local_cached_tokens is not None:
            child(self.cached_tokens, rec.model, source, "local").inc(rec.local_cached_tokens)
        if rec.external_cached_tokens is not None:
            child(self.cached_tokens, rec.model, source, "external").inc(rec.external_cached_tokens)
        child(self.request_cached, rec.model).observe(rec.cached_tokens)
        if rec.prompt_tokens:
            child(self.request_ratio, rec.model).observe(rec.cached_tokens / rec.prompt_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
