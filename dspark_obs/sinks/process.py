"""A run's sinks in a process of their own: the store, Prometheus and OpenTelemetry.

:class:`SinkProcess` is one RecordSink whose ``write`` only pickles the Arrow batch into a
pipe (pyarrow's buffers, no per-row work); a child interpreter, with its own interpreter
lock, writes the same :class:`~dspark_obs.store.Store` and runs the same
:class:`~dspark_obs.sinks.prometheus.PrometheusSink` and
:class:`~dspark_obs.sinks.otel.OtelSink` over one
:class:`~dspark_obs.sinks.stats.Aggregator`, serving ``/metrics`` itself. That is what a
decode loop needs:

A decode loop on a GPU host mostly launches kernels from Python, so every millisecond
another thread of its process holds the interpreter lock may be one it waits for. The
telemetry folds and the block-accept estimator (1.5-18 ms per finished request on a 2-core
CPU, in stretches that hold the lock throughout: ``bench/bench_sink_fold.py``) and the
store's segment writes (0.2-0.6 s per benchmark run on an H100 host) all did, on the
engine's record worker thread. In the child none of them touches the engine's process; a
scrape or an OTLP export does not either.

At most ``capacity`` batches are in flight (sent, not yet handled by the child): a writer
that finds the child that far behind waits, counted and timed in :attr:`queue_stats` (the
backpressure of :mod:`dspark_obs.sinks.backpressure`), never dropping a batch.

Failures keep each sink's own rule. Telemetry never stops a run: its errors, and a child
that dies when it holds no store, are reported in :attr:`errors`. The store's rule is the
FanOut's for a sink on a thread of its own: a store write that failed in the child, or a
child that died holding the store, is raised as :class:`~dspark_obs.fanout.SinkError` from
the next ``write``, ``flush`` or ``close``; everything the store acknowledged before stays.
What :meth:`SinkProcess.flush` returned for is durable (the store writes every batch as a
segment before the child answers), and a child whose parent dies (even by kill -9) sees the
pipe close and writes out what it was sent.

The child is ``python -m dspark_obs.sinks._process_child``, started with the parent's
interpreter and talking over its stdin / stdout (its prints go to stderr).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import pyarrow as pa

from dspark_obs.fanout import DEFAULT_QUEUE_BATCHES, Clock, LaneStats, SinkError
from dspark_obs.store import StoreError
from dspark_obs.validation import RecordError

__all__ = ["SinkProcess"]

START_TIMEOUT_S = 120.0  # importing pandas, pyarrow and the OTel SDK on a slow host
REPLY_TIMEOUT_S = 300.0  # a flush or close: an estimator pass over a backlog, an OTLP export


class SinkProcess:
    """RecordSink: the store at ``store`` (durable on every write), Prometheus (``/metrics``
    on ``host:metrics_port``; port 0 picks a free one, see :attr:`url`) and / or
    OpenTelemetry (OTLP/HTTP to ``otlp_endpoint``, or the ``OTEL_EXPORTER_OTLP_*``
    variables), written and served by a child process. Any of the three may be left out.

    Raises StoreError when the child cannot open the store, ValueError when it cannot serve
    what was asked (a port in use), after the child has exited. ``clock`` times the waits on
    a full pipeline (injectable). A flush or close the child leaves unanswered for
    ``reply_timeout_s`` kills it (reported), so a run never hangs at its end on its sinks.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | None = None,
        metrics_port: int | None = None,
        otlp_endpoint: str | None = None,
        host: str = "127.0.0.1",
        *,
        export_interval_s: float = 5.0,
        capacity: int = DEFAULT_QUEUE_BATCHES,
        clock: Clock = time.perf_counter,
        start_timeout_s: float = START_TIMEOUT_S,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.store = None if store is None else Path(store)
        self._clock = clock
        self._reply_timeout_s = reply_timeout_s
        self._stats = LaneStats(type(self).__name__, capacity)
        self._lanes: Callable[[], Sequence[LaneStats]] | None = None
        self._errors: list[str] = []  # transport problems, then the child's telemetry errors
        self._child_errors: list[str] = []
        self._store_failure: str | None = None  # the first store write the child failed
        self._dead = False
        self._closed = False
        self._lock = threading.Lock()  # one message in flight to the pipe at a time
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dspark_obs.sinks._process_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._send = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self._recv = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        spec = {
            "store": None if self.store is None else str(self.store),
            "metrics_port": metrics_port,
            "host": host,
            "otlp_endpoint": otlp_endpoint,
            "export_interval_s": export_interval_s,
        }
        try:
            self._send.send(spec)
            if not self._recv.poll(start_timeout_s):
                raise ValueError(f"the sink process did not start in {start_timeout_s} s")
            kind, *detail = self._recv.recv()
        except (OSError, EOFError) as exc:
            self._shutdown()
            raise ValueError(f"the sink process failed to start: {exc}") from exc
        except ValueError:
            self._shutdown()
            raise
        if kind != "ready":
            self._shutdown()
            error, message = detail
            raise (StoreError if error == "StoreError" else ValueError)(message)
        self.url: str | None = detail[0]
        """``http://host:port`` of the child's /metrics and /healthz (None: no Prometheus)."""

    # ------------------------------------------------------------------ RecordSink

    @property
    def queue_stats(self) -> LaneStats:
        """Batches sent / handled, the pipeline's depth, and how often (how long) a writer
        waited for the child: the sink's own queue, reported by a FanOut that writes it."""
        return replace(self._stats, depth=self._in_flight)

    @property
    def errors(self) -> list[str]:
        """The child's telemetry errors as of the last flush, and any transport failure."""
        return [*self._errors, *self._child_errors]

    def follow_backpressure(self, lanes: Callable[[], Sequence[LaneStats]]) -> None:
        """Expose ``lanes()`` (a FanOut's counters) on the child's /metrics, refreshed with
        every batch (see :func:`~dspark_obs.sinks.backpressure.expose_backpressure`)."""
        self._lanes = lanes

    def write(self, table: str, batch: pa.Table) -> None:
        self._put(("write", table, batch, self._lane_counters()), rows=batch.num_rows)

    def rejected(self, errors: list[RecordError]) -> None:
        """Count rows a FanOut refused, as the in-process telemetry sinks do."""
        self._put(("rejected", list(errors)), rows=0)

    def flush(self) -> None:
        """Return once the child stored and folded every batch sent so far (estimator pass
        included) and pushed OTel metrics and spans out (the FanOut's counters too)."""
        self._request(("flush", self._lane_counters()))

    def close(self) -> None:
        """Store, fold and export what is pending, release the store, stop /metrics, and
        wait for the child. Idempotent."""
        if self._closed:
            return
        try:
            self._request(("close", self._lane_counters()))
        finally:
            self._closed = True
            self._shutdown()

    # ------------------------------------------------------------------ internals

    @property
    def _in_flight(self) -> int:
        """Messages sent and not yet answered: every one put is done, failed or in flight."""
        s = self._stats
        return s.enqueued - s.done - s.failed

    def _lane_counters(self) -> list[LaneStats] | None:
        return None if self._lanes is None else list(self._lanes())

    def _put(self, message: tuple, rows: int) -> None:
        with self._lock:
            self._put_locked(message, rows)
            self._raise_store_failure()

    def _put_locked(self, message: tuple, rows: int) -> None:
        if self._closed:
            raise ValueError("the sink process is closed")
        self._raise_store_failure()
        waited = None
        if not self._dead:
            self._take_replies(block=False)
            if self._in_flight >= self._stats.capacity:
                t0 = self._clock()
                while self._in_flight >= self._stats.capacity and not self._dead:
                    self._take_replies(block=True)
                waited = self._clock() - t0
        sent = not self._dead and self._transmit(message)
        s = self._stats
        self._stats = replace(
            s,
            enqueued=s.enqueued + 1,
            rows=s.rows + rows,
            failed=s.failed + (not sent),
            blocked=s.blocked + (waited is not None),
            blocked_seconds=s.blocked_seconds + (waited or 0.0),
        )
        self._stats = replace(self._stats, max_depth=max(s.max_depth, self._in_flight))

    def _transmit(self, message: tuple) -> bool:
        try:
            self._send.send(message)
            return True
        except OSError as exc:
            self._died(f"sending to it: {exc}")
            return False

    def _request(self, message: tuple) -> None:
        """Send a control message and wait for its reply (acks on the way are counted); a
        child that does not answer within ``reply_timeout_s`` is killed and reported."""
        with self._lock:
            self._request_locked(message)
            self._raise_store_failure()

    def _request_locked(self, message: tuple) -> None:
        if self._dead or not self._transmit(message):
            return
        deadline = time.monotonic() + self._reply_timeout_s
        while not self._dead:
            left = deadline - time.monotonic()
            if left <= 0 or not self._recv.poll(left):
                self._proc.kill()
                self._died(f"no answer to {message[0]} within {self._reply_timeout_s:g} s")
                return
            if self._take_replies(block=True) == "done":
                return

    def _take_replies(self, block: bool) -> str | None:
        """Read what the child sent: ``ack`` (one batch handled, with the store's failure if
        its write failed) or ``done`` (a control message answered, with the telemetry errors
        and the store's failure). Returns the last kind read."""
        last = None
        try:
            while block or self._recv.poll():
                kind, detail, store_failure = self._recv.recv()
                last = kind
                if store_failure is not None and self._store_failure is None:
                    self._store_failure = store_failure
                if kind == "ack":
                    ok = store_failure is None
                    s = self._stats
                    self._stats = replace(s, done=s.done + ok, failed=s.failed + (not ok))
                elif kind == "done":
                    self._child_errors = list(detail)
                    return kind
                block = False
        except (OSError, EOFError) as exc:
            self._died(f"reading from it: {exc}")
        return last

    def _died(self, how: str) -> None:
        if self._dead:
            return
        self._dead = True
        code = self._proc.poll()
        lost = self._in_flight
        message = (
            f"the sink process failed ({how}; exit code {code}): "
            f"{lost} batch(es) in flight not handled, later ones not sent"
        )
        self._errors.append(message)
        if self.store is not None and self._store_failure is None:
            self._store_failure = message
        self._stats = replace(self._stats, failed=self._stats.failed + lost)

    def _raise_store_failure(self) -> None:
        if self._store_failure is not None:
            s = self._stats
            raise SinkError(
                f"sink {s.name} failed: the store at {self.store}: {self._store_failure} "
                f"({s.failed} batch(es) not written to it; {s.done} were)"
            )

    def _shutdown(self) -> None:
        for conn in (self._send, self._recv):
            conn.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
