"""Store commands: ``query`` (read-only SQL), ``export`` (Parquet), ``store-info``,
``store-compact`` and ``store-check`` (damaged or foreign files; ``--repair`` sets them aside).

The store directory comes from ``--store``, else $DSPARK_OBS_STORE, else ``./store``.
Errors print one clear line on stderr, never a traceback: exit 2 for a refused (writing)
query, 1 for anything else that went wrong.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import decimal
import json
import sys
import warnings
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import duckdb
import numpy as np
import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark_obs.store import QueryRefused, Store, StoreError, StoreWarning

STORE_ENV = "DSPARK_OBS_STORE"

StoreOpt = Annotated[
    Path,
    typer.Option(
        "--store",
        envvar=STORE_ENV,
        help=f"Store directory (default: ${STORE_ENV}, else ./store).",
        show_default=False,
    ),
]


class Format(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def _fail(message: str, code: int) -> typer.Exit:
    """Print one error line (no traceback) and return the Exit to raise."""
    Console(stderr=True).print(Text.assemble(("error: ", "bold red"), message))
    return typer.Exit(code)


@contextlib.contextmanager
def _notes() -> Iterator[None]:
    """Print every StoreWarning raised inside (files left out of an answer, files set aside)
    as one ``note:`` line on stderr, after the command's work."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StoreWarning)
        try:
            yield
        finally:
            seen = set()
            for w in caught:
                text = str(w.message)
                if issubclass(w.category, StoreWarning) and text not in seen:
                    seen.add(text)
                    Console(stderr=True).print(Text.assemble(("note: ", "yellow"), text))


def _warn_missing(root: Path) -> None:
    if not root.exists():
        note = f"no store at {root} yet; the views are empty"
        Console(stderr=True).print(Text.assemble(("note: ", "yellow"), note))


def query(
    sql: Annotated[str, typer.Argument(help="SQL over runs, steps, req_steps, requests, "
                                            "req_step_amends, workload_summary (read-only).")],
    store: StoreOpt = Path("store"),
    fmt: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.table,
    max_rows: Annotated[
        int, typer.Option("--max-rows", help="Rows shown in table format (csv/json: all).")
    ] = 200,
) -> None:
    """Run read-only SQL against the store (safe while a run is being written)."""
    _warn_missing(store)
    try:
        with _notes():
            result = Store(store).query(sql)
    except QueryRefused as exc:
        raise _fail(str(exc), 2) from None
    except (StoreError, duckdb.Error) as exc:
        raise _fail(str(exc), 1) from None
    if fmt is Format.csv:
        _print_csv(result)
    elif fmt is Format.json:
        rows = [{k: _plain(v) for k, v in r.items()} for r in _rows(result)]
        sys.stdout.write(json.dumps(rows, indent=None, ensure_ascii=False) + "\n")
    else:
        _print_table(result, max_rows)


def export(
    dest: Annotated[Path, typer.Argument(help="Directory for <table>.parquet files.")],
    store: StoreOpt = Path("store"),
    run: Annotated[str | None, typer.Option("--run", help="Export only this run_id.")] = None,
) -> None:
    """Export every table (or one run) to Parquet files, one per table, in key order."""
    if not store.exists():
        raise _fail(f"no store at {store}", 1)
    with _notes():
        _export(Store(store), store, dest, run)


def _export(s: Store, store: Path, dest: Path, run: str | None) -> None:
    try:
        if run is not None:
            known = s.query(
                "SELECT run_id FROM runs UNION SELECT DISTINCT run_id FROM steps "
                "UNION SELECT DISTINCT run_id FROM req_steps UNION SELECT DISTINCT run_id "
                "FROM requests"
            ).column("run_id").to_pylist()
            if run not in known:
                raise _fail(f"run {run!r} is not in the store at {store}", 1)
        counts = s.export(dest, run_id=run)
    except (StoreError, duckdb.Error, OSError) as exc:
        raise _fail(str(exc), 1) from None
    out = Console(soft_wrap=True)  # one line per file, paths unbroken
    for table, n in counts.items():
        out.print(f"{dest / (table + '.parquet')}: {n:,} rows", highlight=False)


