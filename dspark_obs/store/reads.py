"""The store's read side: read-only SQL over the views, export, info, and per-segment reads.

Every read lists each table's accepted segments with the store's one acceptance rule
(``store/segments.py``), runs in the query sandbox (``store/reader.py``: read-only, confined to
the store) and says what it left out (a StoreWarning, :attr:`Reads.skipped`, the result's
schema metadata). A read that raced a compaction's swap (it listed a segment the swap then
removed) lists again and retries.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from dspark_obs import schema
from dspark_obs.store import layout, segments, views
from dspark_obs.store.guard import check_read_only
from dspark_obs.store.layout import StoreError, StoreWarning
from dspark_obs.store.reader import Reader, sandboxed_views

__all__ = ["SKIPPED_KEY", "Reads"]

T = TypeVar("T")
SKIPPED_KEY = b"dspark_obs.skipped"  # query results: files left out (JSON list)


class Reads:
    """Reads of the store at ``root`` (what :class:`~dspark_obs.store.Store` delegates to);
    :attr:`skipped`: the files the last read left out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._reader = Reader(root)
        self.skipped: tuple[segments.Skipped, ...] = ()

    def close(self) -> None:
        self._reader.close()

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
        meta = {SKIPPED_KEY: json.dumps([s.to_dict() for s in self.skipped]).encode()}
        return result.replace_schema_metadata({**(result.schema.metadata or {}), **meta})

    def segments(self, table: str) -> segments.Listing:
        """The accepted segments of ``table`` now (the schema placeholder left out), and every
        file the acceptance rule left out (``store/segments.py``): for readers that keep a
        partial result per segment (segments are immutable, so a partial stays true)."""
        if table not in schema.TABLES:
            raise StoreError(f"unknown table {table!r}; expected one of {sorted(schema.TABLES)}")
        listing = self._reader.judge.listing(table)
        files = tuple(f for f in listing.files if layout.PLACEHOLDER_DIR not in f)
        return segments.Listing(files, listing.skipped)

    def query_segment(self, table: str, segment: str, sql: str) -> pa.Table | None:
        """Run read-only ``sql`` over one accepted segment of ``table``: ``{segment}`` in the
        SQL reads that file (with its hive ``run_id``). In the query sandbox, like
        :meth:`query`. Returns None when the segment is no longer one (a compaction retired
        it, or its pages turned out damaged: the next :meth:`segments` lists it as left out);
        a path that was never one of the table's accepted segments is a StoreError."""
        path = Path(segment)
        tdir = Path(os.path.realpath(self.root)) / table
        shaped = (
            table in schema.TABLES
            and path.parent.parent == tdir
            and path.parent.name.startswith("run_id=")
            and path.parent.name != layout.PLACEHOLDER_DIR
            and path.name.startswith(layout.SEGMENT_PREFIX)
            and path.name.endswith(layout.SEGMENT_SUFFIX)
        )
        if not shaped:
            raise StoreError(f"{segment} is not a segment of table {table!r} in {self.root}")
        verdict = self._reader.judge.verdict(path, table)
        if verdict == "vanished":
            return None
        if verdict is not None:
            raise StoreError(f"{segment} is left out of table {table!r}: {verdict}")
        var = "dspark_segment"
        text = sql.format(
            segment=f"read_parquet(getvariable('{var}'), hive_partitioning = true, "
            "hive_types = {'run_id': VARCHAR})"
        )
        check_read_only(text)
        con = self._reader.cursor(listed=False)
        try:
            con.execute(f"SET VARIABLE {var} = ?", [[segment]])
            rel = con.sql(text)
            return pa.table({}) if rel is None else _to_arrow(rel)
        except duckdb.Error as exc:
            gone = isinstance(exc, duckdb.IOException) and any(m in str(exc) for m in _VANISHED)
            if gone or self._reader.skip_if_damaged(exc):
                return None
            raise
        finally:
            con.close()

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
                    # listed again on a retry, with the tables the view reads (amendments)
                    files: dict[str, list[str]] = {}
                    for t in (*views.DEPENDS.get(table, ()), table):
                        listing = self._reader.judge.listing(t)
                        skipped.update((s.path, s) for s in listing.skipped)
                        files[t] = list(listing.files)
                        if listing.files:
                            var = views.files_variable(t)
                            con.execute(f"SET VARIABLE {var} = ?", [files[t]])
                    present = views.presence(files)
                    for t in files:
                        con.execute(views.view_statement(self.root, t, present, True))
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
            for t in ("steps", "req_steps", "requests", "req_step_amends")
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
                   coalesce(sum(n) FILTER (WHERE t = 'requests'), 0)::BIGINT AS requests,
                   coalesce(sum(n) FILTER (WHERE t = 'req_step_amends'), 0)::BIGINT
                       AS amended
            FROM ids LEFT JOIN runs r USING (run_id) LEFT JOIN c USING (run_id)
            GROUP BY ALL ORDER BY ids.run_id
            """
        ).to_pylist()


_VANISHED = ("No such file or directory", "Cannot open file", "No files found that match")


def _retry_vanished(fn: Callable[[], T], attempts: int = 40) -> T:
    """Run a read again if a segment it had listed vanished (a compaction swapped the run's
    generation between the listing and DuckDB's open): the next listing is consistent.

    A writer that compacts every few batches can win that race several times in a row on a
    loaded machine, so the wait grows (to 0.25 s) and the attempts are many: a query gives
    up only after about eight seconds of losing every race."""
    for attempt in range(attempts):
        try:
            return fn()
        except duckdb.IOException as exc:
            gone = any(m in str(exc) for m in _VANISHED)
            if not gone or attempt == attempts - 1:
                raise
            time.sleep(min(0.005 * 2**attempt, 0.25))
    raise AssertionError("unreachable")


def _to_arrow(rel: duckdb.DuckDBPyRelation) -> pa.Table:
    """A relation's rows as a pyarrow.Table (DuckDB 2 renamed ``arrow`` to_arrow_table)."""
    fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
    return fetch()


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
