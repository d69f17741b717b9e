"""A run's live telemetry sinks, Prometheus and OpenTelemetry, over one aggregation.

:func:`telemetry_sinks` builds them in this process (the SGLang collector and ``dspark-obs
serve`` run them so, beside their own collectors); :func:`open_telemetry` is the same pair
as the parts a :class:`~dspark_obs.sinks.process.SinkProcess` child runs, which is where a
decode loop wants them (its module docstring says why).
"""

from __future__ import annotations

from typing import Any

from dspark_obs.fanout import RecordSink
from dspark_obs.sinks.otel import OtelSink, otlp_configured
from dspark_obs.sinks.prometheus import PrometheusSink
from dspark_obs.sinks.serve import MetricsServer, start_http
from dspark_obs.sinks.stats import Aggregator

__all__ = ["open_telemetry", "telemetry_sinks"]


def telemetry_sinks(
    metrics_port: int | None,
    otlp_endpoint: str | None,
    host: str = "127.0.0.1",
) -> list[RecordSink]:
    """The live sinks for a run: Prometheus (serving /metrics on ``metrics_port``) and
    OpenTelemetry (when ``otlp_endpoint`` or an OTEL_EXPORTER_OTLP_*ENDPOINT variable is
    set); both read one aggregation, folding on threads of their own. Empty when neither is
    asked for. The Prometheus sink is first, its ``registry`` open to more collectors (the
    SGLang collector's own counters) and its server at ``.server``. Raises ValueError when
    /metrics cannot be served.
    """
    if metrics_port is None and not otlp_configured(otlp_endpoint):
        return []
    sinks, server = open_telemetry(metrics_port, otlp_endpoint, host, background=True)
    if server is not None:
        sinks[0].server = server
    return sinks


def open_telemetry(
    metrics_port: int | None,
    otlp_endpoint: str | None,
    host: str,
    *,
    background: bool,
    export_interval_s: float = 5.0,
) -> tuple[list[Any], MetricsServer | None]:
    """Prometheus (with its /metrics server) and / or OTel over one aggregation, folding on
    fold threads (``background``) or on the caller's. Raises ValueError when /metrics cannot
    be served."""
    aggregator = Aggregator()
    sinks: list[Any] = []
    server = None
    if metrics_port is not None:
        prom = PrometheusSink(aggregator=aggregator, background=background)
        try:
            server = start_http(prom.registry, metrics_port, host)
        except (OSError, OverflowError) as exc:  # in use, not an address, not a port
            prom.close()
            raise ValueError(f"cannot serve /metrics on {host}:{metrics_port}: {exc}") from exc
        sinks.append(prom)
    if otlp_configured(otlp_endpoint):
        sinks.append(
            OtelSink(
                otlp_endpoint,
                aggregator=aggregator if sinks else None,
                export_interval_s=export_interval_s,
                background=background,
            )
        )
    return sinks, server
