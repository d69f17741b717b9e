"""OpenTelemetry exporter, following the GenAI semantic conventions (semantic-conventions-genai).

* ``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token`` (first token
  excluded) and ``gen_ai.server.request.duration``: histograms in seconds, recorded once per
  finished request, with the conventions' bucket advice extended to cover an H200 and the
  CPU engine (:mod:`dspark_obs.sinks.catalog`).
* ``gen_ai.client.token.usage``: histogram in ``{token}``, one input and one output
  observation per finished request (``gen_ai.token.type`` = ``input`` | ``output``).
* every counter of :mod:`dspark_obs.sinks.catalog` as an observable counter named
  ``dspark.<name>`` (``dspark_position_accepted_total`` -> ``dspark.position_accepted``),
  read from the same totals the Prometheus exporter renders (no extra work per batch). Their
  model label is ``gen_ai.request.model``, as on the histograms and spans; the others are
  ``dspark.<label>``.
* one span per request: ``gen_ai.*`` where the GenAI conventions define the attribute,
  ``dspark.*`` for the rest (verify steps, accept length, window, ceiling, confidence).
  ``gen_ai.response.id`` is ``<run_id>/<rid>``: unique per run, so a companion run's spans
  never reuse its compact run's ids. Sampling parameters that are off (top_k <= 0, no seed)
  are omitted, never sent as sentinels. ``server.address`` / ``server.port`` are set when the
  run names its server (SGLang collector runs).

Every attribute set is one of: always on the server metrics (``gen_ai.operation.name``,
``gen_ai.provider.name``, ``gen_ai.request.model``, ``gen_ai.response.model``), plus
``error.type`` on a request that ended in an error (finish reason ``abort``).

Exports go over OTLP/HTTP (protobuf) from the SDK's own threads. The exporters read the
standard ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, timeout, compression); an
explicit endpoint is a base URL to which ``/v1/metrics`` and ``/v1/traces`` are appended.
The attribute names are spelled out here, as the Python semconv package marks the GenAI
ones deprecated (they moved to the semantic-conventions-genai repository).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable

import pandas as pd
import pyarrow as pa
from opentelemetry.metrics import CallbackOptions, Histogram, MeterProvider, Observation
from opentelemetry.trace import SpanKind, TracerProvider

from dspark_obs.fanout import LaneStats
from dspark_obs.sinks._worker import FoldWorker
from dspark_obs.sinks.catalog import (
    DEFAULT_MAX_GAMMA,
    GENAI_DURATION_BUCKETS,
    GENAI_TOKEN_USAGE_BUCKETS,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT_BUCKETS,
    METRICS,
    Metric,
    token_buckets,
)
from dspark_obs.sinks.stats import Aggregator, Totals
from dspark_obs.validation import RecordError

__all__ = ["OtelSink", "otel_name", "otlp_configured"]

# GenAI semantic-convention names (semantic-conventions-genai), defined here on purpose.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"
METRIC_TTFT = "gen_ai.server.time_to_first_token"
METRIC_TPOT = "gen_ai.server.time_per_output_token"
METRIC_REQUEST_DURATION = "gen_ai.server.request.duration"
METRIC_ACCEPT_LENGTH = "dspark.request.accept_length"
# The GenAI request histograms, in the order OtelSink binds them: (name, unit, description
# as the semantic conventions word it, bucket boundaries).
GENAI_HISTOGRAMS = (
    (METRIC_TTFT, "s", "Time to generate first token for successful responses",
     GENAI_TTFT_BUCKETS),
    (METRIC_TPOT, "s", "Time per output token generated after the first token",
     GENAI_TPOT_BUCKETS),
    (METRIC_REQUEST_DURATION, "s", "Generative AI server request duration",
     GENAI_DURATION_BUCKETS),
    (METRIC_TOKEN_USAGE, "{token}", "Number of input and output tokens used",
     GENAI_TOKEN_USAGE_BUCKETS),
)  # fmt: skip
OPERATION = "chat"  # every engine workload is a list of chat messages
_PROVIDER = {"engine": "dspark-obs", "sglang": "sglang"}

_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


def otlp_configured(endpoint: str | None = None) -> bool:
    """OTLP is on when an endpoint is given or one of the standard endpoint variables is set."""
    return bool(endpoint) or any(os.environ.get(v) for v in _ENDPOINT_VARS)


def otel_name(metric: Metric) -> str:
    """``dspark_<name>_total`` -> ``dspark.<name>`` (OTel names carry no ``_total``)."""
    return "dspark." + metric.name.removeprefix("dspark_").removesuffix("_total")


def _unit(metric: Metric) -> str:
    """UCUM unit: seconds ``s``, token counts ``{token}`` (by unit or by a ``_tokens`` name)."""
    if metric.unit == "seconds" or metric.name.endswith("_seconds_total"):
        return "s"
    if metric.unit == "tokens" or metric.name.endswith("_tokens_total"):
        return "{token}"
    return "1"


def counter_attribute(label: str) -> str:
    """The OTel attribute of a catalog label: the model is ``gen_ai.request.model``."""
    return GEN_AI_REQUEST_MODEL if label == "model" else f"dspark.{label}"


def _finite(v: object) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


class OtelSink:
    """RecordSink for OpenTelemetry. Pass providers (tests, apps with their own SDK setup) or
    let it build OTLP/HTTP ones for ``endpoint``. With a shared ``aggregator`` (owned by a
    PrometheusSink) ``write`` does nothing: the Prometheus sink folds, this one reads."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        aggregator: Aggregator | None = None,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        export_interval_s: float = 5.0,
        service_name: str = "dspark-obs",
        max_gamma: int = DEFAULT_MAX_GAMMA,
        background: bool = True,
    ) -> None:
        self._owned: list = []
        if meter_provider is None or tracer_provider is None:
            built_meter, built_tracer = _otlp_providers(endpoint, export_interval_s, service_name)
            if meter_provider is None:
                meter_provider = built_meter
                self._owned.append(built_meter)
            if tracer_provider is None:
                tracer_provider = built_tracer
                self._owned.append(built_tracer)
        self.meter_provider, self.tracer_provider = meter_provider, tracer_provider
        self._shared = aggregator is not None
        self.aggregator = aggregator if aggregator is not None else Aggregator(max_gamma)
        self._worker = FoldWorker(self.aggregator.update, background, "dspark-obs-otel")
        meter = meter_provider.get_meter("dspark_obs")
        self.tracer = tracer_provider.get_tracer("dspark_obs")

        def histogram(name: str, unit: str, description: str, buckets: tuple) -> Histogram:
            return meter.create_histogram(
                name, unit, description, explicit_bucket_boundaries_advisory=buckets
            )

        self._ttft, self._tpot, self._duration, self._token_usage = (
            histogram(*spec) for spec in GENAI_HISTOGRAMS
        )
        self._accept_length = histogram(
            METRIC_ACCEPT_LENGTH,
            "{token}",
            "Per finished request: committed tokens / verify steps",
            token_buckets(max_gamma),
        )
        self._snapshot: tuple[float, Totals] | None = None
        for m in METRICS:
            if m.kind == "counter":
                meter.create_observable_counter(otel_name(m), [self._observer(m)], _unit(m), m.help)
        self.aggregator.on_finished.append(self._finished)

    # ------------------------------------------------------------------ RecordSink

    @property
    def errors(self) -> list[str]:
        return self._worker.errors

    @property
    def queue_stats(self) -> LaneStats | None:
        """The fold queue's counters; None when folding inline or reading a shared total."""
        return None if self._shared else self._worker.stats

    def write(self, table: str, batch: pa.Table) -> None:
        if not self._shared:
            self._worker.write(table, batch)

    def rejected(self, errors: list[RecordError]) -> None:
        if not self._shared:
            self.aggregator.reject(errors)

    def flush(self) -> None:
        """Fold pending batches, then push metrics and spans out (tests, shutdown)."""
        self._worker.flush()
        self.aggregator.finalize()
        for provider in (self.meter_provider, self.tracer_provider):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                flush()

    def close(self) -> None:
        """Fold what is pending, then export it once (shutdown flushes owned providers)."""
        self._worker.close()
        self.aggregator.finalize()
        for provider in (self.meter_provider, self.tracer_provider):
            if provider in self._owned:
                provider.shutdown()
            elif hasattr(provider, "force_flush"):
                provider.force_flush()

    # ------------------------------------------------------------------ internals

    def _totals(self) -> Totals:
        """One snapshot per export, shared by every observable counter's callback."""
        now = time.monotonic()
        if self._snapshot is None or now - self._snapshot[0] > 0.5:
            self._snapshot = (now, self.aggregator.snapshot())
        return self._snapshot[1]

    def _observer(self, metric: Metric):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            series = self._totals().counters[metric.name]
            return [
                Observation(
                    v, {counter_attribute(k): x for k, x in zip(metric.labels, key, strict=True)}
                )
                for key, v in series.items()
            ]

        return observe

    def _finished(self, done: pd.DataFrame) -> None:
        """Latency histograms and one span per finished request."""
        for r in done.to_dict("records"):
            model = str(r.get("model"))
            attrs = {
                GEN_AI_OPERATION_NAME: OPERATION,
                GEN_AI_PROVIDER_NAME: _PROVIDER.get(str(r.get("source")), str(r.get("source"))),
                GEN_AI_REQUEST_MODEL: model,
                GEN_AI_RESPONSE_MODEL: model,
                "dspark.mode": str(r.get("mode")),
                "dspark.workload": str(r.get("workload")),
            }
            if isinstance(r.get("server_address"), str):
                attrs[SERVER_ADDRESS] = r["server_address"]
                if _finite(r.get("server_port")):
                    attrs[SERVER_PORT] = int(r["server_port"])
            if r.get("finish_reason") == "abort":
                attrs[ERROR_TYPE] = "abort"
            arrival, first, finish = (r.get(k) for k in ("arrival_time", "first_token_time",
                                                            "finish_time"))  # fmt: skip
            completion = r.get("completion_tokens")
            ok = r.get("finish_reason") in ("stop", "length")
            if ok and _finite(arrival) and _finite(first):
                self._ttft.record(first - arrival, attrs)
            if ok and _finite(first) and _finite(finish) and _finite(completion) and completion > 1:
                self._tpot.record((finish - first) / (completion - 1), attrs)
            if _finite(arrival) and _finite(finish):
                self._duration.record(finish - arrival, attrs)
            for kind, col in (("input", "prompt_tokens"), ("output", "completion_tokens")):
                if _finite(r.get(col)):
                    self._token_usage.record(int(r[col]), {**attrs, GEN_AI_TOKEN_TYPE: kind})
            steps = r.get("steps")
            if _finite(steps) and steps > 0:
                self._accept_length.record(r["committed"] / steps, attrs)
            self._span(r, attrs)

    def _span(self, r: dict, attrs: dict) -> None:
        span_attrs = dict(attrs)
        span_attrs.update(
            {
                GEN_AI_RESPONSE_ID: f"{r['run_id']}/{r['rid']}",
                GEN_AI_RESPONSE_FINISH_REASONS: [str(r.get("finish_reason"))],
                "dspark.run_id": str(r["run_id"]),
            }
        )
        plain = {
            GEN_AI_REQUEST_TEMPERATURE: ("temperature", float),
            GEN_AI_REQUEST_TOP_P: ("top_p", float),
            GEN_AI_REQUEST_TOP_K: ("top_k", int),
            GEN_AI_REQUEST_SEED: ("seed", int),
            GEN_AI_REQUEST_MAX_TOKENS: ("max_new_tokens", int),
            GEN_AI_USAGE_INPUT_TOKENS: ("prompt_tokens", int),
            GEN_AI_USAGE_OUTPUT_TOKENS: ("completion_tokens", int),
        }
        off = {"top_k": lambda v: v <= 0, "seed": lambda v: v < 0}  # SGLang's "off" values
        for name, (col, cast) in plain.items():
            if _finite(r.get(col)) and not off.get(col, lambda v: False)(r[col]):
                span_attrs[name] = cast(r[col])
        steps = r.get("steps")
        if _finite(steps) and steps > 0:
            span_attrs["dspark.verify_steps"] = int(steps)
            span_attrs["dspark.accept_length"] = float(r["committed"] / steps)
            span_attrs["dspark.mean_window"] = float(r["verified"] / steps)
        if _finite(r.get("exact_steps")) and r["exact_steps"] > 0:
            span_attrs["dspark.ceiling"] = float(r["ceiling"] / r["exact_steps"])
            span_attrs["dspark.utilization"] = float(r["committed"] / r["ceiling"])
        if _finite(r.get("estimated_ceiling")):  # compact: the ceiling is hidden, estimated
            span_attrs["dspark.estimated_ceiling"] = float(r["estimated_ceiling"])
            for end in ("lo", "hi"):  # the estimator's bracket of that mean ceiling
                if _finite(r.get(f"estimated_ceiling_{end}")):
                    span_attrs[f"dspark.estimated_ceiling_{end}"] = float(
                        r[f"estimated_ceiling_{end}"]
                    )
            if _finite(steps) and steps > 0:
                accept = r["committed"] / steps
                span_attrs["dspark.estimated_utilization"] = float(accept / r["estimated_ceiling"])
                for end, other in (("lo", "hi"), ("hi", "lo")):  # committed / hi .. / lo
                    if (
                        _finite(r.get(f"estimated_ceiling_{other}"))
                        and r[f"estimated_ceiling_{other}"] > 0
                    ):
                        span_attrs[f"dspark.estimated_utilization_{end}"] = float(
                            min(1.0, accept / r[f"estimated_ceiling_{other}"])
                        )
        if _finite(r.get("conf_n")) and r["conf_n"] > 0:
            span_attrs["dspark.mean_confidence"] = float(r["conf_sum"] / r["conf_n"])
        if _finite(r.get("first_token_time")) and _finite(r.get("arrival_time")):
            span_attrs["dspark.time_to_first_token"] = float(
                r["first_token_time"] - r["arrival_time"]
            )
        start = r.get("arrival_time")
        end = r.get("finish_time")
        start_ns = int(start * 1e9) if _finite(start) else None
        span = self.tracer.start_span(
            f"{OPERATION} {attrs[GEN_AI_REQUEST_MODEL]}",
            kind=SpanKind.SERVER,
            attributes={k: v for k, v in span_attrs.items() if not _is_nan(v)},
            start_time=start_ns,
        )
        span.end(end_time=int(end * 1e9) if _finite(end) else None)


def _is_nan(v: object) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def _otlp_providers(endpoint: str | None, interval_s: float, service_name: str):
    """OTLP/HTTP meter and tracer providers (endpoint None: the OTEL_EXPORTER_OTLP_* vars)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    base = endpoint.rstrip("/") if endpoint else None
    resource = Resource.create({SERVICE_NAME: service_name})
    metrics = OTLPMetricExporter(endpoint=f"{base}/v1/metrics" if base else None)
    reader = PeriodicExportingMetricReader(metrics, export_interval_millis=interval_s * 1000)
    meter_provider = SdkMeterProvider(resource=resource, metric_readers=[reader])
    tracer_provider = SdkTracerProvider(resource=resource)
    spans = OTLPSpanExporter(endpoint=f"{base}/v1/traces" if base else None)
    tracer_provider.add_span_processor(BatchSpanProcessor(spans))
    return meter_provider, tracer_provider
