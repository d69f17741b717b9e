"""Live telemetry sinks (RecordSinks fed by the same FanOut as the store).

* :class:`PrometheusSink` - counters and histograms of :mod:`dspark_obs.sinks.catalog`;
* :class:`OtelSink` - GenAI latency histograms, the same counters, one span per request;
* :func:`telemetry_sinks` - both for an in-process run (serving /metrics on a port);
* :mod:`dspark_obs.sinks.serve` - ``dspark-obs serve``: follow a store or replay a run.

Sinks never import the engine; imports are lazy so reading the catalog stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["OtelSink", "PrometheusSink", "telemetry_sinks"]

_HOME = {
    "OtelSink": "dspark_obs.sinks.otel",
    "PrometheusSink": "dspark_obs.sinks.prometheus",
    "telemetry_sinks": "dspark_obs.sinks.serve",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'dspark_obs.sinks' has no attribute {name!r}")
