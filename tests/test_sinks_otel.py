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
from test_sinks_prometheus import tiny_requests, trimming_config

from dspark_obs.engine.session import run_with_companion
from dspark_obs.fanout import MemorySink
from dspark_obs.sinks import OtelSink
from dspark_obs.sinks.catalog import (
    GENAI_DURATION_BUCKETS,
    GENAI_TOKEN_USAGE_BUCKETS,
    GENAI_TPOT_BUCKETS,
    GENAI_TTFT_BUCKETS,
)
from dspark_obs.sinks.otel import otlp_configured
from dspark_obs.testing.tiny_models import tiny_models


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

    server_attrs = {"gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                    "gen_ai.response.model", "dspark.mode", "dspark.workload"}  # fmt: skip
    for name in ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                 "gen_ai.server.request.duration"):  # fmt: skip
        for p in got[name].data.data_points:
            assert set(p.attributes) == server_attrs, (name, p.attributes)
            assert p.attributes["gen_ai.provider.name"] == "dspark-obs"

    usage = got["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    assert tuple(usage.data.data_points[0].explicit_bounds) == GENAI_TOKEN_USAGE_BUCKETS
    by_type = {}
    for p in usage.data.data_points:
        assert set(p.attributes) == server_attrs | {"gen_ai.token.type"}
        kind = p.attributes["gen_ai.token.type"]
        by_type[kind] = by_type.get(kind, 0) + p.sum
        assert p.count == len(req[req.workload == p.attributes["dspark.workload"]])
    assert by_type == {"input": req.prompt_tokens.sum(), "output": req.completion_tokens.sum()}

    committed = got["dspark.committed_tokens"]
    assert sum(p.value for p in committed.data.data_points) == rs.acc_len.sum()
    assert committed.data.is_monotonic
    assert committed.unit == "{token}"
    assert got["dspark.step_measured_seconds"].unit == "s"
    accepted = got["dspark.position_accepted"]
    assert {p.attributes["dspark.position"] for p in accepted.data.data_points} <= set("12345")
    for m in got.values():  # one model attribute everywhere: gen_ai.request.model
        for p in getattr(m.data, "data_points", []):
            assert "dspark.model" not in p.attributes, m.name
    assert {p.attributes["gen_ai.request.model"] for p in committed.data.data_points} == {"tiny"}

    finished = spans.get_finished_spans()
    assert len(finished) == len(req)
    by_rid = {s.attributes["gen_ai.response.id"]: s for s in finished}
    assert set(by_rid) == {f"o/{rid}" for rid in req.rid}  # <run_id>/<rid>
    for r in req.itertuples():
        a = by_rid[f"o/{r.rid}"].attributes
        assert "gen_ai.request.top_k" not in a  # top_k off: omitted, never -1
        assert "server.address" not in a  # the embedded engine has no server
        steps = rs[rs.rid == r.rid]
        assert by_rid[f"o/{r.rid}"].name == "chat tiny"
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
        assert by_rid[f"o/{r.rid}"].start_time == int(r.arrival_time * 1e9)
        assert a["dspark.estimated_ceiling_lo"] <= a["dspark.estimated_ceiling"]
        assert a["dspark.estimated_ceiling"] <= a["dspark.estimated_ceiling_hi"]
        lo, hi = a["dspark.estimated_utilization_lo"], a["dspark.estimated_utilization_hi"]
        assert lo <= a["dspark.estimated_utilization"] <= hi <= 1.0


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
    run_id, _, rid = a["gen_ai.response.id"].partition("/")
    assert run_id == "o"
    row = req.set_index("rid").loc[rid]
    assert a["gen_ai.usage.output_tokens"] == row.completion_tokens
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "dspark-obs"
    assert a["dspark.verify_steps"] > 0


def test_companion_spans_have_their_own_ids_and_collected_runs_name_their_server() -> None:
    """A compact run and its companion serve the same rids: response ids stay distinct. A run
    collected from an SGLang server carries server.address / server.port; top_k > 0 is sent."""
    from test_sinks_prometheus import _req_row, _runs_row

    from dspark_obs.fanout import FanOut

    spans = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    sink = OtelSink(meter_provider=MeterProvider(metric_readers=[reader]), tracer_provider=tracer,
                    background=False)  # fmt: skip
    fan = FanOut([sink])
    sglang = {**_runs_row("s", "cap-accept"), "source": "sglang",
              "config": '{"url": "http://10.0.0.7:30001"}'}  # fmt: skip
    fan.emit("runs", [_runs_row("u", "compact"), sglang])
    fan.emit(
        "req_steps",
        [
            _req_row(verify_len=2, correct_drafts=1),
            _req_row(run_id="s", verify_len=2, correct_drafts=1, cap_trim=1),
        ],
    )
    req = {"rid": "a", "workload": "math", "prompt_tokens": 5, "completion_tokens": 2,
           "finish_reason": "length", "arrival_time": 1.0, "first_token_time": 2.0,
           "finish_time": 3.0, "temperature": 0.0, "max_new_tokens": 2}  # fmt: skip
    fan.emit("requests", [{**req, "run_id": "u", "top_k": -1},
                          {**req, "run_id": "s", "top_k": 20}])  # fmt: skip
    sink.flush()
    got = {s.attributes["gen_ai.response.id"]: s.attributes for s in spans.get_finished_spans()}
    assert set(got) == {"u/a", "s/a"}
    assert "gen_ai.request.top_k" not in got["u/a"] and got["s/a"]["gen_ai.request.top_k"] == 20
    assert got["s/a"]["server.address"] == "10.0.0.7" and got["s/a"]["server.port"] == 30001
    assert "server.address" not in got["u/a"] and "server.port" not in got["u/a"]
    assert (
        got["s/a"]["dspark.utilization"] == pytest.approx(2 / 3)
        and "dspark.utilization" not in got["u/a"]
    )
    metrics = _metrics(reader)
    points = metrics["gen_ai.server.request.duration"].data.data_points
    assert {p.attributes.get("server.port") for p in points} == {None, 30001}
