"""The store's own files beside the segments: each table's zero-row schema placeholder (it
keeps a table's glob non-empty), ``catalog.sql`` and ``catalog.duckdb`` (the views for a
duckdb shell, ``store/views.py``). Writers keep them current; ``store-check --repair``
rebuilds them.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from dspark_obs import schema
from dspark_obs._atomic import write_text_atomic
from dspark_obs.store import layout, views
from dspark_obs.store.layout import StoreError

__all__ = ["catalog_db_ok", "init_store", "write_catalog", "write_catalog_db"]


def init_store(root: Path) -> None:
    """Create the store's directories, each table's schema placeholder and the catalog files
    (those that are missing or stale)."""
    try:
        layout.ensure_dir(root)
        for table, sch in schema.TABLES.items():
            ph = layout.placeholder_path(root, table)
            layout.remove_stale_tmp(ph.parent, only_dead=True)
            if not placeholder_ok(ph, sch):
                layout.ensure_dir(ph.parent)
                layout.write_parquet_atomic(sch.empty_table(), ph)
        write_catalog(root)
    except OSError as exc:
        raise StoreError(f"cannot initialize the store at {root}: {exc}") from exc


def write_catalog(root: Path) -> None:
    """Rewrite catalog.sql when its text changed, and catalog.duckdb when either changed or
    the database does not open with every view."""
    layout.remove_stale_tmp(root, only_dead=True)
    text = views.catalog_sql(root)
    sql_path = root / layout.CATALOG_SQL
    db_path = root / layout.CATALOG_DB
    try:
        current = sql_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    if current != text or not catalog_db_ok(db_path):
        write_catalog_db(root, db_path)
    if current != text:
        write_text_atomic(sql_path, text, durable=True)


def placeholder_ok(path: Path, sch: pa.Schema) -> bool:
    try:
        return pq.read_schema(path).equals(sch, check_metadata=False)
    except (FileNotFoundError, pa.ArrowInvalid, OSError):
        return False


def catalog_db_ok(db_path: Path) -> bool:
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


def write_catalog_db(root: Path, db_path: Path) -> None:
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
