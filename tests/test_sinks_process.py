"""SinkProcess: the store, Prometheus and OTel in a child interpreter, fed over a pipe.

The child's /metrics is compared with the in-process PrometheusSink over the same engine
records, its store with a Store written in this process, its OTLP export is decoded by the
recording receiver of test_sinks_otel, and its failure modes (a stopped child, a killed
child, a killed parent, a store another writer holds, a port in use) are provoked for real
with signals, locks and sockets. (`dspark-obs run --metrics-port` scraped by a real
Prometheus, through this process, is in test_prometheus_e2e.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_sinks_otel import _decode, receiver  # noqa: F401 - the fixture
from test_sinks_prometheus import tiny_requests, trimming_config
from test_store import _table_snapshot

from dspark_obs.engine.session import run_with_companion
from dspark_obs.fanout import FanOut, MemorySink, SinkError
from dspark_obs.sinks import PrometheusSink
from dspark_obs.sinks.backpressure import expose_backpressure
from dspark_obs.sinks.process import SinkProcess
from dspark_obs.sinks.serve import TABLE_ORDER
from dspark_obs.store import Store
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
    child = SinkProcess(metrics_port=0)
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
    child = SinkProcess(otlp_endpoint=url, export_interval_s=60)
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
    child = SinkProcess(metrics_port=0)
    fan = FanOut([MemorySink(), child])
    try:
        assert expose_backpressure(fan, fan.sinks) == 1
        for table in TABLES:
            for batch in records.batches[table]:
                fan.emit(table, batch)
        child.flush()
        ours = fan.stats()[1]
        assert ours.name == "SinkProcess" and ours.capacity == child.queue_stats.capacity
        assert "max queue" in fan.summary().splitlines()[1]
        text = scrape(child.url)
        batches = {
            s.labels["sink"]: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "dspark_sink_batches_total"
        }
        # the counters travel with each batch and each flush
        assert batches["MemorySink"] == batches["SinkProcess"] == ours.done
    finally:
        fan.close()


def test_a_writer_waits_for_a_child_that_is_behind_and_loses_nothing(
    records: MemorySink,
) -> None:
    ticks = iter(range(1000))
    child = SinkProcess(metrics_port=0, capacity=1, clock=lambda: float(next(ticks)))
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
    child = SinkProcess(metrics_port=0)
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
    assert len(child.errors) == 1 and "sink process failed" in child.errors[0]
    stats = child.queue_stats
    assert stats.failed == len(records.batches["steps"])  # counted, not silently gone
    assert stats.enqueued == stats.done + stats.failed


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
            SinkProcess(metrics_port=port)


def test_a_child_that_does_not_answer_is_killed_at_close_and_reported(
    records: MemorySink,
) -> None:
    child = SinkProcess(metrics_port=0, reply_timeout_s=1.0)
    child.write("runs", records.batches["runs"][0])
    child.flush()
    os.kill(child._proc.pid, signal.SIGSTOP)  # hung: it will never answer the close
    child.close()  # returns (after the reply timeout) instead of hanging the run's end
    assert child._proc.returncode == -signal.SIGKILL
    assert len(child.errors) == 1 and "no answer to close within 1 s" in child.errors[0]


@pytest.mark.parametrize("port", [70000, -1])
def test_a_port_that_is_no_port_is_a_clear_error(port: int) -> None:
    with pytest.raises(ValueError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
        SinkProcess(metrics_port=port)


# ---------------------------------------------------------------------- the store in the child


def stored(root: Path) -> dict[str, pa.Table]:
    """Every table of a store in key order, read back through the store's own views."""
    st = Store(root)
    try:
        return _table_snapshot(st)
    finally:
        st.close()


