"""The store: crash-safe, append-only Parquet segments that never block readers.

Why not one DuckDB database file: a DuckDB file opened for writing locks every other process
out, and a dashboard or a user's shell must be able to read while a run is being written.
So each acknowledged write is an immutable Parquet segment (atomically renamed into a
per-run directory), and readers are DuckDB views over ``read_parquet`` globs.

Writers: one per (table, run), enforced with ``flock`` on the partition's lock file (the
kernel drops it when a writer dies, even by kill -9). The writer holding the lock knows every
key stored for its partition, so it drops rows already stored (restart, re-ingest) or
repeated inside a batch: a key (schema.KEYS) is ingested at most once.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspark_obs import schema
from dspark_obs.store import layout, segments, views
from dspark_obs.store.guard import check_read_only
from dspark_obs.store.layout import StoreError, StoreWarning
from dspark_obs.store.reader import Reader, sandboxed_views

T = TypeVar("T")
_SKIPPED_KEY = b"dspark_obs.skipped"  # query results: files left out (JSON list)
_RANGES_KEY = b"dspark_obs.fct_ranges"  # footer metadata: {dp_rank: [min_fct, max_fct]}
_DP_SHIFT = 40  # (dp_rank << 40) | forward_ct packs a step key into one int64


@dataclass(frozen=True)
class Ack:
    """What a write or flush made durable: rows written, rows dropped as already stored,
    and the rows :meth:`Store.write` refused as invalid (one RecordError each)."""

    rows: int = 0
    duplicates: int = 0
    segments: tuple[str, ...] = ()
    rejected: tuple[schema.RecordError, ...] = ()

    def __add__(self, other: Ack) -> Ack:
        return Ack(
            self.rows + other.rows,
            self.duplicates + other.duplicates,
            self.segments + other.segments,
            self.rejected + other.rejected,
        )


@dataclass(frozen=True)
class Compaction:
    """One run's table after :meth:`Store.compact`: segments before (now 1), rows kept."""

    table: str
    run_id: str
    segments_before: int
    rows: int
    skipped: str | None = None


@dataclass
class _Segment:
    path: Path
    rows: int
    ranges: dict[int, tuple[int, int]]  # per dp_rank, for tables keyed by forward_ct


@dataclass
class _Partition:
    """Writer-side state of one (table, run): its lock and what it already stores."""

    table: str
    run_id: str
    path: Path  # the run's symlink; segments are addressed through it
    lock_fd: int
    key_cols: tuple[str, ...]
    segments: list[_Segment] = field(default_factory=list)
    keys: pa.Table | None = None  # stored keys, kept in memory for the small tables only

    @property
    def by_step(self) -> bool:
        return "forward_ct" in self.key_cols


