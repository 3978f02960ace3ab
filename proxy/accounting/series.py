"""The per-request series, counted the cheapest way each prometheus_client mode allows.

Every metered request updates about eight series. Through prometheus_client's own types
each update is three Python calls, a lock and a value object; that was a fifth of what
the middleware added to a request inside vLLM's API server (docs/PERFORMANCE.md, "The
per-request path, by instructions"). So the series are written through one small
interface, ``add(labels, amount)`` and ``observe(label, value)``, with two
implementations, chosen once per process:

- **One process** (:class:`Tally`): plain integers in dicts, one dict update per series,
  on the event loop's thread. A collector registered in the registry reads them at each
  scrape and exposes what prometheus_client's ``Counter`` and ``Histogram`` would: the
  same names, labels, buckets and ``_created`` samples (held against those very types
  by tests/accounting/test_metrics.py).
- **Several processes** (``PROMETHEUS_MULTIPROC_DIR``): a collector is invisible to the
  process that answers the scrape, so :class:`Native` writes prometheus_client's own
  series, whose values live in the per-pid mmap files ``MultiProcessCollector`` sums.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # without ``_total``, as prometheus_client's Counter takes it
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, without +Inf


class Add(Protocol):
    def add(self, labels: tuple[str, ...], amount: float) -> None:
        """The counter family's child ``labels`` grows by ``amount``."""


class Observe(Protocol):
    def observe(self, label: str, value: float) -> None:
        """One observation in the histogram family's child ``label``."""


class _TallyCounter:
    __slots__ = ("family", "values", "created")

    def __init__(self, family: Family) -> None:
        self.family = family
        self.values: dict[tuple[str, ...], float] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], amount: float) -> None:
        values = self.values
        if labels in values:
            values[labels] += amount
        else:
            self.created[labels] = time.time()
            values[labels] = amount

    def metric(self) -> Metric:
        family = self.family
        out = CounterMetricFamily(family.name, family.doc, labels=family.labels)
        created = self.created
        for labels, value in list(self.values.items()):
            out.add_metric(labels, value, created=created[labels])
        return out


class _TallyHistogram:
    __slots__ = ("family", "bounds", "children")

    def __init__(self, family: Family) -> None:
        self.family = family
        self.bounds = family.buckets
        #: label -> [count per bucket (the last is +Inf, not cumulative)..., sum, created]
        self.children: dict[str, list[float]] = {}

    def observe(self, label: str, value: float) -> None:
        child = self.children.get(label)
        if child is None:
            child = self.children[label] = [0] * (len(self.bounds) + 1) + [0.0, time.time()]
        child[bisect_left(self.bounds, value)] += 1  # the first bound >= value: prometheus's "le"
        child[-2] += value

    def metric(self) -> Metric:
        family = self.family
        out = HistogramMetricFamily(family.name, family.doc, labels=family.labels)
        edges = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        for label, child in list(self.children.items()):
            child = list(child)  # one consistent copy: the event loop may write meanwhile
            running, buckets = 0.0, []
            for edge, count in zip(edges, child, strict=False):
                running += count
                buckets.append((edge, running))
            out.add_metric([label], buckets, child[-2])
            out.add_sample(f"{family.name}_created", {family.labels[0]: label}, child[-1])
        return out


class Tally:
    """One process's series in plain numbers, and the collector that exposes them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._series: list[_TallyCounter | _TallyHistogram] = []
        registry.register(self)

    def counter(self, family: Family) -> Add:
        series = _TallyCounter(family)
        self._series.append(series)
        return series

    def histogram(self, family: Family) -> Observe:
        series = _TallyHistogram(family)
        self._series.append(series)
        return series

    def describe(self) -> Iterable[Metric]:
        return ()  # nothing to check at registration; names are unique by construction

    def collect(self) -> Iterator[Metric]:
        for series in self._series:
            yield series.metric()


class _NativeCounter:
    __slots__ = ("_incs", "_metric")

    def __init__(self, metric: Counter) -> None:
        self._metric = metric
        self._incs: dict[tuple[str, ...], Callable[[float], None]] = {}

    def add(self, labels: tuple[str, ...], amount: float) -> None:
        inc = self._incs.get(labels)
        if inc is None:
            inc = self._incs[labels] = self._metric.labels(*labels).inc
        inc(amount)


class _NativeHistogram:
    __slots__ = ("_observes", "_metric")

    def __init__(self, metric: Histogram) -> None:
        self._metric = metric
        self._observes: dict[str, Callable[[float], None]] = {}

    def observe(self, label: str, value: float) -> None:
        observe = self._observes.get(label)
        if observe is None:
            observe = self._observes[label] = self._metric.labels(label).observe
        observe(value)


class Native:
    """prometheus_client's own series (multiprocess mode: module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def counter(self, family: Family) -> Add:
        return _NativeCounter(Counter(family.name, family.doc, family.labels, registry=self._registry))

    def histogram(self, family: Family) -> Observe:
        metric = Histogram(family.name, family.doc, family.labels, buckets=family.buckets, registry=self._registry)
        return _NativeHistogram(metric)