def test_the_childs_store_holds_what_a_store_here_holds(records: MemorySink, tmp_path) -> None:
    here = Store(tmp_path / "here")
    feed(here, records)
    here.close()
    child = SinkProcess(tmp_path / "child", metrics_port=0)
    try:
        fan = FanOut([child])
        for table in TABLES:
            for batch in records.batches[table]:
                fan.emit(table, batch)
        child.flush()  # acknowledged: durable now, readable while the child still runs
        assert stored(tmp_path / "child") == stored(tmp_path / "here")
        scrape(child.url)  # a series is born at 0
        got = samples(scrape(child.url))  # and the same batches reached /metrics
        assert sum(v for k, v in got.items() if k[0] == "dspark_steps_total") == sum(
            b.num_rows for b in records.batches["steps"]
        )
    finally:
        child.close()
    assert child.errors == [] and child._proc.returncode == 0
    rows = stored(tmp_path / "child")
    assert rows["requests"].num_rows == sum(b.num_rows for b in records.batches["requests"])


def test_a_store_write_that_fails_in_the_child_stops_the_producer(
    records: MemorySink, tmp_path
) -> None:
    holder = Store(tmp_path)  # another writer of the same run holds its steps partition
    holder.write("steps", records.batches["steps"][0].slice(0, 1))
    child = SinkProcess(tmp_path)
    fan = FanOut([child])
    fan.emit("runs", records.batches["runs"][0])
    child.flush()  # acknowledged
    fan.emit("steps", records.batches["steps"][0])  # refused by the lock, in the child
    with pytest.raises(SinkError, match="store at .*locked|store at .*writer"):
        child.flush()
    with pytest.raises(SinkError):  # and every later write, as a FanOut's failed sink
        child.write("steps", records.batches["steps"][0])
    stats = child.queue_stats
    assert stats.failed >= 1 and stats.done == 1
    with pytest.raises(SinkError):
        child.close()
    holder.close()
    assert stored(tmp_path)["runs"].num_rows == 1  # what was acknowledged stays


def test_a_dead_child_that_held_the_store_stops_the_producer(records: MemorySink, tmp_path):
    child = SinkProcess(tmp_path)
    child.write("runs", records.batches["runs"][0])
    child.flush()
    child._proc.kill()
    child._proc.wait()
    with pytest.raises(SinkError, match="sink process failed"):
        for batch in records.batches["steps"]:  # the first write finds the pipe gone
            child.write("steps", batch)
        child.flush()
    with pytest.raises(SinkError):
        child.close()
    assert stored(tmp_path)["runs"].num_rows == 1


PRODUCER = """
import os, signal, sys
import pyarrow as pa
from dspark_obs.sinks.process import SinkProcess
tables = [(t, pa.ipc.open_file(f).read_all()) for t, f in zip(sys.argv[2::2], sys.argv[3::2])]
child = SinkProcess(sys.argv[1])
for i, (t, batch) in enumerate(tables):
    child.write(t, batch)
    if i == 0:
        child.flush()
print(child._proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no flush, no close: the last writes only sent
"""


def alive(pid: int) -> bool:
    """Running (a zombie no init reaped, as in a container, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_killed_parent_loses_nothing_it_sent(records: MemorySink, tmp_path) -> None:
    args = []
    for n, table in enumerate(TABLES):
        path = tmp_path / f"{n}.arrow"
        batch = records.table(table)
        with pa.ipc.new_file(path, batch.schema) as f:
            f.write_table(batch)
        args += [table, str(path)]
    out = subprocess.run(
        [sys.executable, "-c", PRODUCER, str(tmp_path / "store"), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr
    child = int(out.stdout.split()[0])
    for _ in range(600):  # the orphan sees the pipe close, stores what came, exits
        if not alive(child):
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("the sink process outlived its parent by a minute")
    rows = stored(tmp_path / "store")
    for table in TABLES:
        assert rows[table].num_rows == records.table(table).num_rows, table


def test_a_store_that_cannot_be_opened_is_a_store_error(tmp_path) -> None:
    from dspark_obs.store import StoreError

    with pytest.raises(StoreError, match="glob character"):
        SinkProcess(tmp_path / "a*b")
