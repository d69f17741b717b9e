"""The query sandbox: read-only DuckDB connections confined to the store.

Every connection the store hands out for reading (:meth:`Store.query`, :meth:`Store.connect`,
and through them ``dspark-obs query``, the report and the servers) is opened on a views-only
database file in DuckDB's read-only mode, with:

* ``allowed_directories = [<store root>]`` and ``enable_external_access = false``: no file
  outside the store, no network, no ATTACH of another database;
* ``autoinstall_known_extensions = false``, ``autoload_known_extensions = false``: no
  extension is fetched or loaded (``INSTALL`` / ``LOAD`` are refused as external access);
* ``lock_configuration = true``: no statement can change any of the above (or any setting).

So DuckDB itself refuses a write however it is hidden (in a CTE, under EXPLAIN ANALYZE, as
the second of several statements): the database is read-only. What the read-only mode does
not cover is a COPY ... TO a path inside the store; ``guard.check_read_only`` refuses COPY
and EXPORT by statement type (DuckDB's parser), and ``Store.query`` runs that guard first.

:class:`Reader` is what ``Store.query`` uses: it lists each table's segments itself on every
query, leaves damaged ones out (named once in a :class:`StoreWarning`), and hands DuckDB the
list through a per-cursor variable, so one bad file never makes a table unqueryable.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

import duckdb

from dspark_obs.schema import TABLES
from dspark_obs.store import layout, views
from dspark_obs.store.layout import StoreWarning

_QUOTED_PARQUET = re.compile(r'"([^"]+\.parquet)"')
# Errors a damaged file can raise (a SQL mistake raises Binder / Parser / Catalog ... errors).
_READ_ERRORS = (duckdb.Error, duckdb.IOException, duckdb.InvalidInputException,
                duckdb.InternalException)
_CONFIG = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}


def sandboxed_views(
    root: Path, present: dict[str, bool], files: dict[str, list[str]] | None = None
) -> duckdb.DuckDBPyConnection:
    """A read-only, store-confined connection whose views read the segment globs, or (given
    ``files``) the lists in each table's :func:`views.files_variable`."""
    root = root.resolve()
    tmp_dir = tempfile.mkdtemp(prefix="dspark-obs-views-")
    path = os.path.join(tmp_dir, "views.duckdb")
    try:
        con = duckdb.connect(path)
        try:
            for table, listed in (files or {}).items():
                if listed:
                    con.execute(f"SET VARIABLE {views.files_variable(table)} = ?", [listed])
            for stmt in views.view_statements(root, present, listed=files is not None):
                con.execute(stmt)
        finally:
            con.close()
        ro = duckdb.connect(path, read_only=True, config=_CONFIG)
    finally:  # the open read-only database keeps its (unlinked) file
        for name in os.listdir(tmp_dir):
            os.unlink(os.path.join(tmp_dir, name))
        os.rmdir(tmp_dir)
    try:
        ro.execute(f"SET allowed_directories = [{views.sql_str(str(root) + os.sep)}]")
        ro.execute("SET enable_external_access = false")
        ro.execute("SET GLOBAL TimeZone = 'UTC'")
        ro.execute("SET lock_configuration = true")
    except BaseException:
        ro.close()
        raise
    return ro


class Reader:
    """Cursors over the views with each table's good segments listed per query."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._db: duckdb.DuckDBPyConnection | None = None
        self._present: dict[str, bool] = {}
        self._verdicts: dict[str, tuple[tuple[int, int, int], str | None]] = {}
        self._warned: set[str] = set()
        self._deep_ok: set[str] = set()  # segments read in full once after a read error

    def cursor(self) -> duckdb.DuckDBPyConnection:
        files = {t: self.good_files(t) for t in TABLES}
        present = {t: bool(f) for t, f in files.items()}
        with self._lock:
            if self._db is None or present != self._present:
                old, self._db = self._db, sandboxed_views(self.root, present, files)
                self._present = present
                if old is not None:
                    old.close()
            cur = self._db.cursor()
        try:
            for table, listed in files.items():
                if listed:
                    cur.execute(f"SET VARIABLE {views.files_variable(table)} = ?", [listed])
        except BaseException:
            cur.close()
            raise
        return cur

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def good_files(self, table: str) -> list[str]:
        """Every readable segment of ``table`` (and its schema placeholder), as paths
        through the runs' symlinks; a damaged one is left out and named in a warning."""
        tdir = self.root.resolve() / table
        try:
            runs = sorted(n for n in os.listdir(tdir) if n.startswith("run_id="))
        except FileNotFoundError:
            return []
        out = []
        for run in runs:
            for path in layout.segment_files(tdir / run):
                if self._verdict(path) is None:
                    out.append(str(path))
        return out

    def skip_if_damaged(self, exc: duckdb.Error) -> bool:
        """If a listed segment's data cannot be read (pages damaged behind an intact footer),
        leave it out from now on and return True (run the query again). The segments the
        error names are read in full; an error that names none and is not about the SQL
        itself has every listed segment read once."""
        named = _QUOTED_PARQUET.findall(str(exc))
        if not named and type(exc) not in _READ_ERRORS:
            return False
        found = False
        for name, (key, verdict) in list(self._verdicts.items()):
            if verdict is not None or (named and name not in named) or name in self._deep_ok:
                continue
            path = Path(name)
            reason = layout.inspect_segment(path, TABLES[path.parent.parent.name], deep=True)
            if reason is None:
                self._deep_ok.add(name)
                continue
            self._verdicts[name] = (key, reason)
            self._warn(path, reason)
            found = True
        return found

    def _warn(self, path: Path, reason: str) -> None:
        if str(path) in self._warned:
            return
        self._warned.add(str(path))
        warnings.warn(
            f"skipped a damaged store file {path}: {reason}; "
            "`dspark-obs store-check --repair` moves it to the quarantine folder",
            StoreWarning,
            stacklevel=5,
        )

    def _verdict(self, path: Path) -> str | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return "vanished"
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._verdicts.get(str(path))
        if cached is not None and cached[0] == key:
            return cached[1]
        table = path.parent.parent.name
        reason = layout.inspect_segment(path, TABLES[table])
        self._verdicts[str(path)] = (key, reason)
        if reason is not None:
            self._warn(path, reason)
        return reason
