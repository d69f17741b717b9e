"""The fan-out with a thread per sink: order, backpressure counted (never a drop), failures
raised to the producer, close drains and joins, and a kill -9 loses nothing acknowledged.

Every test counts; none times. Waiting for a condition uses events, or a polling loop whose
only time limit turns a hang into a failure.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import test_store_source as src  # noqa: E402
from test_store import BATCH_ROWS, assert_exact, batch_counts, counts  # noqa: E402

from dspark_obs.fanout import FanOut, Lane, MemorySink, SinkError  # noqa: E402
from dspark_obs.sinks._worker import FoldWorker  # noqa: E402
from dspark_obs.store import Store  # noqa: E402

WRITER = str(Path(__file__).parent / "fanout_writer.py")


def _steps(k: int, n: int = 3) -> pa.Table:
    return src.steps_batch("run-f", k)[:n]


def _wait_for(cond: Callable[[], bool], limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.001)


class GatedSink(MemorySink):
    """Blocks inside write until released; tells when a write has begun."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.closed = False

    def write(self, table: str, batch: pa.Table) -> None:
        self.entered.set()
        assert self.gate.wait(60)
        super().write(table, batch)

    def close(self) -> None:
        self.closed = True


class ThreadClock:
    """A clock per calling thread that ticks by one per call: durations are exact counts."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: dict[str, int] = {}

    def __call__(self) -> float:
        n = getattr(self._local, "n", 0) + 1
        self._local.n = n
        name = threading.current_thread().name
        self.calls[name] = self.calls.get(name, 0) + 1
        return float(n)


def _forward_cts(sink: MemorySink) -> list[int]:
    return [f for b in sink.batches.get("steps", []) for f in b.column("forward_ct").to_pylist()]


def test_every_sink_gets_every_batch_in_order_on_its_own_thread() -> None:
    threads: dict[str, set[str]] = {"a": set(), "b": set()}

    class Recording(MemorySink):
        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

        def write(self, table: str, batch: pa.Table) -> None:
            threads[self.key].add(threading.current_thread().name)
            super().write(table, batch)

    a, b = Recording("a"), Recording("b")
    fan = FanOut([a, b], threaded=True, queue_batches=3)
    for k in range(20):
        fan.emit("steps", _steps(k))
    stats = fan.drain()
    want = [f for k in range(20) for f in _steps(k).column("forward_ct").to_pylist()]
    assert _forward_cts(a) == want and _forward_cts(b) == want
    main = threading.current_thread().name
    assert len(threads["a"]) == 1 and len(threads["b"]) == 1
    assert threads["a"] != threads["b"] and main not in threads["a"] | threads["b"]
    assert [s.name for s in stats] == ["Recording", "Recording-2"]
    for s in stats:
        assert (s.enqueued, s.done, s.rows, s.failed, s.depth) == (20, 20, 60, 0, 0)
        assert s.max_depth <= 3
    fan.close()


def test_a_full_queue_blocks_the_producer_counted_and_timed_and_nothing_is_dropped() -> None:
    sink = GatedSink()
    clock = ThreadClock()
    fan = FanOut([sink], threaded=True, queue_batches=2, clock=clock)
    fan.emit("steps", _steps(0))
    assert sink.entered.wait(60)  # the worker holds batch 0 inside write
    fan.emit("steps", _steps(1))
    fan.emit("steps", _steps(2))  # the queue is full now: two waiting
    assert fan.stats()[0].blocked == 0
    assert fan.stats()[0].max_depth == 2
    producer = threading.Thread(target=fan.emit, args=("steps", _steps(3)), name="producer")
    producer.start()
    _wait_for(lambda: clock.calls.get("producer", 0) >= 1)  # it started waiting
    assert producer.is_alive()
    sink.gate.set()
    producer.join(60)
    stats = fan.drain()[0]
    assert (stats.enqueued, stats.done, stats.blocked) == (4, 4, 1)
    assert stats.blocked_seconds == 1.0  # two ticks of the producer's own clock
    assert stats.max_depth == 2
    assert _forward_cts(sink) == [f for k in range(4) for f in range(6 * k, 6 * k + 3)]
    assert "producer blocked 1x" in fan.summary()
    fan.close()
    assert sink.closed


def test_a_failing_sink_is_raised_to_the_producer_and_the_others_keep_everything() -> None:
    class Failing(GatedSink):
        n = 0

        def write(self, table: str, batch: pa.Table) -> None:
            self.n += 1
            if self.n == 2:
                raise OSError("disk full")
            super().write(table, batch)

    bad, good = Failing(), GatedSink()
    good.gate.set()
    fan = FanOut([bad, good], threaded=True, queue_batches=4)
    for k in range(3):  # held at the gate: the failure cannot happen before all are queued
        fan.emit("steps", _steps(k))
    bad.gate.set()
    with pytest.raises(SinkError, match=r"sink Failing failed: OSError: disk full"):
        fan.drain()
    with pytest.raises(SinkError, match=r"2 batch\(es\) not written to it; 1 were"):
        fan.emit("steps", _steps(3))
    assert _forward_cts(good) == [f for k in range(3) for f in range(6 * k, 6 * k + 3)]
    assert _forward_cts(bad) == [0, 1, 2]
    stats = fan.stats()
    assert (stats[0].done, stats[0].failed) == (1, 2)
    with pytest.raises(SinkError):
        fan.close()
    assert bad.closed and good.closed


def test_rejected_rows_reach_counting_sinks_in_order_and_never_as_writes() -> None:
    events: list[str] = []

    class Counting(MemorySink):
        def write(self, table: str, batch: pa.Table) -> None:
            events.append(f"write {batch.num_rows}")

        def rejected(self, errors: list) -> None:
            events.append(f"rejected {len(errors)}")

    fan = FanOut([Counting()], threaded=True)
    rows = _steps(0).to_pylist()
    rows[1]["forward_ct"] = -5
    fan.emit("steps", rows)
    fan.emit("steps", _steps(1))
    fan.drain()
    assert events == ["rejected 1", "write 2", "write 3"]
    assert len(fan.errors) == 1
    fan.close()


def test_close_drains_joins_then_closes_every_sink() -> None:
    sink = GatedSink()
    fan = FanOut([sink], threaded=True, queue_batches=8)
    for k in range(5):
        fan.emit("steps", _steps(k))
    closer = threading.Thread(target=fan.close)
    closer.start()
    assert not sink.closed  # held: batches still queued behind the gate
    sink.gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert sink.closed and len(sink.batches["steps"]) == 5
    assert not any(t.name.startswith("dspark-obs-GatedSink") for t in threading.enumerate())
    fan.close()  # idempotent
    with pytest.raises(SinkError, match="closed"):
        fan.emit("steps", _steps(9))


def test_join_stops_the_threads_and_leaves_the_sinks_open_for_their_owner() -> None:
    sink = GatedSink()
    sink.gate.set()
    fan = FanOut([sink], threaded=True)
    for k in range(3):
        fan.emit("steps", _steps(k))
    stats = fan.join()
    assert stats[0].done == 3 and len(sink.batches["steps"]) == 3 and not sink.closed
    assert not any(t.name.startswith("dspark-obs-GatedSink") for t in threading.enumerate())
    with pytest.raises(SinkError, match="closed"):
        fan.emit("steps", _steps(3))


def test_unthreaded_fanout_writes_inline_and_counts_each_sinks_writes() -> None:
    ticks = iter(range(100))
    sink, other = MemorySink(), MemorySink()
    fan = FanOut([sink, other], clock=lambda: float(next(ticks)))  # one tick per call
    fan.emit("steps", _steps(0))
    assert _forward_cts(sink) == [0, 1, 2]  # written before emit returned
    fan.emit("steps", _steps(1))
    stats = fan.drain()
    assert [(s.name, s.enqueued, s.done, s.rows, s.capacity, s.blocked) for s in stats] == [
        ("MemorySink", 2, 2, 6, 0, 0),
        ("MemorySink-2", 2, 2, 6, 0, 0),
    ]
    assert [s.work_seconds for s in stats] == [2.0, 2.0]  # each write took one tick
    assert "written on the producer's thread" in fan.summary()
    assert fan.join() == stats and len(other.batches["steps"]) == 2 and not fan.errors
    with pytest.raises(SinkError, match="joined or closed"):
        fan.emit("steps", _steps(2))


def test_an_inline_sink_that_fails_raises_its_error_and_is_counted() -> None:
    class Broken(MemorySink):
        def write(self, table: str, batch: pa.Table) -> None:
            raise OSError("disk full")

    after = MemorySink()
    fan = FanOut([Broken(), after])
    with pytest.raises(OSError, match="disk full"):
        fan.emit("steps", _steps(0))
    broken, later = fan.stats()
    assert (broken.enqueued, broken.done, broken.failed) == (1, 0, 1)
    assert later.enqueued == 0 and not after.batches  # a failed emit stops at the failing sink
    assert "1 failed" in fan.summary()


def test_fold_worker_queue_is_bounded_and_its_backpressure_counted() -> None:
    gate, entered, folded = threading.Event(), threading.Event(), []

    def fold(table: str, batch: pa.Table) -> None:
        entered.set()
        assert gate.wait(60)
        folded.append(batch.num_rows)

    clock = ThreadClock()
    worker = FoldWorker(fold, background=True, name="fold", capacity=1, clock=clock)
    worker.write("steps", _steps(0))
    assert entered.wait(60)
    worker.write("steps", _steps(1))
    writer = threading.Thread(target=worker.write, args=("steps", _steps(2)), name="w")
    writer.start()
    _wait_for(lambda: clock.calls.get("w", 0) >= 1)
    gate.set()
    writer.join(60)
    worker.flush()
    stats = worker.stats
    assert stats is not None
    assert (stats.enqueued, stats.done, stats.blocked, stats.max_depth) == (3, 3, 1, 1)
    assert folded == [3, 3, 3]
    worker.close()
    assert FoldWorker(fold, background=False, name="inline").stats is None


def test_lane_refuses_a_zero_capacity() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Lane("x", lambda *a: None, capacity=0)


def test_engine_records_through_a_threaded_fanout_equal_the_inline_ones() -> None:
    from test_step_records import GAMMA, _models, _requests, _trimming_table

    from dspark_obs.engine.loop import Engine
    from dspark_obs.engine.types import EngineConfig

    target, drafter = _models()
    cfg = EngineConfig(
        mode="compact", gamma=GAMMA, max_batch=3, cost_table=_trimming_table(), flush_every=4
    )
    out = {}
    for threaded in (False, True):
        sink = MemorySink()
        fan = FanOut([sink], threaded=threaded, queue_batches=2)
        Engine(target, drafter, cfg).run(_requests(5), fan.emit, "run")
        fan.close()
        out[threaded] = {t: sink.table(t).drop_columns(["ts"]) for t in ("steps", "req_steps")}
    for t in ("steps", "req_steps"):
        a = out[True][t].drop_columns(["step_cpu_ms"]) if t == "steps" else out[True][t]
        b = out[False][t].drop_columns(["step_cpu_ms"]) if t == "steps" else out[False][t]
        assert a.equals(b), t


# --------------------------------------------------------------------------- kill -9


@pytest.mark.parametrize("trial", range(6))
def test_kill_9_through_the_threaded_fanout_loses_nothing_acknowledged(
    tmp_path: Path, trial: int
) -> None:
    root, run, n = tmp_path / "store", "run-a", 30
    acks = tmp_path / "acks.txt"
    rng = random.Random(trial)
    with acks.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, WRITER, str(root), run, str(n), "--drain-every", str(2 + trial % 3)],
            stdout=out,
        )
        _wait_for(lambda: "READY" in acks.read_text() or proc.poll() is not None)
        target = rng.randrange(1, 60)
        _wait_for(lambda: acks.read_text().count("ACK") >= target or proc.poll() is not None)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    text = acks.read_text()
    assert "DONE" not in text, "the writer should have been killed mid-run"
    acked = {(ln.split()[1], int(ln.split()[2])) for ln in text.splitlines() if ln[:3] == "ACK"}
    assert acked
    store = Store(root)
    present = batch_counts(store)
    for table, k in acked:
        assert present.get((table, k)) == BATCH_ROWS[table], (table, k)
    for (table, k), rows in present.items():
        assert rows == BATCH_ROWS[table], f"{table} batch {k} partly stored ({rows} rows)"
    for table, (rows, keys) in counts(store).items():
        assert rows == keys, f"{table}: duplicates after a crash"
    # Restart: the whole source again through a threaded fan-out; exact, nothing twice.
    fan = FanOut([Store(root)], threaded=True, queue_batches=2)
    for table, _, batch in src.source(run, n):
        fan.emit(table, batch)
    fan.close()
    assert_exact(Store(root), n)
