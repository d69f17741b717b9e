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
query with the store's one acceptance rule (``store/segments.py``), leaves the others out
(``Store.query`` names them and their row counts in a :class:`StoreWarning`), and hands DuckDB
the list through a per-cursor variable, so one bad file never makes a table unqueryable.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path

import duckdb

from dspark_obs.schema import TABLES
from dspark_obs.store import segments, views

_QUOTED_PARQUET = re.compile(r'"([^"]+\.parquet)"')
# Errors a damaged file can raise (a SQL mistake raises Binder / Parser / Catalog ... errors).
_READ_ERRORS = (
    duckdb.Error,
    duckdb.IOException,
    duckdb.InvalidInputException,
    duckdb.InternalException,
)
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
    """Cursors over the views with each table's accepted segments listed per query
    (``store/segments.py``); what was left out is in :attr:`skipped` after each cursor."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._db: duckdb.DuckDBPyConnection | None = None
        self._present: dict[str, bool] = {}
        self.judge = segments.Judge(root)
        self.skipped: tuple[segments.Skipped, ...] = ()
        self._deep_ok: set[str] = set()  # segments read in full once after a read error

    def listings(self) -> dict[str, segments.Listing]:
        """Every table's accepted segments now; also sets :attr:`skipped`."""
        out = {t: self.judge.listing(t) for t in TABLES}
        self.skipped = tuple(s for lst in out.values() for s in lst.skipped)
        return out

    def cursor(self, listed: bool = True) -> duckdb.DuckDBPyConnection:
        """A sandboxed cursor whose views read each table's accepted segments, listed now;
        ``listed=False``: the connection as it is, no listing (for SQL that names its own
        files, one segment at a time)."""
        if not listed:
            with self._lock:
                if self._db is None:
                    self._db = sandboxed_views(self.root, {}, {})
                    self._present = {}
                return self._db.cursor()
        files = {t: list(lst.files) for t, lst in self.listings().items()}
        present = views.presence(files)
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
        """Every accepted segment of ``table`` (and its schema placeholder), as paths through
        the runs' symlinks."""
        return list(self.judge.listing(table).files)

    def skip_if_damaged(self, exc: duckdb.Error) -> bool:
        """If a listed segment's data cannot be read (pages damaged behind an intact footer),
        leave it out from now on and return True (run the query again). The segments the
        error names are read in full; an error that names none and is not about the SQL
        itself has every listed segment read once."""
        named = _QUOTED_PARQUET.findall(str(exc))
        if not named and type(exc) not in _READ_ERRORS:
            return False
        found = False
        for name, verdict in self.judge.known():
            if verdict is not None or (named and name not in named) or name in self._deep_ok:
                continue
            path = Path(name)
            table = path.parent.parent.name
            reason = segments.problem(self.root, path, table, deep=True)
            if reason is None:
                self._deep_ok.add(name)
                continue
            self.judge.reject(path, reason)
            found = True
        return found
