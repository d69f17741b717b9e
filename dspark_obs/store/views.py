"""The SQL views readers see: one per table over its Parquet segments, plus workload_summary.

``req_steps`` is the one view that is more than its segments: it merges ``req_step_amends``
(estimator lines that arrived after their request-step was stored) onto the rows, by the
rule in :data:`AMEND_RULE`.

The same statements go to three places: every :meth:`Store.connect` connection,
``root/catalog.sql`` (``.read`` it in a duckdb shell) and ``root/catalog.duckdb``. Views
re-expand their glob on every query, so a long-lived connection sees new segments as soon as
they are renamed into place.
"""

from __future__ import annotations

import functools
from pathlib import Path

import duckdb

from dspark_obs.schema import AMENDED_FIELDS, KEYS, TABLES
from dspark_obs.store import layout

VIEW_NAMES = (*TABLES, "workload_summary")
AMENDS = "req_step_amends"
AMENDED = "req_steps"
# Views that read another table's view: list the dependency's files with the view's own.
DEPENDS: dict[str, tuple[str, ...]] = {AMENDED: (AMENDS,)}

AMEND_RULE = """An amendment (a late estimator line) sets trimmed_tokens, q_lp and pg of the
req_steps row with its key when that row was stored without any of the three and has the
amendment's gamma and verify_len (the collector copies both from the row). A row stored with
estimator fields keeps them: the first fact stored wins, and a second amendment of a key is
a duplicate the writer drops (a key is stored at most once)."""

# Per run and workload: how many steps and requests, the mean window, the mean committed
# length and, where it was measured, the mean ceiling (acc_len + cap_trim, what a full-block
# verify would have committed) and utilization as a ratio of sums (never a mean of per-step
# ratios). The ceiling is measured only where the whole block was verified: cap-accept
# (cap_trim observed) and static (commits the whole block, ceiling = committed). A compact
# run's ceiling is hidden, so its ceiling columns are NULL and ceiling_source says 'hidden'
# (its estimate comes from the block-accept estimator, or its cap-accept companion's row);
# without a runs row the mode, hence the ceiling, is 'unknown'.
WORKLOAD_SUMMARY_SQL = """
SELECT
    s.run_id,
    coalesce(s.workload, r.workload, 'unknown') AS workload,
    any_value(r.mode) AS mode,
    count(DISTINCT (s.dp_rank, s.forward_ct)) AS steps,
    count(*) AS req_steps,
    count(DISTINCT s.rid) AS requests,
    avg(s.verify_len) AS mean_verify_len,
    avg(s.acc_len) AS mean_acc_len,
    avg(s.acc_len + coalesce(s.cap_trim, 0)) FILTER (WHERE r.mode IN ('cap-accept', 'static'))
        AS mean_ceiling,
    sum(s.acc_len)::BIGINT AS committed_tokens,
    sum(s.acc_len + coalesce(s.cap_trim, 0)) FILTER (WHERE r.mode IN ('cap-accept', 'static'))
        ::BIGINT AS ceiling_tokens,
    sum(s.acc_len) FILTER (WHERE r.mode IN ('cap-accept', 'static'))
        / nullif(sum(s.acc_len + coalesce(s.cap_trim, 0))
                 FILTER (WHERE r.mode IN ('cap-accept', 'static')), 0) AS utilization,
    CASE WHEN any_value(r.mode) IN ('cap-accept', 'static') THEN 'measured'
         WHEN any_value(r.mode) IS NULL THEN 'unknown'
         ELSE 'hidden' END AS ceiling_source
FROM req_steps AS s
LEFT JOIN runs AS r USING (run_id)
GROUP BY s.run_id, coalesce(s.workload, r.workload, 'unknown')
"""