class Store:
    """A directory of Parquet segments with DuckDB views on top. See the module docstring.

    ``Store(root)``: every :meth:`write` is durable when it returns (one segment per run in
    the batch). ``Store(root, flush_rows=N, flush_seconds=S)``: writes are buffered per table
    and become durable when a threshold is hit (checked on write) or on :meth:`flush` /
    :meth:`close`; the Ack those return says what is now durable. Producers that emit a few
    rows per decode step (the embedded engine) should use the buffered mode; producers that
    already hand over large batches (the SGLang collector) should use the default.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        flush_rows: int | None = None,
        flush_seconds: float | None = None,
    ) -> None:
        self.root = Path(root)
        if any(c in str(self.root.resolve()) for c in "*?[]{}"):
            raise StoreError(f"store path {self.root} contains a glob character (*?[]{{}})")
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._buffered = flush_rows is not None or flush_seconds is not None
        self._buffers: dict[str, list[pa.Table]] = {}
        self._buffer_rows: dict[str, int] = {}
        self._buffer_since: dict[str, float] = {}
        self._partitions: dict[tuple[str, str], _Partition] = {}
        self._initialized = False
        self._closed = False
        self._mutex = threading.RLock()
        self._reader = Reader(self.root)
        self.skipped: tuple[segments.Skipped, ...] = ()  # files the last read left out

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batch: pa.Table) -> Ack:
        """Store a batch of ``schema.TABLES[table]``; invalid rows are refused (``Ack.rejected``).

        The batch is validated with ``schema.validate`` unless it is the very table validate
        returned (the FanOut path: validated once). Default mode: returns once every valid
        row is durable (or was already stored). Buffered mode: returns what this call
        flushed, possibly nothing yet.
        """
        with self._mutex:
            if self._closed:
                raise StoreError("store is closed")
            batch, rejected = _admit(table, batch)
            if batch.num_rows == 0:
                return Ack(rejected=rejected)
            if not self._buffered:
                return self._write_now(table, batch) + Ack(rejected=rejected)
            self._buffers.setdefault(table, []).append(batch)
            self._buffer_rows[table] = self._buffer_rows.get(table, 0) + batch.num_rows
            self._buffer_since.setdefault(table, time.monotonic())
            full = self.flush_rows is not None and self._buffer_rows[table] >= self.flush_rows
            stale = (
                self.flush_seconds is not None
                and time.monotonic() - self._buffer_since[table] >= self.flush_seconds
            )
            ack = self._flush_table(table) if full or stale else Ack()
            return ack + Ack(rejected=rejected)

    def flush(self) -> Ack:
        """Make every buffered row durable; returns what was written (the acknowledgement)."""
        with self._mutex:
            ack = Ack()
            for table in list(self._buffers):
                ack += self._flush_table(table)
            return ack

    def close(self) -> Ack:
        """Flush, then release every writer lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return Ack()
            try:
                ack = self.flush()
            finally:
                for part in self._partitions.values():
                    os.close(part.lock_fd)  # closing the descriptor drops the flock
                self._partitions.clear()
                self._closed = True
                self._reader.close()
            return ack

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_table(self, table: str) -> Ack:
        parts = self._buffers.pop(table, [])
        self._buffer_rows.pop(table, None)
        self._buffer_since.pop(table, None)
        if not parts:
            return Ack()
        try:
            return self._write_now(table, pa.concat_tables(parts))
        except BaseException:
            self._buffers[table] = parts  # nothing was acknowledged: keep it for a retry
            self._buffer_rows[table] = sum(p.num_rows for p in parts)
            self._buffer_since[table] = time.monotonic()
            raise

    def _write_now(self, table: str, batch: pa.Table) -> Ack:
        self._init_layout()
        ack = Ack()
        for run_id, rows in _split_by_run(batch):
            part = self._partition(table, run_id)
            ack += self._append(part, rows)
        return ack

    def _append(self, part: _Partition, batch: pa.Table) -> Ack:
        n_in = batch.num_rows
        batch = _dedupe_in_batch(batch, part.key_cols)
        batch = self._drop_stored(part, batch)
        if batch.num_rows == 0:
            return Ack(0, n_in, ())
        ranges = _step_ranges(batch) if part.by_step else {}
        dest = part.path / layout.new_segment_name()
        meta = {_RANGES_KEY: json.dumps({str(k): v for k, v in ranges.items()}).encode()}
        layout.write_parquet_atomic(batch, dest, meta if part.by_step else None)
        # Durable from here on: record it so later batches are checked against it.
        part.segments.append(_Segment(dest, batch.num_rows, ranges))
        if not part.by_step:
            new_keys = batch.select(list(part.key_cols))
            part.keys = new_keys if part.keys is None else pa.concat_tables([part.keys, new_keys])
        return Ack(batch.num_rows, n_in - batch.num_rows, (str(dest),))

    def _drop_stored(self, part: _Partition, batch: pa.Table) -> pa.Table:
        if not part.segments:
            return batch
        if not part.key_cols:  # runs: one row per run, and it is stored already
            return batch.slice(0, 0)
        if part.by_step:
            ranges = _step_ranges(batch)
            overlap = [
                s
                for s in part.segments
                if any(
                    d in s.ranges and s.ranges[d][0] <= hi and lo <= s.ranges[d][1]
                    for d, (lo, hi) in ranges.items()
                )
            ]
            if not overlap:  # fast path: every step is newer (or on another rank)
                return batch
            try:
                stored = _read_keys([s.path for s in overlap], ranges, part.key_cols)
            except _UNREADABLE as exc:  # footer fine, pages damaged: set it aside, re-check
                bad = _first_unreadable(part.table, [s.path for s in overlap])
                if bad is None:
                    raise StoreError(f"cannot read the stored keys of {part.path}: {exc}") from exc
                self._set_aside(part, bad, exc)
                return self._drop_stored(part, batch)
            if stored.num_rows == 0:
                return batch
        else:
            stored = part.keys
            if stored is None or stored.num_rows == 0:
                return batch
        return _anti_join(batch, stored, part.key_cols)

    # ------------------------------------------------------------------ partitions

    def _init_layout(self) -> None:
        if self._initialized:
            return
        try:
            layout.ensure_dir(self.root)
            for table, sch in schema.TABLES.items():
                ph = layout.placeholder_path(self.root, table)
                layout.remove_stale_tmp(ph.parent, only_dead=True)
                if not _placeholder_ok(ph, sch):
                    layout.ensure_dir(ph.parent)
                    layout.write_parquet_atomic(sch.empty_table(), ph)
            self._write_catalog()
        except OSError as exc:
            raise StoreError(f"cannot initialize the store at {self.root}: {exc}") from exc
        self._initialized = True

    def _write_catalog(self) -> None:
        layout.remove_stale_tmp(self.root, only_dead=True)
        text = views.catalog_sql(self.root)
        sql_path = self.root / layout.CATALOG_SQL
        db_path = self.root / layout.CATALOG_DB
        try:
            current = sql_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text or not _catalog_db_ok(db_path):
            _write_catalog_db(self.root, db_path)
        if current != text:
            layout.write_text_atomic(sql_path, text)

    def _partition(self, table: str, run_id: str) -> _Partition:
        """Lock a (table, run) for writing and load what it stores; create it if new."""
        key = (table, run_id)
        part = self._partitions.get(key)
        if part is not None:
            return part
        link = layout.partition_dir(self.root, table, run_id)
        tdir = link.parent
        layout.ensure_dir(tdir / layout.LOCK_DIR)
        layout.ensure_dir(tdir / layout.GEN_DIR)
        fd = os.open(layout.lock_path(self.root, table, run_id), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(
                f"another writer (pid {holder}) is writing table {table!r} of run {run_id!r}; "
                "a run's table takes one writer at a time"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            if link.is_symlink() and not link.exists():  # its generation is gone
                warnings.warn(
                    f"{link} pointed to a missing generation; starting the run's table afresh",
                    StoreWarning,
                    stacklevel=4,
                )
            if not link.exists():
                gen = layout.new_generation_name(link.name)
                layout.ensure_dir(tdir / layout.GEN_DIR / gen)
                layout.point_link(link, f"{layout.GEN_DIR}/{gen}")
            elif link.is_symlink() and not _leads_into(link, tdir / layout.GEN_DIR):
                raise StoreError(
                    f"{link} leads outside the store ({os.readlink(link)}); "
                    "`dspark-obs store-check --repair` sets the link aside"
                )
            elif not link.is_symlink():
                raise StoreError(
                    f"{link} is a plain directory where a symlink to a generation belongs "
                    "(copied in?); `dspark-obs store-check --repair` adopts it"
                )
            layout.clean_generations(tdir, link.name)
            layout.remove_stale_tmp(link)
            key_cols = tuple(k for k in schema.KEYS[table] if k != "run_id")
            part = _Partition(table, run_id, link, fd, key_cols)
            _load_partition(self.root, part)
        except BaseException:
            os.close(fd)
            raise
        self._partitions[key] = part
        return part

    def _set_aside(self, part: _Partition, path: Path, exc: BaseException) -> None:
        """Quarantine a segment whose data cannot be read, then reload the partition."""
        reason = f"unreadable data ({str(exc).splitlines()[0][:160]})"
        dest = layout.quarantine(self.root, path, reason)
        warnings.warn(f"{path}: {reason}; moved to {dest}", StoreWarning, stacklevel=4)
        part.segments, part.keys = [], None
        _load_partition(self.root, part)

    # ------------------------------------------------------------------ compaction

    def compact(self, table: str | None = None, run_id: str | None = None) -> list[Compaction]:
        """Merge each run's segments into one (fewer files: faster queries). Crash-safe.

        The merged segment goes into a new generation directory, then the run's symlink is
        repointed with one rename, so a listing shows the old segments or the merged one,
        never both, and a crash at any point leaves one complete generation (the other is
        removed at the next writer start). A query that listed the old segments just before
        the swap fails to open them: :meth:`query` retries; a duckdb shell user re-runs.
        Meant for finished runs; runs another process is writing are skipped (``skipped``).
        """
        with self._mutex:
            if self._closed:
                raise StoreError("store is closed")
            self.flush()
            done: list[Compaction] = []
            for t in [table] if table is not None else list(schema.TABLES):
                if t not in schema.TABLES:
                    raise StoreError(f"unknown table {t!r}; one of {sorted(schema.TABLES)}")
                runs = layout.partition_runs(self.root, t)
                for r in [run_id] if run_id is not None else runs:
                    if r not in runs:
                        continue
                    try:
                        part = self._partition(t, r)
                    except StoreError as exc:
                        if run_id is not None:
                            raise
                        done.append(Compaction(t, r, 0, 0, skipped=str(exc)))
                        continue
                    done.append(self._compact(part))
            return done

    def _compact(self, part: _Partition) -> Compaction:
        before = len(part.segments)
        rows = sum(s.rows for s in part.segments)
        if before <= 1:
            return Compaction(part.table, part.run_id, before, rows)
        tdir, pname = part.path.parent, part.path.name
        gen = layout.new_generation_name(pname)
        gdir = tdir / layout.GEN_DIR / gen
        layout.ensure_dir(gdir)
        ranges = _merge_ranges([s.ranges for s in part.segments])
        meta = {_RANGES_KEY: json.dumps({str(k): v for k, v in ranges.items()}).encode()}
        dest = gdir / layout.new_segment_name()
        sources: list[tuple[str, int]] = []
        try:
            for seg in part.segments:
                sources += segments.sources(seg.path)
        except _UNREADABLE as exc:  # footer gone since the partition was loaded
            self._set_aside(part, seg.path, exc)
            return self._compact(part)
        kept = {segments.SOURCES_KEY: json.dumps(sources).encode()}
        meta = {**meta, **kept} if part.by_step else kept
        writer = layout.SegmentWriter(dest, schema.TABLES[part.table], meta)
        try:
            for seg in part.segments:
                try:
                    data = pq.read_table(seg.path)
                except _UNREADABLE as exc:  # footer fine, pages damaged
                    writer.abort()
                    self._set_aside(part, seg.path, exc)
                    return self._compact(part)
                writer.write(_stored(part.table, data))
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        if writer.rows != rows:
            raise StoreError(f"compaction of {pname} wrote {writer.rows} rows, expected {rows}")
        layout.point_link(part.path, f"{layout.GEN_DIR}/{gen}")  # the one atomic step
        part.segments = [_Segment(part.path / dest.name, rows, ranges)]
        layout.clean_generations(tdir, pname)
        return Compaction(part.table, part.run_id, before, rows)

    # ------------------------------------------------------------------ reading

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A fresh read-only DuckDB connection, confined to the store (see
        ``store/reader.py``), with the views runs, steps, req_steps, requests and
        workload_summary over the segment globs, as ``catalog.sql`` defines them: a
        long-lived connection sees new segments as they land (empty, typed views while the
        store has no files). A damaged file fails its table's queries here until
        ``dspark-obs store-check --repair``; :meth:`query` skips it instead."""
        present = {t: _has_files(self.root, t) for t in schema.TABLES}
        return sandboxed_views(self.root, present)

    def query(self, sql: str) -> pa.Table:
        """Run read-only SQL against the views; anything that writes raises QueryRefused.

        Runs in the sandbox (read-only database, no file outside the store, no network, no
        extensions, configuration locked); a query that raced a compaction's swap is run
        again. Files that fail the store's acceptance rule (``store/segments.py``) are left
        out, and the answer says so: a StoreWarning names them with the rows they declare,
        the result's schema metadata ``dspark_obs.skipped`` lists them (JSON), and so does
        :attr:`skipped`.
        """
        check_read_only(sql)  # COPY / EXPORT into the store: the one write DuckDB allows

        def run() -> pa.Table:
            con = self._reader.cursor()
            try:
                rel = con.sql(sql)
                if rel is None:  # a statement without a result (e.g. some PRAGMAs)
                    return pa.table({})
                return _to_arrow(rel)
            finally:
                con.close()

        while True:
            try:
                result = _retry_vanished(run)
                break
            except duckdb.Error as exc:  # a segment whose pages (not footer) are damaged?
                if not self._reader.skip_if_damaged(exc):
                    raise
        self.skipped = self._reader.skipped
        if not self.skipped:
            return result
        self._warn_skipped(self.skipped)
        meta = {_SKIPPED_KEY: json.dumps([s.to_dict() for s in self.skipped]).encode()}
        return result.replace_schema_metadata({**(result.schema.metadata or {}), **meta})

    def _warn_skipped(self, skipped: tuple[segments.Skipped, ...]) -> None:
        warnings.warn(segments.summary(skipped), StoreWarning, stacklevel=3)

    def export(self, dest_dir: str | os.PathLike[str], run_id: str | None = None) -> dict[str, int]:
        """Write each table (optionally one run) to ``dest_dir/<table>.parquet``, in key order.

        Returns rows per table. Each file appears atomically (temp name, then rename). Reads
        the same accepted segments as :meth:`query`; files left out are named in a
        StoreWarning and in :attr:`skipped`.
        """
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        where = f" WHERE run_id = {views.sql_str(run_id)}" if run_id is not None else ""
        counts: dict[str, int] = {}
        con = duckdb.connect()  # COPY writes outside the store: not the reader sandbox
        skipped: dict[str, segments.Skipped] = {}
        try:
            # typed empty views first; each table's is replaced by its listing before its COPY
            for stmt in views.view_statements(self.root, dict.fromkeys(schema.TABLES, False)):
                con.execute(stmt)
            for table in schema.TABLES:
                order = ", ".join(views.ident(k) for k in schema.KEYS[table])
                final = dest / f"{table}.parquet"
                tmp = dest / f".{table}.parquet{layout.TMP_SUFFIX}"
                sql = (
                    f"COPY (SELECT * FROM {table}{where} ORDER BY {order}) TO "
                    f"{views.sql_str(tmp)} (FORMAT parquet, COMPRESSION snappy)"
                )

                def copy(table: str = table, sql: str = sql) -> None:
                    listing = self._reader.judge.listing(table)  # listed again on a retry
                    skipped.update((s.path, s) for s in listing.skipped)
                    if listing.files:
                        var = views.files_variable(table)
                        con.execute(f"SET VARIABLE {var} = ?", [list(listing.files)])
                    select = views.table_select(self.root, table, bool(listing.files), True)
                    con.execute(f"CREATE OR REPLACE VIEW {table} AS {select}")
                    con.execute(sql)

                while True:
                    try:
                        _retry_vanished(copy)
                        break
                    except duckdb.Error as exc:  # pages damaged behind an intact footer?
                        if not self._reader.skip_if_damaged(exc):
                            raise
                os.replace(tmp, final)
                counts[table] = pq.read_metadata(final).num_rows
        finally:
            con.close()
        self.skipped = tuple(skipped.values())
        if self.skipped:
            self._warn_skipped(self.skipped)
        return counts

    def info(self) -> dict[str, object]:
        """Tables (rows, segments, bytes, files left out) and runs (mode, workload, rows per
        table); ``skipped``: every file left out (path, reason, rows its footer declares)."""
        tables: dict[str, dict[str, int]] = {}
        for table, listing in self._reader.listings().items():
            files = [Path(f) for f in listing.files if layout.PLACEHOLDER_DIR not in f]
            tables[table] = {
                "segments": len(files),
                "bytes": sum(f.stat().st_size for f in files if f.exists()),
                "skipped_files": len(listing.skipped),
            }
        with warnings.catch_warnings():  # named once below, not once per query
            warnings.simplefilter("ignore", StoreWarning)
            counts = self.query(
                " UNION ALL ".join(
                    f"SELECT '{t}' AS t, count(*) AS n FROM {t}" for t in schema.TABLES
                )
            ).to_pylist()
        for row in counts:
            tables[row["t"]]["rows"] = row["n"]
        per_run = " UNION ALL ".join(
            f"SELECT run_id, '{t}' AS t, count(*) AS n FROM {t} GROUP BY run_id"
            for t in ("steps", "req_steps", "requests")
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            runs = self._info_runs(per_run)
        if self.skipped:
            self._warn_skipped(self.skipped)
        skipped = [s.to_dict() for s in self.skipped]
        return {
            "root": str(self.root.resolve()),
            "tables": tables,
            "runs": runs,
            "skipped": skipped,
        }

    def _info_runs(self, per_run: str) -> list[dict[str, object]]:
        return self.query(
            f"""
            WITH c AS ({per_run}),
            ids AS (SELECT run_id FROM runs UNION SELECT run_id FROM c)
            SELECT ids.run_id, r.mode, r.workload, r.gamma, r.source,
                   coalesce(sum(n) FILTER (WHERE t = 'steps'), 0)::BIGINT AS steps,
                   coalesce(sum(n) FILTER (WHERE t = 'req_steps'), 0)::BIGINT AS req_steps,
                   coalesce(sum(n) FILTER (WHERE t = 'requests'), 0)::BIGINT AS requests
            FROM ids LEFT JOIN runs r USING (run_id) LEFT JOIN c USING (run_id)
            GROUP BY ALL ORDER BY ids.run_id
            """
        ).to_pylist()


# ---------------------------------------------------------------------- helpers


_UNREADABLE = (OSError, pa.ArrowException)


def _first_unreadable(table: str, paths: list[Path]) -> Path | None:
    """The first of ``paths`` that does not read in full (pyarrow's errors name no file)."""
    sch = schema.TABLES[table]
    return next((p for p in paths if layout.inspect_segment(p, sch, deep=True)), None)


_VANISHED = ("No such file or directory", "Cannot open file", "No files found that match")


def _retry_vanished(fn: Callable[[], T], attempts: int = 5) -> T:
    """Run a read again if a segment it had listed vanished (a compaction swapped the run's
    generation between DuckDB's glob and its open): the next listing is consistent."""
    for attempt in range(attempts):
        try:
            return fn()
        except duckdb.IOException as exc:
            gone = any(m in str(exc) for m in _VANISHED)
            if not gone or attempt == attempts - 1:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _to_arrow(rel: duckdb.DuckDBPyRelation) -> pa.Table:
    """A relation's rows as a pyarrow.Table (DuckDB 2 renamed ``arrow`` to_arrow_table)."""
    fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
    return fetch()


def _admit(table: str, batch: pa.Table) -> tuple[pa.Table, tuple[schema.RecordError, ...]]:
    """The valid rows of a batch (validated here unless validate returned this very table)."""
    if table not in schema.TABLES:
        raise StoreError(f"unknown table {table!r}; expected one of {sorted(schema.TABLES)}")
    if not isinstance(batch, pa.Table):
        raise StoreError(f"{table}: expected a pyarrow.Table, got {type(batch).__name__}")
    if schema.is_validated(batch) and batch.schema.equals(
        schema.TABLES[table], check_metadata=False
    ):
        return batch, ()
    try:
        valid, errors = schema.validate(table, batch)
    except schema.SchemaError as exc:
        raise StoreError(str(exc)) from exc
    return valid, tuple(errors)


def _stored(table: str, data: pa.Table) -> pa.Table:
    """A stored segment in the current schema (columns added since then read as null)."""
    if data.schema.equals(schema.TABLES[table], check_metadata=False):
        return data
    return schema.to_table(table, data)[0]


def _split_by_run(batch: pa.Table) -> Iterator[tuple[str, pa.Table]]:
    col = batch.column("run_id")
    first = col[0].as_py()
    if pc.all(pc.equal(col, first)).as_py():
        yield first, batch
        return
    for run_id in pc.unique(col).to_pylist():
        yield run_id, batch.filter(pc.equal(col, run_id))


def _step_ranges(batch: pa.Table) -> dict[int, tuple[int, int]]:
    """Per dp_rank: (min, max) forward_ct of the batch."""
    if batch.num_rows == 0:  # a valid empty segment
        return {}
    dp = batch.column("dp_rank").to_numpy()
    fct = batch.column("forward_ct").to_numpy()
    if dp.min() == dp.max():
        return {int(dp[0]): (int(fct.min()), int(fct.max()))}
    out = {}
    for d in np.unique(dp):
        f = fct[dp == d]
        out[int(d)] = (int(f.min()), int(f.max()))
    return out


def _dedupe_in_batch(batch: pa.Table, key_cols: tuple[str, ...]) -> pa.Table:
    """Keep the first row of each key (vectorized; no per-row Python)."""
    n = batch.num_rows
    if n <= 1:
        return batch
    if not key_cols:
        return batch.slice(0, 1)
    if "forward_ct" in key_cols:
        dp = batch.column("dp_rank").to_numpy().astype(np.int64)
        fct = batch.column("forward_ct").to_numpy()
        packable = dp.min() >= 0 and dp.max() < (1 << 22)
        if packable and fct.min() >= 0 and fct.max() < (1 << _DP_SHIFT):
            step = (dp << _DP_SHIFT) | fct
            diff = np.diff(step)
            if "rid" not in key_cols:
                if (diff > 0).all():
                    return batch
                key = step
            else:
                rid = pc.dictionary_encode(batch.column("rid").combine_chunks())
                codes = rid.indices.to_numpy().astype(np.int64)
                # Number the steps 0..G-1 (cheap when sorted), then (step, rid) fits one int64.
                if (diff >= 0).all():
                    group = np.concatenate(([0], np.cumsum(diff != 0)))
                else:
                    group = pd.factorize(step)[0].astype(np.int64)
                key = group * len(rid.dictionary) + codes
            dup = pd.Index(key).duplicated(keep="first")
            return batch.filter(pa.array(~dup)) if dup.any() else batch
    # General (small tables, odd values): hash group-by on the key columns.
    idx = pa.array(np.arange(n, dtype=np.int64))
    first = (
        batch.select(list(key_cols))
        .append_column("__i", idx)
        .group_by(list(key_cols), use_threads=False)
        .aggregate([("__i", "min")])
        .column("__i_min")
        .to_numpy()
    )
    if len(first) == n:
        return batch
    return batch.take(pa.array(np.sort(first)))


def _anti_join(batch: pa.Table, stored: pa.Table, key_cols: tuple[str, ...]) -> pa.Table:
    """Rows of ``batch`` whose key is not in ``stored`` (batch order kept)."""
    cols = list(key_cols)
    left = batch.select(cols).append_column("__i", pa.array(np.arange(batch.num_rows)))
    right = stored.select(cols).cast(left.select(cols).schema)
    keep = left.join(right, keys=cols, join_type="left anti").column("__i").to_numpy()
    if len(keep) == batch.num_rows:
        return batch
    return batch.take(pa.array(np.sort(keep)))


def _merge_ranges(all_ranges: list[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for ranges in all_ranges:
        for d, (lo, hi) in ranges.items():
            a, b = out.get(d, (lo, hi))
            out[d] = (min(a, lo), max(b, hi))
    return out


def _read_keys(
    paths: list[Path], ranges: dict[int, tuple[int, int]], key_cols: tuple[str, ...]
) -> pa.Table:
    """Key columns of the row groups whose (dp_rank, forward_ct) statistics overlap ``ranges``
    (a compacted segment is read a row group at a time, not whole)."""
    parts = []
    for path in paths:
        pf = pq.ParquetFile(path)
        md = pf.metadata
        leaf = {md.schema.column(i).path: i for i in range(md.num_columns)}
        groups = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            fs, ds = rg.column(leaf["forward_ct"]).statistics, rg.column(leaf["dp_rank"]).statistics
            if fs is None or ds is None or not (fs.has_min_max and ds.has_min_max):
                groups.append(g)
                continue
            if any(
                ds.min <= d <= ds.max and fs.min <= hi and lo <= fs.max
                for d, (lo, hi) in ranges.items()
            ):
                groups.append(g)
        if groups:
            parts.append(pf.read_row_groups(groups, columns=list(key_cols)))
    if not parts:
        return pa.table({c: pa.array([], pa.int64()) for c in key_cols})
    return pa.concat_tables(parts, promote_options="permissive")


def _load_partition(root: Path, part: _Partition) -> None:
    """Read what a partition stores: segment footers (step ranges) or key columns.

    A segment the acceptance rule refuses (``store/segments.py``) is moved to the quarantine
    folder and named in a StoreWarning: the writer holds the partition's lock, so nobody else
    moves it.
    """
    for path in layout.segment_files(part.path):
        reason = segments.problem(root, path, part.table)
        if reason is not None:
            dest = layout.quarantine(root, path, reason)
            warnings.warn(
                f"{path}: {reason}; moved to {dest} (its rows, if any, are not in the store)",
                StoreWarning,
                stacklevel=5,
            )
            continue
        md = pq.read_metadata(path)
        ranges: dict[int, tuple[int, int]] = {}
        if part.by_step:
            try:
                raw = json.loads((md.metadata or {})[_RANGES_KEY])
                ranges = {int(k): (int(v[0]), int(v[1])) for k, v in raw.items()}
            except (KeyError, ValueError, TypeError, IndexError):  # absent or garbled
                ranges = _step_ranges(pq.read_table(path, columns=["dp_rank", "forward_ct"]))
        part.segments.append(_Segment(path, md.num_rows, ranges))
    if not part.by_step and part.key_cols and part.segments:
        part.keys = pa.concat_tables(
            [pq.read_table(s.path, columns=list(part.key_cols)) for s in part.segments]
        )


def _leads_into(link: Path, directory: Path) -> bool:
    """Whether a run's symlink resolves to a generation inside ``directory``."""
    real = Path(os.path.realpath(link))
    return real.parent == Path(os.path.realpath(directory))


def _placeholder_ok(path: Path, sch: pa.Schema) -> bool:
    try:
        return pq.read_schema(path).equals(sch, check_metadata=False)
    except (FileNotFoundError, pa.ArrowInvalid, OSError):
        return False


def _catalog_db_ok(db_path: Path) -> bool:
    """catalog.duckdb opens and has every view (else the writer rebuilds it)."""
    if not db_path.exists():
        return False
    try:
        con = duckdb.connect(str(db_path), read_only=True)
    except duckdb.Error:
        return False
    try:
        names = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views()").fetchall()}
    except duckdb.Error:
        return False
    finally:
        con.close()
    return set(views.VIEW_NAMES) <= names


def _write_catalog_db(root: Path, db_path: Path) -> None:
    """Build the views-only catalog.duckdb under a temp name and rename it into place."""
    tmp = layout.tmp_path_for(db_path)
    try:
        con = duckdb.connect(str(tmp))
        try:
            for stmt in views.view_statements(root, dict.fromkeys(schema.TABLES, True)):
                con.execute(stmt)
        finally:
            con.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, db_path)
    finally:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}.wal").unlink(missing_ok=True)
    layout.fsync_dir(db_path.parent)


def _segments_of(root: Path, table: str) -> list[Path]:
    tdir = layout.table_dir(root, table)
    try:
        parts = sorted(
            p
            for p in tdir.iterdir()
            if p.name.startswith("run_id=") and p.name != layout.PLACEHOLDER_DIR and p.is_dir()
        )
    except FileNotFoundError:
        return []
    return [f for p in parts for f in layout.segment_files(p)]


def _has_files(root: Path, table: str) -> bool:
    if layout.placeholder_path(root, table).exists():
        return True
    return bool(_segments_of(root, table))
