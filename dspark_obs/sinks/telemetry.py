"""A run's live telemetry sinks, Prometheus and OpenTelemetry: in this process or their own.

:func:`telemetry_sinks` builds them for a run; with ``process=True`` they run in a child
interpreter fed record batches over a pipe (:class:`TelemetryProcess`), which is what a
decode loop needs:

Prometheus and OpenTelemetry fold every batch with numpy, and the block-accept estimator
runs over finished compact requests with pandas: 1.5-18 ms per request on a 2-core CPU, in
stretches of tens of milliseconds that hold the interpreter lock throughout
(``bench/bench_sink_fold.py``). In the engine's process every one of those milliseconds is
one the decode thread, which mostly launches kernels from Python on a GPU host, may wait for.
(On one H100 lease the two telemetry sinks cost 2.4-5.6% of throughput while the store alone
cost nothing; on the next one this layout measured no better, within +-5% noise: README,
"Records and sinks off the decode thread".)

:class:`TelemetryProcess` is one RecordSink whose ``write`` only pickles the Arrow batch into
a pipe (pyarrow's buffers, no per-row work); a child interpreter, with its own lock, runs
the same :class:`~dspark_obs.sinks.prometheus.PrometheusSink` and
:class:`~dspark_obs.sinks.otel.OtelSink` over the same
:class:`~dspark_obs.sinks.stats.Aggregator`, and serves ``/metrics`` itself. So a scrape,
an OTLP export or an estimator pass never touches the engine's process.

At most ``capacity`` batches are in flight (sent, not yet folded by the child): a writer
that finds the child that far behind waits, counted and timed in :attr:`queue_stats` (the
backpressure of :mod:`dspark_obs.sinks.backpressure`), never dropping a batch. A child that
dies is reported in :attr:`errors` and every later batch counted ``failed``; the run and
its store go on (telemetry never stops a run).

The child is ``python -m dspark_obs.sinks.telemetry``, started with the parent's interpreter
and talking over its stdin / stdout (its prints go to stderr); it exits when the parent
closes the pipe or dies.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from dspark_obs.fanout import DEFAULT_QUEUE_BATCHES, Clock, LaneStats, RecordSink
from dspark_obs.sinks.otel import OtelSink, otlp_configured
from dspark_obs.sinks.prometheus import PrometheusSink
from dspark_obs.sinks.serve import MetricsServer, start_http
from dspark_obs.sinks.stats import Aggregator
from dspark_obs.validation import RecordError

__all__ = ["TelemetryProcess", "telemetry_sinks"]

START_TIMEOUT_S = 120.0  # importing pandas, pyarrow and the OTel SDK on a slow host
REPLY_TIMEOUT_S = 300.0  # a flush or close: an estimator pass over a backlog, an OTLP export
_STOP = ("stop",)


def telemetry_sinks(
    metrics_port: int | None,
    otlp_endpoint: str | None,
    host: str = "127.0.0.1",
    *,
    process: bool = False,
) -> list[RecordSink]:
    """The live sinks for a run: Prometheus (serving /metrics on ``metrics_port``) and
    OpenTelemetry (when ``otlp_endpoint`` or an OTEL_EXPORTER_OTLP_*ENDPOINT variable is
    set); both read one aggregation. Empty when neither is asked for.

    ``process=True``: both run in one :class:`TelemetryProcess` (/metrics at its ``url``),
    so their folds, scrapes and exports never hold this process's interpreter lock: what a
    decode loop needs. In-process (the default) the Prometheus sink is first, its
    ``registry`` open to more collectors (the SGLang collector's own counters) and its
    server at ``.server``. Raises ValueError when /metrics cannot be served.
    """
    if metrics_port is None and not otlp_configured(otlp_endpoint):
        return []
    if process:
        return [TelemetryProcess(metrics_port, otlp_endpoint, host)]
    sinks, server = _open_sinks(metrics_port, otlp_endpoint, host, background=True)
    if server is not None:
        sinks[0].server = server
    return sinks


def _open_sinks(
    metrics_port: int | None,
    otlp_endpoint: str | None,
    host: str,
    *,
    background: bool,
    export_interval_s: float = 5.0,
) -> tuple[list[Any], MetricsServer | None]:
    """Prometheus (with its /metrics server) and / or OTel over one aggregation."""
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


class TelemetryProcess:
    """RecordSink: Prometheus (``/metrics`` on ``host:metrics_port``; port 0 picks a free
    one, see :attr:`url`) and / or OpenTelemetry (OTLP/HTTP to ``otlp_endpoint``, or the
    ``OTEL_EXPORTER_OTLP_*`` variables) folded and served by a child process.

    Raises ValueError when the child cannot serve what was asked (a port in use), after the
    child has exited. ``clock`` times the waits on a full pipeline (injectable). A flush or
    close the child leaves unanswered for ``reply_timeout_s`` kills it (reported in
    :attr:`errors`), so a run never hangs at its end on its telemetry.
    """

    def __init__(
        self,
        metrics_port: int | None,
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
        self._clock = clock
        self._reply_timeout_s = reply_timeout_s
        self._stats = LaneStats(type(self).__name__, capacity)
        self._lanes: Callable[[], Sequence[LaneStats]] | None = None
        self._errors: list[str] = []  # transport problems, then the child's fold errors
        self._child_errors: list[str] = []
        self._dead = False
        self._closed = False
        self._lock = threading.Lock()  # one message in flight to the pipe at a time
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dspark_obs.sinks.telemetry"],
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
            "metrics_port": metrics_port,
            "host": host,
            "otlp_endpoint": otlp_endpoint,
            "export_interval_s": export_interval_s,
        }
        try:
            self._send.send(spec)
            if not self._recv.poll(start_timeout_s):
                raise ValueError(f"the telemetry process did not start in {start_timeout_s} s")
            kind, detail = self._recv.recv()
        except (OSError, EOFError) as exc:
            self._shutdown()
            raise ValueError(f"the telemetry process failed to start: {exc}") from exc
        except ValueError:
            self._shutdown()
            raise
        if kind != "ready":
            self._shutdown()
            raise ValueError(detail)
        self.url: str | None = detail
        """``http://host:port`` of the child's /metrics and /healthz (None: no Prometheus)."""

    # ------------------------------------------------------------------ RecordSink

    @property
    def queue_stats(self) -> LaneStats:
        """Batches sent / folded, the pipeline's depth, and how often (how long) a writer
        waited for the child: the sink's own queue, reported by a FanOut that writes it."""
        return replace(self._stats, depth=self._in_flight)

    @property
    def errors(self) -> list[str]:
        """The child's fold errors as of the last flush, and any transport failure."""
        return [*self._errors, *self._child_errors]

    def follow_backpressure(self, lanes: Callable[[], Sequence[LaneStats]]) -> None:
        """Expose ``lanes()`` (a FanOut's counters) on the child's /metrics, refreshed with
        every batch (see :func:`~dspark_obs.sinks.backpressure.expose_backpressure`)."""
        self._lanes = lanes

    def write(self, table: str, batch: pa.Table) -> None:
        self._put(("write", table, batch, self._lane_counters()), rows=batch.num_rows)

    def rejected(self, errors: list[RecordError]) -> None:
        """Count rows a FanOut refused, as the in-process sinks do."""
        self._put(("rejected", list(errors)), rows=0)

    def flush(self) -> None:
        """Return once the child folded every batch sent so far (estimator pass included)
        and pushed OTel metrics and spans out (the FanOut's counters refreshed too)."""
        self._request(("flush", self._lane_counters()))

    def close(self) -> None:
        """Fold and export what is pending, stop /metrics, and wait for the child. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._request(("close", self._lane_counters()))
        finally:
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

    def _put_locked(self, message: tuple, rows: int) -> None:
        if self._closed:
            raise ValueError("the telemetry process is closed")
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
        """Read what the child sent: ``ack`` (one batch folded) or ``done`` (a control
        message answered, with the child's errors). Returns the last kind read."""
        last = None
        try:
            while block or self._recv.poll():
                kind, detail = self._recv.recv()
                last = kind
                if kind == "ack":
                    s = self._stats
                    self._stats = replace(s, done=s.done + 1)
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
        self._errors.append(
            f"the telemetry process failed ({how}; exit code {code}): "
            f"{self._in_flight} batch(es) in flight not folded, later ones not sent"
        )
        self._stats = replace(self._stats, failed=self._stats.failed + self._in_flight)

    def _shutdown(self) -> None:
        for conn in (self._send, self._recv):
            conn.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# ---------------------------------------------------------------------- the child


class _Child:
    """The child's side: the in-process sinks over one aggregation, fed from the pipe."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from dspark_obs.sinks.backpressure import LaneCollector

        self.lanes: list[LaneStats] = []
        self.sinks, self.server = _open_sinks(
            spec["metrics_port"],
            spec["otlp_endpoint"],
            spec["host"],
            background=False,  # this process has nothing else to do: fold as batches come
            export_interval_s=spec["export_interval_s"],
        )
        if self.server is not None:
            self.sinks[0].registry.register(LaneCollector(lambda: self.lanes))

    def errors(self) -> list[str]:
        return [e for sink in self.sinks for e in sink.errors]

    def handle(self, message: tuple) -> tuple[str, Any] | None:
        kind = message[0]
        if kind == "write":
            _, table, batch, lanes = message
            if lanes is not None:
                self.lanes = lanes
            for sink in self.sinks:
                sink.write(table, batch)
            return ("ack", None)
        if kind == "rejected":
            for sink in self.sinks:
                sink.rejected(message[1])
            return ("ack", None)
        if kind == "flush":
            if message[1] is not None:
                self.lanes = message[1]
            for sink in self.sinks:
                sink.flush()
            return ("done", self.errors())
        if kind == "close":
            if message[1] is not None:
                self.lanes = message[1]
            for sink in self.sinks:
                sink.close()
            if self.server is not None:
                self.server.close()
            return ("done", self.errors())
        raise ValueError(f"unknown message {kind!r}")


def _serve(inbox: Connection, outbox: Connection) -> None:
    """Read messages on a thread of their own (the pipe never fills while a fold runs),
    handle them in order on this one, answer each."""
    try:
        child = _Child(inbox.recv())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.send(("failed", str(exc)))
        return
    outbox.send(("ready", None if child.server is None else child.server.url))
    messages: queue.SimpleQueue[tuple] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                messages.put(inbox.recv())
        except (EOFError, OSError):
            messages.put(_STOP)

    threading.Thread(target=read, name="dspark-obs-telemetry-reader", daemon=True).start()
    while (message := messages.get()) is not _STOP:
        reply = child.handle(message)
        if reply is not None:
            outbox.send(reply)
        if message[0] == "close":
            return
    child.handle(("close", None))  # the parent went away: export what was folded


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the pipe: stdout goes to stderr
    _serve(Connection(0, writable=False), Connection(out_fd, readable=False))


if __name__ == "__main__":
    main()
