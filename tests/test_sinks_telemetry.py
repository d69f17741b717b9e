"""TelemetryProcess: Prometheus and OTel in a child interpreter, fed over a pipe.

The child's /metrics is compared with the in-process PrometheusSink over the same engine
records, its OTLP export is decoded by the recording receiver of test_sinks_otel, and its
failure modes (a stopped child, a killed child, a port in use) are provoked for real with
signals and sockets. (`dspark-obs run --metrics-port` scraped by a real Prometheus, through
this process, is in test_prometheus_e2e.)
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_sinks_otel import _decode, receiver  # noqa: F401 - the fixture
from test_sinks_prometheus import tiny_requests, trimming_config

from dspark_obs.engine.session import run_with_companion
from dspark_obs.fanout import FanOut, MemorySink
from dspark_obs.sinks import PrometheusSink
from dspark_obs.sinks.backpressure import expose_backpressure
from dspark_obs.sinks.serve import TABLE_ORDER
from dspark_obs.sinks.telemetry import TelemetryProcess
from dspark_obs.testing.tiny_models import tiny_models

TABLES = TABLE_ORDER  # the runs row first: labels need it


@pytest.fixture(scope="module")
def records() -> MemorySink:
    mem = MemorySink()
    run_with_companion(
        tiny_models(), tiny_requests(6), trimming_config(), [mem], "p", companion=True,
        workload="mixed",
    )  # fmt: skip
    return mem


def feed(sink, mem: MemorySink) -> None:
    for table in TABLES:
        for batch in mem.batches[table]:
            sink.write(table, batch)
    sink.flush()


def samples(text: str) -> dict[tuple, float]:
    """Every dspark_ sample but the sink queues' own (those differ by layout)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("dspark_") and not s.name.startswith("dspark_sink_")
    }


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def test_the_childs_metrics_are_the_in_process_sinks(records: MemorySink) -> None:
    here = PrometheusSink(background=False)
    feed(here, records)
    child = TelemetryProcess(0)
    try:
        assert child.url is not None and child.url.startswith("http://127.0.0.1:")
        feed(child, records)
        texts = [scrape(child.url) for _ in range(2)]  # born at 0, then the values
        expected = [generate_latest(here.registry).decode() for _ in range(2)]
        assert samples(texts[0]) == samples(expected[0])
        got, want = samples(texts[1]), samples(expected[1])
        assert got == want
        estimated = [k for k in got if k[0] == "dspark_estimator_blocks_total"]
        assert estimated and all(got[k] > 0 for k in estimated)  # the estimator ran there
        assert child.errors == []
        stats = child.queue_stats
        sent = sum(len(records.batches[t]) for t in TABLES)
        assert (stats.enqueued, stats.done, stats.failed, stats.depth) == (sent, sent, 0, 0)
    finally:
        child.close()
    assert child._proc.returncode == 0


def test_the_child_exports_otlp_spans_and_metrics(records: MemorySink, receiver) -> None:  # noqa: F811
    url, received = receiver
    child = TelemetryProcess(None, url, export_interval_s=60)
    assert child.url is None  # no Prometheus asked for
    feed(child, records)
    child.close()
    metrics, spans = _decode(received)
    requests = sum(b.num_rows for b in records.batches["requests"])
    assert len(spans) == requests
    ttft = metrics["gen_ai.server.time_to_first_token"][-1].histogram.data_points
    assert sum(p.count for p in ttft) == requests


def test_a_fanout_reports_the_pipeline_and_the_child_serves_the_fanouts_backpressure(
    records: MemorySink,
) -> None:
    child = TelemetryProcess(0)
    fan = FanOut([MemorySink(), child])
    try:
        assert expose_backpressure(fan, fan.sinks) == 1
        for table in TABLES:
            for batch in records.batches[table]:
                fan.emit(table, batch)
        child.flush()
        ours = fan.stats()[1]
        assert ours.name == "TelemetryProcess" and ours.capacity == child.queue_stats.capacity
        assert "max queue" in fan.summary().splitlines()[1]
        text = scrape(child.url)
        batches = {
            s.labels["sink"]: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "dspark_sink_batches_total"
        }
        # the counters travel with each batch and each flush
        assert batches["MemorySink"] == batches["TelemetryProcess"] == ours.done
    finally:
        fan.close()


def test_a_writer_waits_for_a_child_that_is_behind_and_loses_nothing(
    records: MemorySink,
) -> None:
    ticks = iter(range(1000))
    child = TelemetryProcess(0, capacity=1, clock=lambda: float(next(ticks)))
    batch = records.batches["steps"][0]
    child.write("runs", records.batches["runs"][0])
    child.flush()
    os.kill(child._proc.pid, signal.SIGSTOP)  # the child folds nothing now
    try:
        child.write("steps", batch)  # the one batch in flight
        second = threading.Thread(target=child.write, args=("steps", batch))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive()  # waiting for the stopped child, not dropping the batch
    finally:
        os.kill(child._proc.pid, signal.SIGCONT)
    second.join(timeout=60)
    assert not second.is_alive()
    child.flush()
    stats = child.queue_stats
    assert (stats.blocked, stats.blocked_seconds) == (1, 1.0)  # one wait, one clock tick
    assert (stats.enqueued, stats.done, stats.failed) == (3, 3, 0)
    steps = samples(scrape(child.url))
    steps = samples(scrape(child.url))
    total = sum(v for k, v in steps.items() if k[0] == "dspark_steps_total")
    assert total == 2 * batch.num_rows
    child.close()


def test_a_dead_child_is_reported_and_the_run_goes_on(records: MemorySink) -> None:
    child = TelemetryProcess(0)
    mem = MemorySink()
    fan = FanOut([child, mem])
    fan.emit("runs", records.batches["runs"][0])
    child.flush()
    child._proc.kill()
    child._proc.wait()
    for batch in records.batches["steps"]:
        fan.emit("steps", batch)  # never raises: telemetry does not stop a run
    fan.close()
    assert sum(b.num_rows for b in mem.batches["steps"]) == sum(
        b.num_rows for b in records.batches["steps"]
    )
    assert len(child.errors) == 1 and "telemetry process failed" in child.errors[0]
    stats = child.queue_stats
    assert stats.failed == len(records.batches["steps"])  # counted, not silently gone
    assert stats.enqueued == stats.done + stats.failed


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
            TelemetryProcess(port)


def test_a_child_that_does_not_answer_is_killed_at_close_and_reported(
    records: MemorySink,
) -> None:
    child = TelemetryProcess(0, reply_timeout_s=1.0)
    child.write("runs", records.batches["runs"][0])
    child.flush()
    os.kill(child._proc.pid, signal.SIGSTOP)  # hung: it will never answer the close
    child.close()  # returns (after the reply timeout) instead of hanging the run's end
    assert child._proc.returncode == -signal.SIGKILL
    assert len(child.errors) == 1 and "no answer to close within 1 s" in child.errors[0]


@pytest.mark.parametrize("port", [70000, -1])
def test_a_port_that_is_no_port_is_a_clear_error(port: int) -> None:
    with pytest.raises(ValueError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
        TelemetryProcess(port)
