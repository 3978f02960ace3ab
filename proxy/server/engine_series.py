"""The engine's own series (``Engine.metrics_text``) summed over ``--workers N``.

Each worker runs its own engine: its own upstream connection pool
(``cachetally_upstream_connections_*``), or its own simulator (``sim_*``). Their series
are read from the engine as exposition text, which in one process goes into ``/metrics``
as it is. With several workers that text would show the engine of whichever worker
answers the scrape alone, a different one each time (three streams open on one worker
read 3, 0, 0, 3, ...; a counter goes back and forth, which Prometheus takes for resets).

So with several workers each one writes its engine's series into prometheus_client's
multiprocess files, which every scrape sums over the workers: a counter by what it grew
since the last write, a gauge as a ``livesum`` (the live workers' sum; a dead worker's
files are dropped, :mod:`proxy.server.workers`). Each worker writes at each scrape it
answers and every :data:`PUBLISH_INTERVAL_S`, so another worker's figure is at most that old.
A gauge the engine no longer reports reads 0, and so does each of a worker's whose engine
stopped (:meth:`SharedEngineSeries.retire`): a worker that exits whole (uvicorn's SIGHUP
restart, SIGTTOU) is not dead to the next worker's check if it still runs then, or is not
replaced at all, so its last figures would stay in the sum for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

#: How often each worker writes its engine's series for the scrapes other workers answer.
PUBLISH_INTERVAL_S = 1.0


class SharedEngineSeries:
    """One worker's engine series in the multiprocess files; make it in that worker."""

    def __init__(self, text: Callable[[], bytes]) -> None:
        self._text = text
        self._registry = CollectorRegistry()  # the names only: the values live in the files
        self._series: dict[str, Counter | Gauge] = {}
        #: Each counter child's value at the last write, to add what it grew since.
        self._written: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        #: Each gauge child written, to write 0 for one the engine stops reporting.
        self._gauges: dict[tuple[str, frozenset[tuple[str, str]]], Gauge] = {}

    def publish(self) -> None:
        reported = set()
        for family in text_string_to_metric_families(self._text().decode()):
            for sample in family.samples:
                if family.type == "counter" and sample.name == f"{family.name}_total":  # not _created
                    key = (family.name, frozenset(sample.labels.items()))
                    grown = sample.value - self._written.get(key, 0.0)
                    self._written[key] = sample.value
                    self._child(Counter, family.name, family.documentation, sample.labels).inc(max(grown, 0.0))
                elif family.type == "gauge":
                    key = (family.name, frozenset(sample.labels.items()))
                    gauge = self._gauges[key] = self._child(Gauge, family.name, family.documentation, sample.labels)
                    gauge.set(sample.value)
                    reported.add(key)
        for key, gauge in self._gauges.items():
            if key not in reported:
                gauge.set(0)

    def retire(self) -> None:
        """This worker's engine stopped: its gauges read 0 in the sum (module docstring)."""
        for gauge in self._gauges.values():
            gauge.set(0)

    def _child(self, kind: type[Counter] | type[Gauge], name: str, doc: str, labels: dict[str, str]) -> Counter | Gauge:
        series = self._series.get(name)
        if series is None:
            mode = {"multiprocess_mode": "livesum"} if kind is Gauge else {}
            series = self._series[name] = kind(name, doc, sorted(labels), registry=self._registry, **mode)
        return series.labels(**labels) if labels else series

    async def run(self) -> None:
        """Publish every :data:`PUBLISH_INTERVAL_S`, until cancelled."""
        while True:
            self.publish()
            await asyncio.sleep(PUBLISH_INTERVAL_S)
