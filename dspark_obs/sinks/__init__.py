"""Live telemetry sinks: RecordSinks fed by the same FanOut as the store.

* :class:`PrometheusSink` - counters and histograms of :mod:`dspark_obs.sinks.catalog`
  (:data:`METRICS`, one declaration per metric, read by Grafana's build and the rules);
* :class:`OtelSink` - GenAI latency histograms, the same counters, one span per request;
* :func:`telemetry_sinks` - both for a run (serving /metrics on a port), in the run's process;
* :class:`SinkProcess` - the store and both, in a process of their own (a decode loop's);
* :class:`StoreFollower` / :func:`replay` - ``dspark-obs serve``: follow a store or replay a run;
* :class:`Aggregator` - the running totals every sink renders (:mod:`.stats`).

Sinks never import the engine (tests/test_house.py checks it).
"""

from dspark_obs.sinks.catalog import METRICS, Metric
from dspark_obs.sinks.otel import OtelSink
from dspark_obs.sinks.process import SinkProcess
from dspark_obs.sinks.prometheus import PrometheusSink
from dspark_obs.sinks.serve import MetricsServer, StoreFollower, replay
from dspark_obs.sinks.stats import Aggregator, Totals
from dspark_obs.sinks.telemetry import telemetry_sinks

__all__ = [
    "METRICS",
    "Aggregator",
    "Metric",
    "MetricsServer",
    "OtelSink",
    "PrometheusSink",
    "SinkProcess",
    "StoreFollower",
    "Totals",
    "replay",
    "telemetry_sinks",
]