def sql_str(value: str | Path) -> str:
    """A SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@functools.cache
def duckdb_types(table: str) -> tuple[tuple[str, str], ...]:
    """(column, DuckDB type) of a table, derived from its Arrow schema by DuckDB itself."""
    con = duckdb.connect()
    try:
        empty = TABLES[table].empty_table()  # noqa: F841 - read by DuckDB's replacement scan
        rows = con.execute("DESCRIBE SELECT * FROM empty").fetchall()
    finally:
        con.close()
    return tuple((r[0], r[1]) for r in rows)


def files_variable(table: str) -> str:
    """The DuckDB variable that holds a table's file list in :meth:`Store.query`'s views."""
    return f"dspark_files_{table}"


def table_select(root: Path, table: str, has_files: bool, listed: bool = False) -> str:
    """SELECT over a table's segments; a typed empty SELECT when there are no files at all.

    ``listed``: read the files named by the variable :func:`files_variable` (a list the
    caller sets per query, damaged files left out) instead of the segment glob.
    """
    cols = ", ".join(ident(c) for c in TABLES[table].names)
    if not has_files:
        typed = ", ".join(f"CAST(NULL AS {t}) AS {ident(c)}" for c, t in duckdb_types(table))
        return f"SELECT {typed} WHERE false"
    files = (
        f"getvariable({sql_str(files_variable(table))})"
        if listed
        else sql_str(layout.segment_glob(root, table))
    )
    src = (
        f"read_parquet({files}, hive_partitioning = true, "
        "union_by_name = true, hive_types = {'run_id': VARCHAR})"
    )
    if listed:
        return f"SELECT {cols} FROM {src}"
    # A glob (catalog files, Store.connect) cannot apply the acceptance rule file by file;
    # it can keep a foreign file's rows that lack a required column out of every answer.
    required = " AND ".join(f"{ident(f.name)} IS NOT NULL" for f in TABLES[table] if not f.nullable)
    return f"SELECT {cols} FROM {src} WHERE {required}"


def view_select(root: Path, table: str, present: dict[str, bool], listed: bool = False) -> str:
    """The SELECT behind ``table``'s view: its segments, and for ``req_steps`` the
    amendments merged (:data:`AMEND_RULE`) when ``req_step_amends`` has files."""
    raw = table_select(root, table, present.get(table, False), listed)
    if table != AMENDED or not present.get(table) or not present.get(AMENDS):
        return raw
    key = " AND ".join(f"s.{ident(k)} = a.{ident(k)}" for k in KEYS[AMENDED])
    bare = " AND ".join(f"s.{ident(f)} IS NULL" for f in AMENDED_FIELDS)
    amend = f"a.rid IS NOT NULL AND {bare} AND a.gamma = s.gamma AND a.verify_len = s.verify_len"
    cols = ", ".join(
        f"CASE WHEN {amend} THEN a.{ident(c)} ELSE s.{ident(c)} END AS {ident(c)}"
        if c in AMENDED_FIELDS
        else f"s.{ident(c)}"
        for c in TABLES[table].names
    )
    return f"SELECT {cols} FROM ({raw}) AS s LEFT JOIN {AMENDS} AS a ON {key}"


def view_statement(root: Path, table: str, present: dict[str, bool], listed: bool = False) -> str:
    """CREATE OR REPLACE VIEW for one table (its dependencies' views must exist first)."""
    return f"CREATE OR REPLACE VIEW {table} AS {view_select(root, table, present, listed)}"


def presence(files: dict[str, list[str]]) -> dict[str, bool]:
    """Which tables have files for a listed view; amendments count only with a real segment
    (the schema placeholder alone would cost every req_steps query a join for nothing)."""
    out = {t: bool(f) for t, f in files.items()}
    if AMENDS in out:
        out[AMENDS] = any(layout.PLACEHOLDER_DIR not in f for f in files[AMENDS])
    return out


def view_order() -> list[str]:
    """Tables in an order where every view comes after the views it reads."""
    return sorted(TABLES, key=lambda t: t in DEPENDS)


def view_statements(root: Path, present: dict[str, bool], listed: bool = False) -> list[str]:
    """CREATE VIEW statements for every view; ``present[table]``: the table has files."""
    stmts = [view_statement(root, t, present, listed) for t in view_order()]
    stmts.append(f"CREATE OR REPLACE VIEW workload_summary AS {WORKLOAD_SUMMARY_SQL.strip()}")
    return stmts


def catalog_sql(root: Path) -> str:
    """The text of ``root/catalog.sql`` (absolute paths, so it works from any directory)."""
    root = root.resolve()
    head = [
        "-- dspark-obs store catalog: read-only views over this store's Parquet segments.",
        f'--   duckdb -c ".read {root / layout.CATALOG_SQL}" -c "FROM workload_summary"',
        f"--   duckdb -readonly {root / layout.CATALOG_DB}",
        "-- Views re-read the segment globs on every query: new segments appear as they land.",
        "-- Keys (a row with the same key is the same fact): "
        + "; ".join(f"{t}({', '.join(k)})" for t, k in KEYS.items()),
        "-- Timestamps (ts, started_at) are UTC; show them as such.",
        *("-- " + line for line in AMEND_RULE.splitlines()),
        "SET TimeZone = 'UTC';",
    ]
    body = [s + ";" for s in view_statements(root, dict.fromkeys(TABLES, True))]
    return "\n".join(head + body) + "\n"
