"""The store: crash-safe, append-only Parquet segments that never block readers.

Why not one DuckDB database file: a DuckDB file opened for writing locks every other process
out, and a dashboard or a user's shell must be able to read while a run is being written.
So each acknowledged write is an immutable Parquet segment (atomically renamed into a
per-run directory), and readers are DuckDB views over the accepted segments.

:class:`Store` is the facade over the store's parts, one concept a module: writing one
(table, run) under its lock (``partition.py``), which rows are new (``dedupe.py``),
compaction (``compaction.py``), the placeholder and catalog files (``catalog_files.py``),
reads (``reads.py``), which files count (``segments.py``), the query sandbox
(``reader.py``) and where files live (``layout.py``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from dspark_obs import schema, validation
from dspark_obs.store import layout, segments
from dspark_obs.store.catalog_files import init_store
from dspark_obs.store.compaction import Compaction, compact_partition
from dspark_obs.store.layout import StoreError
from dspark_obs.store.partition import Ack, Partition, open_partition
from dspark_obs.store.reads import Reads
from dspark_obs.validation import RecordError, ValidatedBatch

__all__ = ["Store"]


class Store:
    """A directory of Parquet segments with DuckDB views on top. See the module docstring.

    ``Store(root)``: every :meth:`write` is durable when it returns (one segment per run in
    the batch). ``Store(root, flush_rows=N, flush_seconds=S)``: writes are buffered per table
    and become durable when a threshold is hit (checked on write) or on :meth:`flush` /
    :meth:`close`; the Ack those return says what is now durable. Producers that emit a few
    rows per decode step (the embedded engine) should use the buffered mode; producers that
    already hand over large batches (the SGLang collector) should use the default.
    """

    takes_validated = True
    """A FanOut hands this sink ``validation.check``'s ValidatedBatch (not re-checked)."""

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
        self._partitions: dict[tuple[str, str], Partition] = {}
        self._initialized = False
        self._closed = False
        self._mutex = threading.RLock()
        self._reads = Reads(self.root)

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batch: pa.Table | ValidatedBatch) -> Ack:
        """Store a batch of ``schema.TABLES[table]``; invalid rows are refused (``Ack.rejected``).

        A :class:`~dspark_obs.validation.ValidatedBatch` (from ``validation.check``) is stored
        as it is; a pyarrow.Table is validated first. Default mode: returns once every valid
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
                    part.close()
                self._partitions.clear()
                self._closed = True
                self._reads.close()
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
        if not self._initialized:
            init_store(self.root)
            self._initialized = True
        ack = Ack()
        for run_id, rows in _split_by_run(batch):
            ack += self._partition(table, run_id).append(rows)
        return ack

    def _partition(self, table: str, run_id: str) -> Partition:
        """The (table, run) this store holds for writing, locked on first use."""
        key = (table, run_id)
        part = self._partitions.get(key)
        if part is None:
            part = self._partitions[key] = open_partition(self.root, table, run_id)
        return part

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
                    done.append(compact_partition(part))
            return done

    # ------------------------------------------------------------------ reading

    @property
    def skipped(self) -> tuple[segments.Skipped, ...]:
        """The files the last read (query, export, info) left out."""
        return self._reads.skipped

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A fresh read-only, store-confined DuckDB connection over the segment globs, as
        ``catalog.sql`` defines the views (:meth:`Reads.connect`)."""
        return self._reads.connect()

    def query(self, sql: str) -> pa.Table:
        """Read-only SQL against the views; files left out are named (:meth:`Reads.query`)."""
        return self._reads.query(sql)

    def segments(self, table: str) -> segments.Listing:
        """The accepted segments of ``table`` and the files left out (:meth:`Reads.segments`)."""
        return self._reads.segments(table)

    def query_segment(self, table: str, segment: str, sql: str) -> pa.Table | None:
        """Read-only SQL over one accepted segment (:meth:`Reads.query_segment`)."""
        return self._reads.query_segment(table, segment, sql)

    def export(self, dest_dir: str | os.PathLike[str], run_id: str | None = None) -> dict[str, int]:
        """Each table (or one run) to ``dest_dir/<table>.parquet`` (:meth:`Reads.export`)."""
        return self._reads.export(dest_dir, run_id)

    def info(self) -> dict[str, object]:
        """Tables, runs and the files left out (:meth:`Reads.info`)."""
        return self._reads.info()


def _admit(
    table: str, batch: pa.Table | ValidatedBatch
) -> tuple[pa.Table, tuple[RecordError, ...]]:
    """The valid rows of a batch: a ValidatedBatch of this table as it is (``check`` made it),
    anything else validated here."""
    if table not in schema.TABLES:
        raise StoreError(f"unknown table {table!r}; expected one of {sorted(schema.TABLES)}")
    if isinstance(batch, ValidatedBatch):
        if batch.table != table:
            raise StoreError(f"{table}: given a batch validated as {batch.table!r}")
        return batch.data, ()
    if not isinstance(batch, pa.Table):
        raise StoreError(f"{table}: expected a pyarrow.Table, got {type(batch).__name__}")
    try:
        valid, errors = validation.validate(table, batch)
    except validation.SchemaError as exc:
        raise StoreError(str(exc)) from exc
    return valid, tuple(errors)


def _split_by_run(batch: pa.Table) -> Iterator[tuple[str, pa.Table]]:
    col = batch.column("run_id")
    first = col[0].as_py()
    if pc.all(pc.equal(col, first)).as_py():
        yield first, batch
        return
    for run_id in pc.unique(col).to_pylist():
        yield run_id, batch.filter(pc.equal(col, run_id))
