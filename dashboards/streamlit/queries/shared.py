"""What every page's queries share: the sidebar's filters, the runs table, how a ceiling is known.

The filter rule is written once, as SQL (:meth:`Filters.where`): the per-run pages put it in
their query over the store, and the all-runs pages, which add up per-segment rollups
(rollups.py) instead of scanning the store, have DuckDB run the same predicate over the
rollups' keys (:func:`select`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from dashboards.streamlit import rollups
from dspark_obs.store import Store

__all__ = [
    "HIDDEN_CEILING",
    "MEASURED_CEILING_MODES",
    "NO_FILTER",
    "Filters",
    "ceiling_source",
    "filter_options",
    "frame",
    "in_list",
    "lit",
    "runs",
    "runs_of",
    "select",
    "store_rows",
]

# Modes whose ceiling is measured: the whole block was verified. A compact run's ceiling is
# hidden: never shown as if measured (it is the estimator's, labelled so, or unknown).
MEASURED_CEILING_MODES = ("cap-accept", "static")
HIDDEN_CEILING = "hidden"


def lit(value: str) -> str:
    """A SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def in_list(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(lit(v) for v in values)})"


@dataclass(frozen=True)
class Filters:
    """The sidebar's selection; an empty tuple means "all"."""

    runs: tuple[str, ...] = ()
    workloads: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()

    def where(self, run_col: str = "run_id", workload_col: str | None = "workload") -> str:
        """A SQL condition (``true`` when nothing is selected). Mode goes through ``runs``."""
        parts = []
        if self.runs:
            parts.append(in_list(run_col, self.runs))
        if self.modes:
            parts.append(
                f"{run_col} IN (SELECT run_id FROM runs WHERE {in_list('mode', self.modes)})"
            )
        if self.workloads and workload_col is not None:
            parts.append(in_list(f"coalesce({workload_col}, 'unknown')", self.workloads))
        return " AND ".join(parts) or "true"


NO_FILTER = Filters()  # everything: the default of every query


def frame(store: Store, sql: str) -> pd.DataFrame:
    return store.query(sql).to_pandas()


def runs(store: Store) -> pd.DataFrame:
    """The runs table (newest first), from the rollups: no query unless a run was added."""
    out = rollups.partials(store, "runs").drop_duplicates("run_id", keep="last")
    return out.sort_values(["started_at", "run_id"], ascending=[False, True],
                           na_position="last").reset_index(drop=True)  # fmt: skip


def runs_of(store: Store, run_ids: list[str]) -> pd.DataFrame:
    """run_id, mode, temperature of some runs: what the analytics need to read their rows."""
    return frame(store, f"SELECT run_id, mode, temperature FROM runs WHERE "
                        f"{in_list('run_id', tuple(run_ids))}")  # fmt: skip


_memory = duckdb.connect()  # in-memory: only the filter's key lists, never the store's rows
_memory_lock = threading.Lock()


def _strings(values: list[object]) -> pa.Array:
    return pa.array([v if isinstance(v, str) else None for v in values], pa.string())


@lru_cache(maxsize=256)
def _kept(
    condition: str, keys: tuple[tuple[str, ...], ...], modes: tuple[tuple[str, str | None], ...]
) -> frozenset[tuple[str, ...]]:
    """The keys (run_id[, workload]) the SQL ``condition`` keeps, given each run's mode."""
    width = len(keys[0]) if keys else 1
    names = ["run_id", "workload"][:width]
    key_table = pa.table({n: _strings([k[i] for k in keys]) for i, n in enumerate(names)})
    run_table = pa.table({"run_id": _strings([r for r, _ in modes]),
                          "mode": _strings([m for _, m in modes])})  # fmt: skip
    with _memory_lock:
        con = _memory.cursor()
    try:
        con.register("keys", key_table)
        con.register("runs", run_table)
        rows = con.execute(f"SELECT {', '.join(names)} FROM keys WHERE {condition}").fetchall()
    finally:
        con.close()
    return frozenset(tuple(r) for r in rows)


def _key_codes(rows: pd.DataFrame, use_workload: bool) -> tuple[np.ndarray, dict[int, tuple]]:
    """Each row's key (run_id[, workload]) as one integer, and the distinct keys by integer."""
    run_codes, run_ids = pd.factorize(rows["run_id"])  # a missing run_id: -1, kept by nothing
    if not use_workload:
        return run_codes, {i: (r,) for i, r in enumerate(run_ids)}
    wl_codes, wls = pd.factorize(rows["workload"].fillna("unknown"))  # as coalesce() in SQL
    codes = np.where(run_codes < 0, -1, run_codes.astype(np.int64) * len(wls) + wl_codes)
    present = np.unique(codes[codes >= 0])
    return codes, {int(c): (run_ids[c // len(wls)], wls[c % len(wls)]) for c in present}


def select(
    rows: pd.DataFrame, f: Filters, run_modes: pd.DataFrame, workload: bool = True
) -> pd.DataFrame:
    """The rows of a rollup frame that the filters keep: :meth:`Filters.where` itself, run by
    DuckDB over the frame's distinct keys and ``run_modes`` (run_id, mode), so the store's
    queries and the rollups can never disagree on what a selection means."""
    use_workload = workload and bool(f.workloads) and "workload" in rows.columns
    if not (f.runs or f.modes or use_workload) or len(rows) == 0:
        return rows
    codes, keys = _key_codes(rows, use_workload)
    pairs = zip(run_modes["run_id"], run_modes["mode"], strict=True)  # a missing mode: None
    modes = tuple(sorted({(r, m if isinstance(m, str) else None) for r, m in pairs},
                         key=lambda rm: (rm[0], rm[1] or "")))  # fmt: skip
    condition = f.where(workload_col="workload" if use_workload else None)
    kept = _kept(condition, tuple(sorted(keys.values())), modes)
    return rows.loc[np.isin(codes, [c for c, k in keys.items() if k in kept])]


def ceiling_source(mode: object) -> str:
    """How a run's ceiling is known: measured | hidden (compact) | unknown (no runs row)."""
    if mode in MEASURED_CEILING_MODES:
        return "measured"
    return "unknown" if not isinstance(mode, str) else HIDDEN_CEILING


def store_rows(store: Store) -> dict[str, int]:
    """Rows per table: tells an empty store (show the command to run) from a filled one."""
    return {
        "runs": len(runs(store)),
        "steps": int(rollups.partials(store, "steps")["steps_all"].sum()),
        "req_steps": int(rollups.partials(store, "req_steps")["n"].sum()),
        "requests": int(rollups.partials(store, "requests")["n"].sum()),
    }


def filter_options(store: Store) -> dict[str, list[str]]:
    """Values the sidebar offers: runs (newest first), workloads, modes."""
    all_runs = runs(store)
    workloads = set(rollups.partials(store, "requests")["workload"])
    workloads |= set(rollups.partials(store, "req_steps")["workload"])
    return {
        "runs": all_runs["run_id"].tolist(),
        "modes": sorted(set(all_runs["mode"].dropna())),
        "workloads": sorted(workloads),
    }
