"""Prometheus exporter: a RecordSink whose totals a custom collector exposes at scrape time.

The engine thread only enqueues each batch (``write`` is O(1)); a worker thread folds it into
:class:`~dspark_obs.sinks.stats.Aggregator` totals with array code, and a scrape renders the
current totals as counter and histogram families (names in :mod:`dspark_obs.sinks.catalog`).
So nothing on the decode loop waits for aggregation, a scrape or the network.

A new series is exposed at 0 on the first scrape that sees it, and with its value from the
next scrape on, so ``increase()`` / ``rate()`` lose nothing of its first increments.

Acceptance per position (a trimmed position is never a rejection)::

    sum by (position) (rate(dspark_position_accepted_total[5m]))
      / sum by (position) (rate(dspark_position_observed_total[5m]))
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import pyarrow as pa
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dspark_obs.fanout import LaneStats
from dspark_obs.sinks._worker import FoldWorker
from dspark_obs.sinks.catalog import DEFAULT_MAX_GAMMA, METRICS
from dspark_obs.sinks.stats import Aggregator, Totals
from dspark_obs.validation import RecordError

__all__ = ["PrometheusSink", "TotalsCollector", "render_totals"]


def _le(edge: float) -> str:
    return str(int(edge)) if float(edge).is_integer() else repr(float(edge))


def render_totals(totals: Totals, shown: set[tuple[str, tuple]] | None = None) -> Iterator[Metric]:
    """Every catalog metric as a prometheus_client family (empty families included).

    ``shown``: the series a scraper has already seen. A series not in it is rendered at 0
    (buckets, sum and count too) and added: it is born at 0, so Prometheus' increase() and
    rate() count its first increments, which a series that appears at its first value loses.
    """

    def born(name: str, key: tuple) -> bool:
        if shown is None or (name, key) in shown:
            return False
        shown.add((name, key))
        return True

    for m in METRICS:
        if m.kind == "counter":
            fam = CounterMetricFamily(m.family, m.help, labels=m.labels, unit="")
            for key, value in sorted(totals.counters[m.name].items()):
                fam.add_metric(key, 0.0 if born(m.name, key) else value)
        else:
            fam = HistogramMetricFamily(m.name, m.help, labels=m.labels)
            edges = [_le(e) for e in totals.buckets[m.name]] + ["+Inf"]
            for key, (counts, total) in sorted(totals.histograms[m.name].items()):
                if born(m.name, key):
                    counts, total = counts * 0.0, 0.0
                cumulative = counts.cumsum().tolist()
                fam.add_metric(key, list(zip(edges, cumulative, strict=True)), total)
        yield fam


class TotalsCollector(Collector):
    """Renders an Aggregator's totals at each scrape (after pending batches are folded in).

    Every series is exposed at 0 on the first scrape that sees it and with its value from
    the next one on (see :func:`render_totals`), except those :meth:`adopt` marks as
    resumed: totals a restarted ``serve`` rebuilt from the store continue where the previous
    process left them, so showing them at 0 would read as a counter reset.
    """

    def __init__(self, aggregator: Aggregator, before_scrape=None, resuming: bool = False) -> None:
        self.aggregator = aggregator
        self._before_scrape = before_scrape
        self._shown: set[tuple[str, tuple]] = set()
        self._lock = threading.Lock()
        self._resuming = resuming

    def adopt(self) -> None:
        """Expose every current series with its value from the next scrape on (resumed)."""
        totals = self.aggregator.snapshot()
        with self._lock:
            for name, series in totals.counters.items():
                self._shown.update((name, key) for key in series)
            for name, series in totals.histograms.items():
                self._shown.update((name, key) for key in series)
            self._resuming = False

    def collect(self) -> Iterable[Metric]:
        if self._before_scrape is not None:
            self._before_scrape()
        if self._resuming:  # partial totals would read as a reset: show no series yet
            return list(render_totals(Totals(), set()))
        totals = self.aggregator.snapshot()
        with self._lock:
            return list(render_totals(totals, self._shown))

    def describe(self) -> Iterable[Metric]:
        return []  # families are dynamic: skip the registry's duplicate-name probe


class PrometheusSink:
    """RecordSink exposing the catalog metrics in ``registry`` (a fresh one by default).

    ``background=False`` folds batches in on the caller's thread (replays, tests).
    ``resuming=True``: the totals are being rebuilt (``serve`` reading its store after a
    restart); scrapes show no series until :meth:`adopt_current`. Serve
    ``sink.registry`` with :func:`dspark_obs.sinks.serve.start_http`. A shared
    ``aggregator`` lets an :class:`~dspark_obs.sinks.otel.OtelSink` read the same totals.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        background: bool = True,
        aggregator: Aggregator | None = None,
        resuming: bool = False,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.aggregator = aggregator if aggregator is not None else Aggregator(max_gamma)
        self._worker = FoldWorker(self.aggregator.update, background, "dspark-obs-prometheus")
        self.collector = TotalsCollector(self.aggregator, self._worker.flush, resuming)
        self.registry.register(self.collector)

    def adopt_current(self) -> None:
        """Mark every series now in the totals as resumed (``serve`` after its first read of
        the store): they keep their value on the first scrape instead of being born at 0."""
        self.flush()
        self.collector.adopt()

    @property
    def fold_cpu_seconds(self) -> float:
        """CPU time the worker spent folding batches into the totals."""
        return self._worker.cpu_seconds

    @property
    def queue_stats(self) -> LaneStats | None:
        """The fold queue's counters (backpressure included); None when folding inline."""
        return self._worker.stats

    @property
    def errors(self) -> list[str]:
        """Aggregation failures (a sink never breaks the run)."""
        return self._worker.errors

    def write(self, table: str, batch: pa.Table) -> None:
        self._worker.write(table, batch)

    def rejected(self, errors: list[RecordError]) -> None:
        """Count rows a FanOut refused (they never reach ``write``)."""
        self.aggregator.reject(errors)

    def flush(self) -> None:
        """Wait until every written batch is part of the totals, estimator sums included."""
        self._worker.flush()
        self.aggregator.finalize()

    def close(self) -> None:
        self._worker.close()
        self.aggregator.finalize()
