"""``dspark-obs serve``: the /metrics and /healthz endpoint, fed in-process or from a store.

Three feeds, one aggregation (:class:`~dspark_obs.sinks.stats.Aggregator`):

* in-process: :func:`telemetry_sinks` gives the sinks ``dspark-obs run --metrics-port``
  adds to its FanOut;
* :class:`StoreFollower`: polls a store directory and folds every row it has not seen yet,
  whoever wrote it. On start it reads everything the store holds, so counters resume from
  the store's totals after a restart of serve instead of going back to zero;
* :func:`replay`: re-plays one stored run at ``speed`` times its recorded pace.

Reading is read-only and confined to the store: segments are opened only after their
resolved path is checked to lie under the store root. A run's partition is treated as an
append-only sequence of rows (segments sorted by name are in write order, and compaction
merges them in that order), so the follower only needs the number of rows it consumed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dspark_obs import schema
from dspark_obs.fanout import RecordSink
from dspark_obs.sinks.stats import Aggregator
from dspark_obs.store import layout

__all__ = ["MetricsServer", "StoreFollower", "replay", "start_http", "telemetry_sinks"]

TABLE_ORDER = ("runs", "steps", "req_steps", "requests")  # labels need the runs row first


class MetricsServer:
    """A threaded HTTP server: GET /metrics (Prometheus text) and GET /healthz (JSON)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "127.0.0.1",
        health: Callable[[], dict] | None = None,
    ) -> None:
        health = health or (lambda: {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    body = json.dumps({"status": "ok", **health()}).encode()
                    ctype, code = "application/json", 200
                else:
                    body, ctype, code = b"not found: try /metrics or /healthz\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes every few seconds: quiet
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="dspark-obs-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_http(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    health: Callable[[], dict] | None = None,
) -> MetricsServer:
    """Serve ``registry`` at http://host:port/metrics (port 0: a free port, see ``.port``)."""
    return MetricsServer(registry, port, host, health)


def telemetry_sinks(
    metrics_port: int | None,
    otlp_endpoint: str | None,
    host: str = "127.0.0.1",
) -> list[RecordSink]:
    """The live sinks for an in-process run: Prometheus (serving /metrics on ``metrics_port``)
    and OpenTelemetry (when ``otlp_endpoint`` or an OTEL_EXPORTER_OTLP_*ENDPOINT variable is
    set); both read one aggregation. Empty when neither is asked for."""
    from dspark_obs.sinks.otel import OtelSink, otlp_configured
    from dspark_obs.sinks.prometheus import PrometheusSink

    sinks: list[RecordSink] = []
    aggregator = Aggregator()
    if metrics_port is not None:
        prom = PrometheusSink(aggregator=aggregator)
        try:
            prom.server = start_http(prom.registry, metrics_port, host)  # type: ignore[attr-defined]
        except OSError as exc:
            prom.close()
            raise ValueError(f"cannot serve /metrics on {host}:{metrics_port}: {exc}") from exc
        sinks.append(prom)
    if otlp_configured(otlp_endpoint):
        shared = aggregator if sinks else None
        sinks.append(OtelSink(otlp_endpoint, aggregator=shared))
    return sinks


# ---------------------------------------------------------------- reading a store


def _inside(root: Path, path: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except OSError:
        return False


def _partitions(root: Path, table: str) -> list[tuple[str, Path]]:
    return [
        (run_id, layout.partition_dir(root, table, run_id))
        for run_id in layout.partition_runs(root, table)
    ]


_DAMAGED = -1


class StoreFollower:
    """Folds every new row of a store into an aggregator, polling every ``interval_s``."""

    def __init__(self, root: str | Path, sink: RecordSink, interval_s: float = 1.0) -> None:
        self.root = Path(root).resolve()
        self.sink = sink
        self.interval_s = interval_s
        self.rows_seen: dict[tuple[str, str], int] = {}
        # Segments are immutable: their row count (or DAMAGED) is read once, and a damaged
        # one is named once and skipped (the store's writer quarantines it), never retried.
        self._segment_rows: dict[Path, int] = {}
        self.polls = 0
        self.last_poll: float | None = None
        self.problems: list[str] = []

    def poll(self) -> int:
        """Read what is new since the last poll; returns the number of new rows."""
        new = 0
        for table in TABLE_ORDER:
            for run_id, part in _partitions(self.root, table):
                new += self._partition(table, run_id, part)
        self.polls += 1
        self.last_poll = time.time()
        return new

    def _partition(self, table: str, run_id: str, part: Path) -> int:
        if not _inside(self.root, part):
            self.problems.append(f"{part}: outside the store, ignored")
            return 0
        seen = self.rows_seen.get((table, run_id), 0)
        skip, parts = seen, []
        try:
            for seg in layout.segment_files(part):
                if not _inside(self.root, seg):
                    continue
                rows = self._rows(table, seg)
                if rows == _DAMAGED:
                    continue
                if skip >= rows:
                    skip -= rows
                    continue
                try:
                    data = pq.read_table(seg)
                except pa.ArrowException as exc:  # footer intact, pages damaged
                    self._damaged(seg, f"unreadable data ({str(exc).splitlines()[0][:120]})")
                    continue
                parts.append(data.slice(skip))
                skip = 0
        except (FileNotFoundError, OSError):
            return 0  # a compaction swapped the segments under us: next poll
        if not parts:
            return 0
        batch = pa.concat_tables([_conform(table, p) for p in parts])
        if batch.num_rows:
            self.sink.write(table, batch)
        self.rows_seen[(table, run_id)] = seen + batch.num_rows
        return batch.num_rows

    def _rows(self, table: str, seg: Path) -> int:
        rows = self._segment_rows.get(seg)
        if rows is None:
            why = layout.inspect_segment(seg, schema.TABLES[table])
            if why is not None:
                self._damaged(seg, why)
                return _DAMAGED
            rows = self._segment_rows[seg] = pq.ParquetFile(seg).metadata.num_rows
        return rows

    def _damaged(self, seg: Path, why: str) -> None:
        self._segment_rows[seg] = _DAMAGED
        self.problems.append(f"{seg}: {why}; skipped (dspark-obs store-check --repair)")

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - keep serving; report in /healthz
                self.problems.append(f"{type(exc).__name__}: {exc}")
                del self.problems[:-20]
            stop.wait(self.interval_s)

    def health(self) -> dict:
        return {
            "feed": "follow",
            "store": str(self.root),
            "polls": self.polls,
            "last_poll": self.last_poll,
            "rows": sum(self.rows_seen.values()),
            "problems": self.problems[-5:],
        }


def _conform(table: str, data: pa.Table) -> pa.Table:
    """Segments hold the schema's columns (DuckDB adds the hive run_id only when reading)."""
    want = schema.TABLES[table]
    cols = [
        data.column(f.name).cast(f.type)
        if f.name in data.column_names
        else pa.nulls(data.num_rows, f.type)
        for f in want
    ]
    return pa.Table.from_arrays(cols, schema=want)


def read_run(root: str | Path, run_id: str) -> dict[str, pa.Table]:
    """Every table's rows of one run, read-only from the store's segments."""
    collected: dict[str, list[pa.Table]] = {}

    class Collect:
        def write(self, table: str, batch: pa.Table) -> None:
            collected.setdefault(table, []).append(batch)

        def close(self) -> None:
            pass

    follower = StoreFollower(root, Collect())
    for table in TABLE_ORDER:
        part = layout.partition_dir(follower.root, table, run_id)
        if part.exists():
            follower._partition(table, run_id, part)
    if "runs" not in collected:
        raise ValueError(f"run {run_id!r} is not in the store at {follower.root}")
    return {t: pa.concat_tables(b) for t, b in collected.items()}


def _event_times(table: str, data: pa.Table) -> np.ndarray:
    if table == "requests":
        return pc.fill_null(data.column("finish_time"), np.nan).to_numpy(zero_copy_only=False)
    ts = data.column("ts").cast(pa.int64())
    return pc.fill_null(ts, 0).to_numpy(zero_copy_only=False) / 1e6


def replay(
    root: str | Path,
    run_id: str,
    sink: RecordSink,
    speed: float = 1.0,
    stop: threading.Event | None = None,
) -> int:
    """Re-play a stored run into ``sink`` at ``speed`` x its recorded pace (0: at once).

    Steps and their request rows arrive at their step's timestamp, finished requests at their
    finish time. Returns the number of rows fed.
    """
    tables = read_run(root, run_id)
    sink.write("runs", tables["runs"])
    events: list[tuple[float, int, str, pa.Table]] = []
    for order, table in enumerate(TABLE_ORDER[1:]):
        data = tables.get(table)
        if data is None or data.num_rows == 0:
            continue
        t = _event_times(table, data)
        uniq, inv = np.unique(t, return_inverse=True)
        rows = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[rows], np.arange(uniq.size + 1))
        for k, when in enumerate(uniq.tolist()):
            idx = rows[bounds[k] : bounds[k + 1]]
            events.append((when, order, table, data.take(pa.array(idx))))
    events.sort(key=lambda e: (e[0], e[1]))
    fed = tables["runs"].num_rows
    start_wall = time.monotonic()
    first = events[0][0] if events else 0.0
    for when, _, table, batch in events:
        if stop is not None and stop.is_set():
            break
        if speed > 0 and np.isfinite(when):
            delay = (when - first) / speed - (time.monotonic() - start_wall)
            if delay > 0:
                time.sleep(delay)
        sink.write(table, batch)
        fed += batch.num_rows
    return fed
