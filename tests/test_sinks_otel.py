"""OtelSink: GenAI histograms, counters and one span per request, in memory and over OTLP/HTTP.

The OTLP test runs a real HTTP receiver on loopback that decodes the exporter's protobuf
bodies with opentelemetry-proto, as a collector would.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_sinks_prometheus import tiny_models, tiny_requests, trimming_config

from dspark_obs.engine.session import run_with_companion
from dspark_obs.fanout import MemorySink
from dspark_obs.sinks import OtelSink
from dspark_obs.sinks.catalog import GENAI_DURATION_BUCKETS, GENAI_TPOT_BUCKETS, GENAI_TTFT_BUCKETS
from dspark_obs.sinks.otel import otlp_configured


@pytest.fixture(scope="module")
def records() -> MemorySink:
    mem = MemorySink()
    run_with_companion(
        tiny_models(), tiny_requests(6), trimming_config(), [mem], "o", companion=False,
        workload="mixed",
    )  # fmt: skip
    return mem


def feed(sink: OtelSink, mem: MemorySink) -> None:
    for table in ("runs", "steps", "req_steps", "requests"):
        for batch in mem.batches[table]:
            sink.write(table, batch)
    sink.flush()


def _metrics(reader: InMemoryMetricReader) -> dict:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = m
    return out


def test_in_memory_histograms_counters_and_spans(records: MemorySink) -> None:
    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    sink = OtelSink(meter_provider=MeterProvider(metric_readers=[reader]), tracer_provider=tracer)
    feed(sink, records)
    assert sink.errors == []
    req = records.table("requests").to_pandas()
    rs = records.table("req_steps").to_pandas()
    got = _metrics(reader)

    ttft = got["gen_ai.server.time_to_first_token"]
    assert ttft.unit == "s"
    point = ttft.data.data_points[0]
    assert tuple(point.explicit_bounds) == GENAI_TTFT_BUCKETS
    assert sum(p.count for p in ttft.data.data_points) == len(req)
    total = sum(p.sum for p in ttft.data.data_points)
    assert total == pytest.approx((req.first_token_time - req.arrival_time).sum())
    assert point.attributes["gen_ai.request.model"] == "tiny"
    tpot = got["gen_ai.server.time_per_output_token"]
    assert tuple(tpot.data.data_points[0].explicit_bounds) == GENAI_TPOT_BUCKETS
    assert sum(p.count for p in tpot.data.data_points) == (req.completion_tokens > 1).sum()
    dur = got["gen_ai.server.request.duration"]
    assert tuple(dur.data.data_points[0].explicit_bounds) == GENAI_DURATION_BUCKETS

    committed = got["dspark.committed_tokens"]
    assert sum(p.value for p in committed.data.data_points) == rs.acc_len.sum()
    assert committed.data.is_monotonic
    accepted = got["dspark.position_accepted"]
    assert {p.attributes["dspark.position"] for p in accepted.data.data_points} <= set("12345")

    finished = spans.get_finished_spans()
    assert len(finished) == len(req)
    by_rid = {s.attributes["gen_ai.response.id"]: s for s in finished}
    for r in req.itertuples():
        a = by_rid[r.rid].attributes
        steps = rs[rs.rid == r.rid]
        assert by_rid[r.rid].name == "chat tiny"
        assert a["gen_ai.usage.input_tokens"] == r.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == r.completion_tokens
        assert a["gen_ai.response.finish_reasons"] == (r.finish_reason,)
        assert a["gen_ai.request.temperature"] == pytest.approx(1.0)
        assert a["dspark.verify_steps"] == len(steps)
        assert a["dspark.accept_length"] == pytest.approx(steps.acc_len.mean())
        assert a["dspark.mean_window"] == pytest.approx(steps.verify_len.mean())
        assert a["dspark.estimated_ceiling"] >= a["dspark.accept_length"] - 1e-9
        assert 0.0 < a["dspark.mean_confidence"] < 1.0
        assert "gen_ai.usage.prompt_tokens" not in a  # the deprecated names are not used
        assert by_rid[r.rid].start_time == int(r.arrival_time * 1e9)


class _Receiver(BaseHTTPRequestHandler):
    received: dict[str, list[bytes]] = {}

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.setdefault(self.path, []).append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver():
    _Receiver.received = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.received
    server.shutdown()
    server.server_close()


def _decode(received: dict) -> tuple[dict, list]:
    metrics, spans = {}, []
    for body in received.get("/v1/metrics", []):
        req = ExportMetricsServiceRequest.FromString(body)
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    metrics.setdefault(m.name, []).append(m)
    for body in received.get("/v1/traces", []):
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    return metrics, spans


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.mark.parametrize("via_env", [False, True])
def test_otlp_http_export_is_decodable_protobuf(
    records: MemorySink, receiver, monkeypatch, via_env: bool
) -> None:
    url, received = receiver
    if via_env:  # the standard variable alone turns OTLP on and points it
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
        assert otlp_configured(None)
        sink = OtelSink(None, export_interval_s=60)
    else:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        assert not otlp_configured(None)
        sink = OtelSink(url, export_interval_s=60)
    feed(sink, records)
    sink.close()
    metrics, spans = _decode(received)
    req = records.table("requests").to_pandas()
    ttft = metrics["gen_ai.server.time_to_first_token"][-1]
    assert ttft.unit == "s"
    points = ttft.histogram.data_points
    assert list(points[0].explicit_bounds) == list(GENAI_TTFT_BUCKETS)
    assert sum(p.count for p in points) == len(req)
    out_tokens = metrics["dspark.completion_tokens"][-1].sum.data_points
    assert sum(p.as_double for p in out_tokens) == req.completion_tokens.sum()
    assert len(spans) == len(req)
    a = _attrs(spans[0].attributes)
    row = req.set_index("rid").loc[a["gen_ai.response.id"]]
    assert a["gen_ai.usage.output_tokens"] == row.completion_tokens
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "dspark-obs"
    assert a["dspark.verify_steps"] > 0
