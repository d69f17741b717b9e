"""Refuse SQL that writes, before it runs: the store is written only through Store.write.

DuckDB's own parser classifies each statement; only reads pass: SELECT (which covers WITH,
FROM-first, VALUES, DESCRIBE, SHOW, SUMMARIZE), EXPLAIN of a read, and a short list of
PRAGMAs that only report. Everything else (INSERT, UPDATE, DELETE, CREATE, DROP, ALTER,
COPY, EXPORT, ATTACH, SET, CALL, LOAD, writing PRAGMAs ...) is refused by name.

The reader sandbox (``reader.py``) already makes DuckDB refuse every write to the database
and every file outside the store; this guard gives the refusal a clear message, and it is
what refuses the one write the sandbox allows: COPY / EXPORT to a path inside the store.
"""

from __future__ import annotations

import re
import threading

import duckdb

from dspark_obs.store.layout import StoreError

_READ_PRAGMAS = frozenset(
    {
        "collations",
        "database_list",
        "database_size",
        "functions",
        "metadata_info",
        "platform",
        "show",
        "show_databases",
        "show_tables",
        "show_tables_expanded",
        "storage_info",
        "table_info",
        "user_agent",
        "version",
    }
)
_EXPLAIN = re.compile(r"^\s*explain(\s+analy[sz]e)?\b", re.IGNORECASE)
_PRAGMA = re.compile(r"^\s*pragma\s+([a-z_][a-z0-9_]*)", re.IGNORECASE)


class QueryRefused(StoreError):
    """A query was refused because it would write (or change state)."""


_parser: duckdb.DuckDBPyConnection | None = None
_parser_lock = threading.Lock()


def check_read_only(sql: str) -> None:
    """Raise QueryRefused naming the first statement kind that is not a pure read."""
    global _parser
    with _parser_lock:  # one parser connection per process: opening DuckDB costs ~10 ms
        if _parser is None:
            _parser = duckdb.connect()
        _check(_parser, sql, depth=0)


def _check(parser: duckdb.DuckDBPyConnection, sql: str, depth: int) -> None:
    try:
        statements = parser.extract_statements(sql)
    except duckdb.Error as exc:
        raise StoreError(f"cannot parse query: {exc}") from None
    if not statements:
        raise StoreError("empty query")
    for st in statements:
        kind = st.type.name
        text = st.query.strip()
        if kind == "SELECT":
            continue
        if kind == "EXPLAIN" and depth == 0:
            m = _EXPLAIN.match(text)
            if m:
                _check(parser, text[m.end() :], depth + 1)
                continue
        if kind == "PRAGMA":
            m = _PRAGMA.match(text)
            name = m.group(1).lower() if m else text.split()[0].lower()
            if m and name in _READ_PRAGMAS:
                continue
            raise QueryRefused(
                f"the store is read-only: refused a PRAGMA statement ({name}); "
                f"allowed: SELECT, EXPLAIN and the reporting PRAGMAs {sorted(_READ_PRAGMAS)}"
            )
        short = text if len(text) <= 60 else text[:57] + "..."
        if kind == "MULTI":  # e.g. PIVOT without IN: DuckDB creates an ENUM type first
            raise QueryRefused(
                f"the store is read-only: refused a MULTI statement ({short!r}), which creates "
                "objects before it reads; for PIVOT, list the values: PIVOT ... ON col IN (...)"
            )
        raise QueryRefused(
            f"the store is read-only: refused a {kind} statement ({short!r}); "
            "only SELECT / EXPLAIN / reporting PRAGMAs run here, and data enters the store "
            "through Store.write"
        )
