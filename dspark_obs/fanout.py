"""The one producer interface: producers hand validated Arrow batches to a ``RecordSink``.

Producers (the embedded engine, the SGLang collector) never import a concrete sink; sinks
(the store, Prometheus, OpenTelemetry) never import a producer. ``FanOut`` joins them.

``FanOut(sinks)`` writes every sink on the thread that calls ``emit``: the engine calls it
from its record worker, already off the decode thread behind a bounded queue, so no sink
needs a thread of its own there (on the H200 a thread per sink cost 2-6.5% of throughput,
the same sinks on the record worker's thread 0.0-0.7%: README, "Records and sinks off the
decode thread"). ``FanOut(sinks, threaded=True)`` gives every sink its own thread fed by a
bounded queue (:class:`Lane`), for a producer that must not wait for a sink's write (a
store's fsync, an exporter) on its own thread. A full queue makes the producer wait: that
backpressure is counted and timed per sink (:class:`LaneStats`, :meth:`FanOut.summary`),
never answered by dropping a batch. Inline, each sink's batches and write time are counted
the same way (its queue capacity reads 0). What a sink acknowledged is what its ``write``
returned from; :meth:`FanOut.drain` returns once every batch emitted so far was, so a
caller that needs "durable now" (a crash must lose nothing acknowledged) drains first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import pyarrow as pa

from dspark_obs.validation import RecordError, ValidatedBatch, check

DEFAULT_QUEUE_BATCHES = 16
"""Batches a sink's queue holds before the producer waits (the engine hands over one batch
per table every ``flush_every`` steps or every second, so this is seconds of slack)."""

Clock = Callable[[], float]


class RecordSink(Protocol):
    """Anything that consumes record batches of the four tables in dspark_obs.schema."""

    def write(self, table: str, batch: pa.Table) -> None: ...

    def close(self) -> None: ...


class SinkError(RuntimeError):
    """A sink's write failed on its own thread; raised to the producer at its next call."""


@dataclass(frozen=True)
class LaneStats:
    """One queue's counters: what went in, what came out, and how often the producer waited.

    ``blocked_seconds`` is producer time spent waiting on a full queue (backpressure), on the
    lane's clock; ``work_seconds`` is time spent in the consumer's calls on its own thread.
    ``capacity`` 0: no queue, the sink written inline by the producer (never blocked).
    """

    name: str
    capacity: int
    enqueued: int = 0
    rows: int = 0
    done: int = 0  # items the consumer finished (a sink: batches acknowledged)
    failed: int = 0  # items not processed because the consumer failed
    depth: int = 0
    max_depth: int = 0
    blocked: int = 0  # puts that found the queue full and waited
    blocked_seconds: float = 0.0
    work_seconds: float = 0.0

    def line(self) -> str:
        if not self.capacity:
            return (
                f"{self.name}: {self.done}/{self.enqueued} batches ({self.rows} rows), written "
                f"on the producer's thread, busy {self.work_seconds:.3f} s"
                + (f", {self.failed} failed" if self.failed else "")
            )
        return (
            f"{self.name}: {self.done}/{self.enqueued} batches ({self.rows} rows), max queue "
            f"{self.max_depth}/{self.capacity}, producer blocked {self.blocked}x "
            f"({self.blocked_seconds:.3f} s), worker busy {self.work_seconds:.3f} s"
            + (f", {self.failed} not written (failed)" if self.failed else "")
        )


_STOP = object()
_REJECTED = object()  # a lane item carrying rejected rows, not a table name