def store_info(
    store: StoreOpt = Path("store"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Tables (rows, segments, size) and runs of a store."""
    if not store.exists():
        raise _fail(f"no store at {store}", 1)
    try:
        with _notes():
            info = Store(store).info()
    except (StoreError, duckdb.Error, OSError) as exc:
        raise _fail(str(exc), 1) from None
    if as_json:
        sys.stdout.write(json.dumps(info, default=_plain) + "\n")
        return
    out = Console()
    out.print(f"store: {info['root']}", highlight=False)
    tables = Table("table", "rows", "segments", "size", title="tables")
    for name, t in info["tables"].items():  # type: ignore[union-attr]
        tables.add_row(name, f"{t['rows']:,}", f"{t['segments']:,}", _size(t["bytes"]))
    out.print(tables)
    counted = ("steps", "req_steps", "requests", "amended")
    runs = Table(title="runs")
    runs.add_column("run_id", no_wrap=True)  # an id is never broken across lines
    for name in ("mode", "workload", "gamma", "source", *counted):
        runs.add_column(name)
    for r in info["runs"]:  # type: ignore[union-attr]
        labels = (Text(_cell(r[c])) for c in ("run_id", "mode", "workload", "gamma", "source"))
        runs.add_row(*labels, *(f"{r[c]:,}" for c in counted))
    out.print(runs)


def compact(
    store: StoreOpt = Path("store"),
    run: Annotated[str | None, typer.Option("--run", help="Only this run_id.")] = None,
) -> None:
    """Merge each finished run's segments into one file per table (faster queries)."""
    if not store.exists():
        raise _fail(f"no store at {store}", 1)
    try:
        with _notes(), Store(store) as s:
            done = s.compact(run_id=run)
    except (StoreError, duckdb.Error, OSError) as exc:
        raise _fail(str(exc), 1) from None
    out = Console(soft_wrap=True)
    for c in done:
        what = f"skipped ({c.skipped})" if c.skipped else (
            f"{c.segments_before} segments -> 1" if c.segments_before > 1 else "already 1 segment"
        )
        out.print(Text(f"{c.table} {c.run_id}: {c.rows:,} rows, {what}"))


def store_check(
    store: StoreOpt = Path("store"),
    fix: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Move every damaged or foreign file to <store>/.quarantine/ (never deleted; "
            "a .why.txt note beside each) and rebuild catalog.sql / catalog.duckdb.",
        ),
    ] = False,
) -> None:
    """List damaged files (truncated, zero-byte, wrong schema) and foreign files.

    Exit 0 when the store is clean (or --repair fixed everything), 1 otherwise.

    dspark-obs query skips damaged segments meanwhile; a duckdb shell fails on them.
    """
    from dspark_obs.store.check import check_store, repair

    try:
        findings = check_store(store)
        repairs = repair(store, findings) if fix else []
    except (StoreError, duckdb.Error, OSError) as exc:
        raise _fail(str(exc), 1) from None
    out = Console(soft_wrap=True)  # one finding per line, paths unbroken
    if not findings:
        out.print(f"store {store}: no damaged or foreign files", highlight=False)
        return
    if not fix:
        for f in findings:
            out.print(Text(str(f)))
        out.print(f"{len(findings)} finding(s); `dspark-obs store-check --repair` sets them "
                  "aside in the quarantine folder", highlight=False)
        raise typer.Exit(1)
    left = 0
    for r in repairs:
        where = f" -> {r.dest}" if r.dest is not None else ""
        out.print(Text(f"{r.finding}: {r.note}{where}"))
        left += r.dest is None and r.note not in ("rebuilt", "already gone")
    if left:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the store commands to the ``dspark-obs`` app."""
    app.command("query")(query)
    app.command("export")(export)
    app.command("store-info")(store_info)
    app.command("store-compact")(compact)
    app.command("store-check")(store_check)


# ---------------------------------------------------------------------- formatting


def _plain(v: Any) -> Any:
    """A JSON-friendly value (timestamps as ISO strings, decimals as numbers)."""
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _rows(result: pa.Table) -> list[dict[str, Any]]:
    """Rows as Python values; float32 values print as stored (0.7459, not 0.745899975...)."""
    rows = result.to_pylist()
    fields = [f for f in result.schema if _has_float32(f.type)]
    for row in rows:
        for f in fields:
            row[f.name] = _f32(row[f.name], f.type)
    return rows


def _has_float32(t: pa.DataType) -> bool:
    if pa.types.is_float32(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_float32(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_float32(t.field(i).type) for i in range(t.num_fields))
    return False


def _f32(v: Any, t: pa.DataType) -> Any:
    if v is None:
        return None
    if pa.types.is_float32(t):
        return float(str(np.float32(v)))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [_f32(x, t.value_type) for x in v]
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        return {f.name: _f32(v[f.name], f.type) for f in fields}
    return v


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list | dict):
        return json.dumps(_plain(v))
    return str(_plain(v))


def _print_csv(result: pa.Table) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(result.column_names)
    for row in _rows(result):
        w.writerow(
            "" if v is None else json.dumps(_plain(v)) if isinstance(v, list | dict) else _plain(v)
            for v in row.values()
        )


def _print_table(result: pa.Table, max_rows: int) -> None:
    table = Table(*result.column_names, show_lines=False)
    for row in _rows(result.slice(0, max_rows)):
        table.add_row(*(Text(_cell(v)) for v in row.values()))  # Text: no markup parsing
    out = Console()
    out.print(table)
    more = result.num_rows - max_rows
    tail = f" (showing {max_rows:,}; --max-rows or --format csv for all)" if more > 0 else ""
    out.print(f"{result.num_rows:,} rows{tail}", highlight=False)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
