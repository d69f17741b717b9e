"""``dspark-obs serve``: the /metrics and /healthz endpoint, fed in-process or from a store.

Three feeds, one aggregation (:class:`~dspark_obs.sinks.stats.Aggregator`):

* a run's own: :func:`~dspark_obs.sinks.telemetry.telemetry_sinks` gives the sinks a
  producer adds to its FanOut (``dspark-obs run`` runs the same ones in a
  :class:`~dspark_obs.sinks.process.SinkProcess`);
* :class:`StoreFollower`: polls a store directory and folds every row it has not seen yet,
  whoever wrote it. On start it reads everything the store holds, so counters resume from
  the store's totals after a restart of serve instead of going back to zero;
* :func:`replay`: re-plays one stored run at ``speed`` times its recorded pace.

Reading is read-only and confined to the store: a segment is read only if the store's
acceptance rule (``store/segments.py``) accepts it, which includes its resolved path lying
under the store root. The follower counts rows per original segment (a compacted segment's
footer lists the segments it merged), so compaction never double-counts, and a counted
segment that is later set aside or damaged never makes it skip new rows (its rows stay
counted: counters never go backwards).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dspark_obs import schema
from dspark_obs.fanout import RecordSink
from dspark_obs.store import layout, segments

__all__ = ["MetricsServer", "StoreFollower", "replay", "start_http"]

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


# ---------------------------------------------------------------- reading a store

MAX_PROBLEMS = 20  # distinct problems listed in /healthz


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


@dataclass
class Problem:
    """One distinct problem the follower met: how often, and when first and last (epoch s)."""

    text: str
    count: int
    first_seen: float
    last_seen: float

    def to_dict(self) -> dict[str, object]:
        return {
            "problem": self.text,
            "count": self.count,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }


class Problems:
    """A bounded, de-duplicated problem list: one entry per distinct text, with a count.

    When it is full, a new problem takes the place of the least recently seen one only if
    that one was not seen in the current poll (:meth:`next_poll`); otherwise it is counted
    in :attr:`not_listed`, so problems that recur on every poll never push each other out.
    """

    def __init__(self, limit: int = MAX_PROBLEMS, clock: Callable[[], float] = time.time) -> None:
        self.limit = limit
        self.clock = clock
        self._items: OrderedDict[str, Problem] = OrderedDict()  # least recently seen first
        self._seen_in: dict[str, int] = {}
        self._poll = 0
        self.not_listed = 0  # occurrences of problems left out because the list was full

    def next_poll(self) -> None:
        self._poll += 1

    def add(self, text: str) -> None:
        now = self.clock()
        item = self._items.pop(text, None)
        if item is None:
            if len(self._items) >= self.limit:
                oldest = next(iter(self._items))
                if self._seen_in[oldest] == self._poll:
                    self.not_listed += 1
                    return
                del self._items[oldest], self._seen_in[oldest]
            item = Problem(text, 0, now, now)
        item.count += 1
        item.last_seen = now
        self._items[text] = item
        self._seen_in[text] = self._poll

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def recent(self) -> list[dict[str, object]]:
        """Every kept problem, the most recently seen first."""
        return [p.to_dict() for p in reversed(list(self._items.values()))]


@dataclass
class _Followed:
    """What the follower folded of one (table, run): rows per original segment name (a
    compacted segment lists its sources), and the segment files it has examined."""

    consumed: dict[str, int] = field(default_factory=dict)
    files: dict[str, tuple[tuple[int, int, int], list[tuple[str, int]]]] = field(
        default_factory=dict
    )  # segment name -> (its stat, the original segments it holds)
    gone: set[str] = field(default_factory=set)  # folded segments named as removed


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class StoreFollower:
    """Folds every new row of a store into an aggregator, polling every ``interval_s``.

    What it counts: every row of an accepted segment (``store/segments.py``) it has read,
    once. Counters never go backwards: a segment that was counted and is then set aside
    (``store-check --repair``), removed or damaged keeps its rows in the counters and is
    named once in :attr:`problems`; rows that arrive after it are still counted. It tracks
    rows per original segment name (a compacted segment's footer lists the segments it
    merged), so neither compaction nor a quarantine between two polls shifts what is new.
    A restarted follower counts what the store holds at that moment.
    """

    def __init__(
        self,
        root: str | Path,
        sink: RecordSink,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root).resolve()
        self.sink = sink
        self.interval_s = interval_s
        self.clock = clock
        self.rows_seen: dict[tuple[str, str], int] = {}
        self._followed: dict[tuple[str, str], _Followed] = {}
        self.judge = segments.Judge(self.root)
        self.polls = 0
        self.last_poll: float | None = None
        self.problems = Problems(clock=clock)

    def poll(self) -> int:
        """Read what is new since the last poll; returns the number of new rows."""
        new = 0
        self.problems.next_poll()
        for table in TABLE_ORDER:
            for run_id, part in _partitions(self.root, table):
                new += self._partition(table, run_id, part)
        self.polls += 1
        self.last_poll = self.clock()
        return new

    def _partition(self, table: str, run_id: str, part: Path) -> int:
        if not _inside(self.root, part):
            self.problems.add(f"{part}: outside the store, ignored")
            return 0
        state = self._followed.setdefault((table, run_id), _Followed())
        parts: list[pa.Table] = []
        listed: set[str] = set()
        try:
            for seg in layout.segment_files(part):
                why = self.judge.verdict(seg, table)
                if why == "vanished":
                    continue
                if why is not None:
                    listed.add(seg.name)
                    self._bad_file(state, seg, why)
                    continue
                key = _stat_key(seg)
                known = state.files.get(seg.name)
                if known is not None and known[0] != key:
                    self.problems.add(
                        f"{seg}: changed after it was counted; its rows "
                        "counted before stay counted (segments never change)"
                    )
                if known is not None and known[0] == key:
                    sources = known[1]
                else:  # a footer is read once per file version
                    sources = segments.sources(seg)
                    state.files[seg.name] = (key, sources)
                listed.update(name for name, _ in sources)
                fresh = self._unread(state, sources)
                if not fresh:
                    continue
                try:
                    data = pq.read_table(seg)
                except pa.ArrowException as exc:  # footer intact, pages damaged
                    why = f"unreadable data ({str(exc).splitlines()[0][:120]})"
                    self.judge.reject(seg, why)
                    self._bad_file(state, seg, why)
                    continue
                for name, offset, n in fresh:
                    parts.append(data.slice(offset, n))
                    state.consumed[name] = state.consumed.get(name, 0) + n
        except (FileNotFoundError, OSError):
            return 0  # a compaction swapped the segments under us: next poll
        for name in sorted(set(state.consumed) - listed - state.gone):
            state.gone.add(name)
            self.problems.add(
                f"{part / name}: counted ({state.consumed[name]:,} rows) and then removed or "
                "set aside; its rows stay counted (counters never go backwards)"
            )
        if not parts:
            return 0
        batch = pa.concat_tables([_conform(table, p) for p in parts])
        if batch.num_rows:
            self.sink.write(table, batch)
        self.rows_seen[(table, run_id)] = self.rows_seen.get((table, run_id), 0) + batch.num_rows
        return batch.num_rows

    @staticmethod
    def _unread(state: _Followed, sources: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        """(source name, row offset in the file, rows) of what has not been folded yet."""
        out, offset = [], 0
        for name, rows in sources:
            done = state.consumed.get(name, 0)
            if done < rows:
                out.append((name, offset + done, rows - done))
            offset += rows
        return out

    def _bad_file(self, state: _Followed, seg: Path, why: str) -> None:
        counted = state.consumed.get(seg.name)
        if counted:
            self.problems.add(
                f"{seg}: counted ({counted:,} rows), now damaged: {why}; its rows "
                "stay counted (dspark-obs store-check --repair)"
            )
        else:
            self.problems.add(f"{seg}: {why}; skipped (dspark-obs store-check --repair)")

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - keep serving; report in /healthz
                self.problems.add(f"{type(exc).__name__}: {exc}")
            stop.wait(self.interval_s)

    def health(self) -> dict:
        return {
            "feed": "follow",
            "store": str(self.root),
            "polls": self.polls,
            "last_poll": self.last_poll,
            "rows": sum(self.rows_seen.values()),
            "problems": self.problems.recent(),
            "problems_not_listed": self.problems.not_listed,
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
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Re-play a stored run into ``sink`` at ``speed`` x its recorded pace (0: at once).

    Steps and their request rows arrive at their step's timestamp, finished requests at their
    finish time. Returns the number of rows fed. ``clock``/``sleep`` are injectable so the pace
    can be checked without waiting on the wall clock.
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
    start_wall = clock()
    first = events[0][0] if events else 0.0
    for when, _, table, batch in events:
        if stop is not None and stop.is_set():
            break
        if speed > 0 and np.isfinite(when):
            delay = (when - first) / speed - (clock() - start_wall)
            if delay > 0:
                sleep(delay)
        sink.write(table, batch)
        fed += batch.num_rows
    return fed