class Lane:
    """A bounded queue and one thread that hands each item to ``consume``, in order.

    ``put`` waits while the queue is full (counted and timed: backpressure, never a drop).
    The first exception ``consume`` raises is kept in ``error``; the lane then stops
    consuming (later items are counted ``failed``) and keeps draining its queue, so a
    producer never deadlocks on a dead consumer. ``clock`` is injectable (tests count).
    """

    def __init__(
        self,
        name: str,
        consume: Callable[..., None],
        capacity: int = DEFAULT_QUEUE_BATCHES,
        clock: Clock = time.perf_counter,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"queue capacity must be >= 1, got {capacity}")
        self._consume = consume
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._lock = threading.Lock()
        self._stats = LaneStats(name, capacity)
        self.error: BaseException | None = None
        self._closed = False
        thread = name if name.startswith("dspark-obs") else f"dspark-obs-{name}"
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)
        self._thread.start()

    @property
    def stats(self) -> LaneStats:
        with self._lock:
            return replace(self._stats, depth=self._queue.qsize())

    def put(self, *item: Any, rows: int = 0) -> None:
        """Queue one item (the arguments of one ``consume`` call); waits while full."""
        if self._closed:
            raise SinkError(f"{self._stats.name}: the lane is closed")
        try:
            self._queue.put_nowait(item)
            waited = None
        except queue.Full:
            t0 = self._clock()
            self._queue.put(item)
            waited = self._clock() - t0
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                enqueued=s.enqueued + 1,
                rows=s.rows + rows,
                max_depth=max(s.max_depth, self._queue.qsize()),
                blocked=s.blocked + (waited is not None),
                blocked_seconds=s.blocked_seconds + (waited or 0.0),
            )

    def drain(self) -> None:
        """Return once every item queued so far was consumed (or counted failed)."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Drain, stop the thread and join it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise SinkError(f"{self._stats.name}: worker did not finish within {timeout} s")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._one(item)
            finally:
                self._queue.task_done()

    def _one(self, item: tuple[Any, ...]) -> None:
        if self.error is not None:
            with self._lock:
                self._stats = replace(self._stats, failed=self._stats.failed + 1)
            return
        t0 = self._clock()
        try:
            self._consume(*item)
        except BaseException as exc:  # noqa: BLE001 - handed to the producer, not lost
            self.error = exc
            with self._lock:
                self._stats = replace(self._stats, failed=self._stats.failed + 1)
            return
        finally:
            spent = self._clock() - t0
            with self._lock:
                self._stats = replace(self._stats, work_seconds=self._stats.work_seconds + spent)
        with self._lock:
            self._stats = replace(self._stats, done=self._stats.done + 1)


def sink_name(sink: object, taken: Iterable[str] = ()) -> str:
    """A short, unique label for a sink (its class name, numbered when repeated)."""
    base = type(sink).__name__
    name, n = base, 1
    taken = set(taken)
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


class FanOut:
    """Validate once, then hand the same valid batch to every sink.

    Rejected rows are kept in ``errors`` (and never reach a sink); valid rows of the same
    batch are written. Inline (the default) a sink's failure is raised from that ``emit``
    (the sinks after it do not get the batch). ``threaded=True``: each sink writes on its own
    thread from a queue of ``queue_batches`` batches (see the module docstring); a sink's
    failure is raised as :class:`SinkError` from the next :meth:`emit`, :meth:`drain` or
    :meth:`close`. ``clock`` times waits and writes (injectable: tests count).
    """

    def __init__(
        self,
        sinks: Iterable[RecordSink],
        *,
        threaded: bool = False,
        queue_batches: int = DEFAULT_QUEUE_BATCHES,
        clock: Clock = time.perf_counter,
    ):
        self.sinks = list(sinks)
        self.errors: list[RecordError] = []
        self.threaded = threaded
        self._clock = clock
        self._lanes: list[Lane] = []
        names: list[str] = []
        for sink in self.sinks:
            names.append(sink_name(sink, names))
        if threaded:
            self._lanes = [
                Lane(name, _deliver(sink), queue_batches, clock)
                for name, sink in zip(names, self.sinks, strict=True)
            ]
        self._inline = [] if threaded else [LaneStats(name, 0) for name in names]
        self._stopped = False  # joined or closed: emits are refused
        self._closed = False

    def emit(self, table: str, rows: Sequence[Mapping[str, Any]] | pa.Table) -> pa.Table:
        if self._stopped:
            raise SinkError("the fan-out was joined or closed: it takes no more records")
        self._raise_failed()
        checked, errors = check(table, rows)
        batch = checked.data
        self.errors.extend(errors)
        if errors:  # sinks that count rejections (telemetry) define rejected(errors)
            for i, sink in enumerate(self.sinks):
                if hasattr(sink, "rejected"):
                    if self._lanes:
                        self._lanes[i].put(_REJECTED, errors)
                    else:
                        sink.rejected(errors)
        if batch.num_rows:
            if self._lanes:
                for sink, lane in zip(self.sinks, self._lanes, strict=True):
                    lane.put(table, _payload(sink, checked), rows=batch.num_rows)
            else:
                for i, sink in enumerate(self.sinks):
                    self._write_inline(i, sink, table, checked)
        return batch

    def _write_inline(self, i: int, sink: RecordSink, table: str, checked: ValidatedBatch) -> None:
        t0 = self._clock()
        ok = False
        try:
            sink.write(table, _payload(sink, checked))
            ok = True
        finally:
            s = self._inline[i]
            self._inline[i] = replace(
                s, enqueued=s.enqueued + 1, rows=s.rows + checked.data.num_rows,
                done=s.done + ok, failed=s.failed + (not ok),
                work_seconds=s.work_seconds + (self._clock() - t0),
            )  # fmt: skip

    def drain(self) -> list[LaneStats]:
        """Wait until every sink has written everything emitted so far (acknowledged), then
        return the sinks' counters (inline: nothing to wait for)."""
        for lane in self._lanes:
            lane.drain()
        self._raise_failed()
        return self.stats()

    def stats(self) -> list[LaneStats]:
        """Per sink counters in sink order: its queue's (threaded) or its inline writes',
        with the queue of a sink that keeps one of its own (``queue_stats``: a fold thread,
        a telemetry process) in place of the capacity 0 of a plain inline write."""
        if self._lanes:
            return [lane.stats for lane in self._lanes]
        return [_with_own_queue(s, sink) for s, sink in zip(self._inline, self.sinks, strict=True)]

    def summary(self) -> str:
        """The backpressure report of a run, one line per sink ("" without sinks)."""
        return "\n".join(s.line() for s in self.stats())

    def join(self) -> list[LaneStats]:
        """Drain every queue and stop the sink threads, leaving the sinks open (for a caller
        that owns and closes them itself); later emits are refused. Returns the counters."""
        self._stopped = True
        for lane in self._lanes:
            lane.close()
        self._raise_failed()
        return self.stats()

    def close(self) -> None:
        """Drain every queue, join every sink thread, then close the sinks (on this thread).
        A sink's failure is raised after every sink was closed. Idempotent."""
        if self._closed:
            return
        self._closed = self._stopped = True
        try:
            for lane in self._lanes:
                lane.close()
        finally:
            for sink in self.sinks:
                sink.close()
        self._raise_failed()

    def _raise_failed(self) -> None:
        for lane in self._lanes:
            if lane.error is not None:
                s = lane.stats
                raise SinkError(
                    f"sink {s.name} failed: {type(lane.error).__name__}: {lane.error} "
                    f"({s.failed} batch(es) not written to it; {s.done} were)"
                ) from lane.error


