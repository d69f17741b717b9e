"""Backpressure of the sink queues as Prometheus counters, read live on every scrape.

``registry.register(LaneCollector(fan.stats))`` (or :func:`expose_backpressure`) exposes, per
sink (``sink`` label: the sink's class name, numbered when repeated; a bounded set), the
counters of its queue in a threaded :class:`~dspark_obs.fanout.FanOut` (or a FoldWorker's
``stats``):

* ``dspark_sink_batches_total``: batches the sink acknowledged (its write returned);
* ``dspark_sink_rows_total``: rows handed to its queue;
* ``dspark_sink_failed_batches_total``: batches never written because the sink failed;
* ``dspark_sink_blocked_total`` / ``dspark_sink_blocked_seconds_total``: how often and how
  long the producer waited on the sink's full queue (the decode loop's backpressure).

The names and help are the catalog's (:data:`~dspark_obs.sinks.catalog.BACKPRESSURE_METRICS`).
Counters only (the catalog's rule): the deepest queue a run saw is in the run summary
(:meth:`FanOut.summary`), and ``rate(dspark_sink_blocked_seconds_total[1m])`` is the share
of time the producer spent waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dspark_obs.fanout import FanOut, LaneStats
from dspark_obs.sinks.catalog import BACKPRESSURE_METRICS

_FIELD = {  # LaneStats attribute of each catalog counter
    "dspark_sink_batches": "done",
    "dspark_sink_rows": "rows",
    "dspark_sink_failed_batches": "failed",
    "dspark_sink_blocked": "blocked",
    "dspark_sink_blocked_seconds": "blocked_seconds",
}
BACKPRESSURE_COUNTERS = {m.family: (_FIELD[m.family], m.help) for m in BACKPRESSURE_METRICS}
"""Family name -> (LaneStats attribute, help), from the metric catalog."""


class LaneCollector(Collector):
    """Reads ``stats()`` (a list of LaneStats) at each scrape; nothing is copied between."""

    def __init__(self, stats: Callable[[], Iterable[LaneStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        lanes = list(self._stats())
        for name, (attr, doc) in BACKPRESSURE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["sink"])
            for s in lanes:
                family.add_metric([s.name], float(getattr(s, attr)))
            yield family


def expose_backpressure(fan: FanOut, sinks: Iterable[object]) -> int:
    """Register ``LaneCollector(fan.stats)`` in the registry of every sink that serves one
    (a :class:`~dspark_obs.sinks.prometheus.PrometheusSink`), or hand ``fan.stats`` to a
    sink that serves /metrics from another process (``follow_backpressure``: a
    :class:`~dspark_obs.sinks.process.SinkProcess`), so the run's /metrics carries its
    own backpressure live; returns how many sinks got it."""
    registered = 0
    for sink in sinks:
        registry = getattr(sink, "registry", None)
        follow = getattr(sink, "follow_backpressure", None)
        if registry is not None:
            registry.register(LaneCollector(fan.stats))
            registered += 1
        elif follow is not None:
            follow(fan.stats)
            registered += 1
    return registered