def _with_own_queue(written: LaneStats, sink: RecordSink) -> LaneStats:
    """An inline sink's counters, with its own queue's depth and backpressure if it has one."""
    own = getattr(sink, "queue_stats", None)
    if not isinstance(own, LaneStats):
        return written
    return replace(
        written,
        capacity=own.capacity,
        depth=own.depth,
        max_depth=own.max_depth,
        blocked=own.blocked,
        blocked_seconds=own.blocked_seconds,
        failed=written.failed + own.failed,
    )


def _deliver(sink: RecordSink) -> Callable[[Any, Any], None]:
    """A lane's consumer: a batch goes to ``write``; rejected rows to ``rejected``."""

    def deliver(table: Any, payload: Any) -> None:
        if table is _REJECTED:
            sink.rejected(payload)  # type: ignore[attr-defined]
        else:
            sink.write(table, payload)

    return deliver


class MemorySink:
    """Keeps every batch in memory; for tests and for small in-process analyses."""

    def __init__(self) -> None:
        self.batches: dict[str, list[pa.Table]] = {}

    def write(self, table: str, batch: pa.Table) -> None:
        self.batches.setdefault(table, []).append(batch)

    def table(self, table: str) -> pa.Table | None:
        parts = self.batches.get(table)
        return pa.concat_tables(parts) if parts else None

    def close(self) -> None:
        pass


def _payload(sink: RecordSink, checked: ValidatedBatch) -> pa.Table | ValidatedBatch:
    """What a sink receives: the ValidatedBatch itself for a sink that says it takes one
    (``takes_validated``: the store, which then stores it without checking it again), the
    plain Arrow table for every other sink."""
    return checked if getattr(sink, "takes_validated", False) else checked.data
